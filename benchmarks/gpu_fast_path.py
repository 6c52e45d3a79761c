"""The fast path on a CUDA GPU (bf16, CUDA graphs), for when a GPU machine is at hand: T(w) per forward path,
the DFlash drafter's pass, and AR tokens/s against HF generate (eager and compiled).

A lent GPU machine reaches nothing outside it and takes at most 64 MiB of files, so the targets are built
from their config.json with random weights: forward times do not depend on the weights (acceptance
does, so DFlash's speedup is projected from replayed acceptance, measured on the CPU with the real
weights: expected tokens/s at width w = tau(w) / (T_draft + T(w))). Run it there as

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
    python3 benchmarks/gpu_fast_path.py --out $OUT/gpu.json

with `.whl` holding transformers==5.24.0 (and its pins that the machine lacks), carried along. The
figures it prints go into benchmarks/README.md with the card that gave them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from blockspec.clock import wall_clock
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.fast import FastForward
from blockspec.decoding.forward import SequenceTarget
from blockspec.decoding.generate import speculative_generate, warm_up_fast_path
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.static_targets import StaticTarget

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_DRAFT = ROOT / "blockspec" / "assets" / "dflash-smollm2-135m"
TARGETS = {
    "smollm2-135m": LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                                rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
    "qwen2.5-coder-1.5b": Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                      num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                                      max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}
#: Replayed greedy tau of the shipped drafter on gsm8k-50 at these verify widths, 32 new tokens (CPU, real
#: weights; benchmarks/README.md, replay-final/widths-trees-50.json).
REPLAYED_TAU = {4: 2.26, 8: 2.66, 16: 2.83}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    return parser.parse_args()


def timed(fn, repeats: int, device) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        began = wall_clock(device)
        fn()
        runs.append(wall_clock(device) - began)
    return statistics.median(runs)


def verify_costs(model, widths, context, repeats, layers) -> dict:
    """T(w) in seconds for the eager dynamic-cache forward and the compiled fast path."""
    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    fast = FastForward(model, layers, compile=True)
    targets = {"dynamic": SequenceTarget(model, layers), "compiled": StaticTarget(fast, context + max(widths) + 1)}
    costs = {}
    for name, target in targets.items():
        target.prefill(prompt)
        for width in widths:
            block = VerifyBlock(list(range(5, 5 + width)), context)

            def verify():
                target.verify([block])
                target.keep([[]])

            costs.setdefault(name, {})[width] = timed(verify, repeats, device)
    return costs


def draft_cost(model, repeats) -> float | None:
    """Seconds of one DFlash pass over a 16-block (the shipped drafter's shape; SmolLM2 targets only)."""
    from blockspec.drafters.dflash import DFlashDrafter
    from blockspec.models.dflash.checkpoint import load_dflash_model
    from blockspec.sampling import SamplingConfig

    if model.config.hidden_size != 576:
        return None
    drafter = DFlashDrafter(load_dflash_model(SHIPPED_DRAFT), model)
    features = torch.randn(1, 256, 3 * 576, device=model.device, dtype=model.dtype)
    state = drafter.start(torch.zeros(1, 256, dtype=torch.long, device=model.device), features)

    def draft():
        drafter.commit(state, torch.tensor([[5, 6, 7]], device=model.device), features[:, :3])
        drafter.propose(state, 5, 15, SamplingConfig(), None)

    return timed(draft, repeats, model.device)


def ar_rates(model, context, new_tokens) -> dict:
    """Tokens/s of AR through the fast path, HF generate eager, and HF generate compiled (static cache)."""
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    device = model.device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=device)
    config = GenerationConfig(max_new_tokens=new_tokens, compile="on")
    warm_up_fast_path(model, None, config, context)

    def fast():
        list(speculative_generate(model, prompt, None, config))

    compile_config = CompileConfig(mode="reduce-overhead", dynamic=False)
    rates = {"fast-path ar": new_tokens / timed(fast, 3, device)}
    for name, options in (("hf", {}), ("hf-compiled", {"cache_implementation": "static",
                                                      "compile_config": compile_config})):
        generation = HFGenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                        pad_token_id=0, **options)
        rates[name] = new_tokens / timed(lambda: model.generate(prompt, generation_config=generation,
                                                                attention_mask=torch.ones_like(prompt)), 3, device)
    return rates


def main() -> None:
    args = parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "targets": {}}
    for name in args.targets.split(","):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(TARGETS[name]).to("cuda", torch.bfloat16).eval()
        model.requires_grad_(False)
        layers = [1, 15, 29] if name == "smollm2-135m" else None
        began = time.perf_counter()
        with torch.inference_mode():
            costs = verify_costs(model, widths, args.context, args.repeats, layers)
            draft = draft_cost(model, args.repeats)
            rates = ar_rates(model, args.context, args.new_tokens)
        figures = {"verify_seconds": costs, "draft_seconds": draft, "ar_tokens_per_s": rates,
                   "seconds": time.perf_counter() - began}
        if draft is not None:
            figures["projected_dflash_tokens_per_s"] = {
                w: tau / (draft + costs["compiled"][w]) for w, tau in REPLAYED_TAU.items() if w in costs["compiled"]}
        report["targets"][name] = figures
        print(json.dumps({name: figures}, indent=1), flush=True)
        del model
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
