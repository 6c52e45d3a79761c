"""What rolling back a verify costs: a speculative step's target side against a plain verify forward.

For a full-attention, a sliding-window and a hybrid (Gated DeltaNet + full attention, Qwen3.5's
layout) target of the same width and depth, randomly initialised, after a context of --context
tokens:

    plain(w)      one forward of w tokens over the cache (what a verify costs without any rollback)
    step(w, k)    ``SequenceTarget.verify`` of w tokens (linear states copied, their inputs recorded)
                  + ``keep`` of the first k rows (crop; linear states restored and replayed over k rows)

and the ratio step / plain, for k = 1 (every draft rejected), w / 2 and w (every draft accepted:
nothing to replay). ``rerun`` is the alternative rollback of linear states, plain(w) + plain(k)
(restore the copy, run the kept tokens through the whole model again), for comparison. Each figure
is the fastest of --repeats runs, round-robin, each from the same cache (on a shared machine other
work only ever adds time, so the minimum is the steadiest estimate).

    .venv/bin/python benchmarks/rollback_overhead.py --widths 4,8,16 --context 256 --threads 1 \
        --out benchmarks/results/rollback-overhead-cpu/results.json
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

from blockspec.clock import wall_clock
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.forward import SequenceTarget

SIZE = dict(vocab_size=16384, hidden_size=768, intermediate_size=2304, num_hidden_layers=8, num_attention_heads=6,
            num_key_value_heads=2, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False)


def targets(window: int) -> dict:
    sliding = ["sliding_attention", "full_attention"] * (SIZE["num_hidden_layers"] // 2)
    return {
        "full attention (qwen3)": Qwen3Config(**SIZE),
        f"sliding window {window} / full (qwen3)": Qwen3Config(**SIZE, layer_types=sliding, sliding_window=window,
                                                               use_sliding_window=True),
        "Gated DeltaNet 3:1 full (qwen3_5)": Qwen3_5TextConfig(**SIZE, linear_key_head_dim=128,
                                                              linear_value_head_dim=128, linear_num_key_heads=6,
                                                              linear_num_value_heads=12),
    }


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", default="4,8,16")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    return parser.parse_args()


def timed(device, run) -> float:
    began = wall_clock(device)
    run()
    return wall_clock(device) - began


def measure(model, context, widths, repeats, device) -> list[dict]:
    target = SequenceTarget(model, [0, model.config.num_hidden_layers - 1])
    with torch.inference_mode():
        target.prefill(context)
    saved = copy.deepcopy(target.cache)
    start = context.shape[1]
    tokens = torch.randint(0, model.config.vocab_size, (max(widths),), generator=torch.Generator().manual_seed(1))

    def plain(width):
        cache = copy.deepcopy(saved)
        ids = tokens[:width].unsqueeze(0).to(device)
        positions = torch.arange(start, start + width, device=device).unsqueeze(0)
        return timed(device, lambda: model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                                           output_hidden_states=True))

    def step(width, kept):
        target.cache = copy.deepcopy(saved)
        block = VerifyBlock(tokens[:width].tolist(), start)
        return timed(device, lambda: (target.verify([block]), target.keep([list(range(kept))])))

    cases = [(w, k) for w in widths for k in sorted({1, max(1, w // 2), w})]
    runs = {("plain", w): [] for w in {*widths, *(k for _, k in cases)}}
    runs.update({("step", w, k): [] for w, k in cases})
    with torch.inference_mode():
        for key in runs:  # warm-up
            plain(key[1]) if key[0] == "plain" else step(*key[1:])
        for _ in range(repeats):
            for key, seconds in runs.items():
                seconds.append(plain(key[1]) if key[0] == "plain" else step(*key[1:]))
    median = {key: min(values) for key, values in runs.items()}
    return [{"width": w, "kept": k, "plain_ms": 1e3 * median[("plain", w)], "step_ms": 1e3 * median[("step", w, k)],
             "ratio": median[("step", w, k)] / median[("plain", w)],
             "rerun_ratio": (median[("plain", w)] + median[("plain", k)]) / median[("plain", w)]}
            for w, k in cases]


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    widths = [int(w) for w in args.widths.split(",")]
    context = torch.randint(0, SIZE["vocab_size"], (1, args.context), generator=torch.Generator().manual_seed(0))
    results = {}
    for name, config in targets(args.window).items():
        model = AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()
        results[name] = measure(model, context.to(device), widths, args.repeats, device)
        print(f"\n{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
              f"context {args.context}, {args.device} {args.dtype}, {torch.get_num_threads()} threads")
        print("| width | kept | plain verify (ms) | spec step target side (ms) | step / plain | re-run / plain |")
        print("|---|---|---|---|---|---|")
        for row in results[name]:
            print(f"| {row['width']} | {row['kept']} | {row['plain_ms']:.1f} | {row['step_ms']:.1f} | "
                  f"{row['ratio']:.2f} | {row['rerun_ratio']:.2f} |")
        del model
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
