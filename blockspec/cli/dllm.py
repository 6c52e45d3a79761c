"""`blockspec dllm train|generate|bench`: diffusion language models from the command line."""

from __future__ import annotations

import argparse
import json
import sys

from blockspec.cli.options import add_keep_last_option, hide_loading_bars, keep_last_given, read_prompt, seed_arg
from blockspec.dllm.canvas import MASK_GLYPH, committed_text, render_canvas
from blockspec.errors import BlockspecError
from blockspec.extras import require_extra
from blockspec.hub import DEFAULT_TARGET
from blockspec.tokens import encode_prompt


def add_dllm_command(commands) -> None:
    """The `dllm` command and its actions, under the top-level subparsers ``commands``."""
    parser = commands.add_parser("dllm", help="diffusion language models: generate, adapt an AR model into one "
                                              "(train), benchmark sampler settings (bench)")
    actions = parser.add_subparsers(metavar="ACTION", required=True)
    add_generate_parser(actions)
    add_train_parser(actions)
    add_bench_parser(actions)


def add_train_parser(actions) -> None:
    parser = actions.add_parser(
        "train", help="adapt a causal LM into a masked diffusion LM (Dream-style) on prompt/response data",
        description="Start from the AR weights, train with the masked-diffusion loss (1/t weighted) under "
                    "bidirectional or block-causal attention; checkpoints in OUT/checkpoints, the model in OUT/model.")
    parser.add_argument("--init", default=DEFAULT_TARGET,
                        help=f"the causal LM to start from: a directory or a known name (default: {DEFAULT_TARGET})")
    parser.add_argument("--data", dest="files", nargs="+", required=True,
                        help="prompt files whose rows carry the response (jsonl / json: gsm8k question/answer, "
                             "alpaca, messages ending on an assistant turn ...) or response caches")
    parser.add_argument("--out", required=True, help="output directory (checkpoints/, model/)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=256, help="tokens per sequence, prompt included")
    parser.add_argument("--attention", choices=["bidirectional", "block_causal"], default="bidirectional",
                        help="bidirectional (LLaDA, Dream) or block_causal (block diffusion: each block is denoised "
                             "from the clean blocks before it) (default bidirectional)")
    parser.add_argument("--block-size", type=int, default=32, help="block_causal: positions per block (default 32)")
    parser.add_argument("--no-shift", dest="shifted", action="store_false",
                        help="predict token i at position i (default: at i-1, as the AR model did)")
    parser.add_argument("--pretrain", dest="sft", action="store_false",
                        help="mask the prompt too (default: SFT, only response tokens are masked)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="the mask token (default: the tokenizer's mask token or a spare special token)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (0: only at the end)")
    add_keep_last_option(parser)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: where the model loads, cpu)")
    parser.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from blockspec.dllm.train import DiffusionTrainConfig, adapt, mean_losses

    hide_loading_bars()
    config = DiffusionTrainConfig(
        out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
        attention=args.attention, block_size=args.block_size, shifted=args.shifted, sft=args.sft,
        mask_token_id=args.mask_token_id, seed=args.seed, save_every=args.save_every, **keep_last_given(args))
    try:
        path, state = adapt(args.init, args.files, config, resume=args.resume, device=args.device)
    except KeyboardInterrupt:
        print(f"blockspec: training interrupted; continue with --resume --out {args.out}", file=sys.stderr)
        return 130
    first, last, window = mean_losses(state.losses)
    print(f"loss {first:.3f} (mean of the first {window} steps) -> {last:.3f} (mean of the last {window}), "
          f"{state.step} steps, {state.seconds_per_step:.2f} s/step", file=sys.stderr)
    print(f"saved the diffusion model to {path}")
    return 0


def add_sampler_options(parser: argparse.ArgumentParser) -> None:
    from blockspec.dllm.generate import CACHE_MODES, SAMPLER_PRESETS
    from blockspec.dllm.schedule import COUNT_RULES, SCORES, SELECTIONS

    parser.add_argument("--sampler", choices=list(SAMPLER_PRESETS), default="llada",
                        help="preset: llada (blocks of 32, confidence), dream (one block, entropy), fast-dllm "
                             "(threshold 0.9, dual cache), block-diffusion (exact block cache) (default llada)")
    parser.add_argument("--gen-length", type=int, default=128, help="answer length in tokens (default 128)")
    parser.add_argument("--block-length", type=int, default=None, help="semi-autoregressive block length")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps in all (default: gen-length)")
    parser.add_argument("--count", choices=COUNT_RULES, default=None, help="how many tokens each step commits")
    parser.add_argument("--score", choices=SCORES, default=None, help="how candidate tokens are scored")
    parser.add_argument("--select", choices=SELECTIONS, default=None, help="best scores, or sampled with --alg-temp")
    parser.add_argument("--threshold", type=float, default=None, help="confidence threshold (count=threshold)")
    parser.add_argument("--alg-temp", type=float, default=None, help="temperature of sampled selection")
    parser.add_argument("--cache", choices=CACHE_MODES, default=None, help="none, prefix, dual, exact")
    parser.add_argument("--attention", choices=["bidirectional", "block_causal"], default=None,
                        help="override the attention the model was trained with")
    parser.add_argument("--cfg-scale", type=float, default=None, help="classifier-free guidance scale (no cache)")
    parser.add_argument("--temperature", type=float, default=None, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=seed_arg, default=None)


def sampler_config(args):
    import dataclasses

    from blockspec.dllm.generate import SAMPLER_PRESETS, DiffusionConfig

    preset_scheduler = SAMPLER_PRESETS[args.sampler]["scheduler"]
    scheduler_changes = {name: getattr(args, name) for name in ("count", "score", "select", "threshold", "alg_temp")
                         if getattr(args, name) is not None}
    return DiffusionConfig.preset(
        args.sampler, gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
        scheduler=dataclasses.replace(preset_scheduler, **scheduler_changes), cache=args.cache,
        attention=args.attention, cfg_scale=args.cfg_scale, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed)


def add_model_loading_options(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--model", required=required,
                        help="a masked diffusion model directory: adapted by `blockspec dllm train`, or LLaDA / Dream")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the modelling code that ships with a LLaDA or Dream checkpoint")
    parser.add_argument("--mask-token-id", type=int, default=None, help="override the model's mask token")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)


def add_generate_parser(commands) -> None:
    parser = commands.add_parser("generate", help="generate with a masked diffusion LM, streaming")
    add_model_loading_options(parser)
    add_sampler_options(parser)
    parser.add_argument("--no-chat-template", action="store_true", help="encode the prompt as plain text")
    parser.add_argument("--show-steps", action="store_true",
                        help=f"print the answer after every step, masks shown as {MASK_GLYPH} (to standard error)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    parser.set_defaults(run=run_generate)


def run_generate(args) -> int:
    from blockspec.dllm.generate import diffusion_generate
    from blockspec.dllm.model import load_diffusion_model

    prompt = read_prompt(args.prompt)
    if not prompt.strip():
        raise BlockspecError("the prompt is empty: give some text to answer")
    config = sampler_config(args)
    hide_loading_bars()
    model, tokenizer = load_diffusion_model(args.model, trust_remote_code=args.trust_remote_code, device=args.device,
                                            dtype=args.dtype, mask_token_id=args.mask_token_id)
    ids = encode_prompt(tokenizer, prompt, use_chat_template=not args.no_chat_template)
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    stream = diffusion_generate(model, [ids], config, eos_token_ids=eos)
    printed = ""
    for event in stream:
        canvas = event.canvas[0].tolist()
        if args.show_steps:
            print(render_canvas(tokenizer, canvas, model.mask_token_id), file=sys.stderr)
        if not args.json:
            printed = print_new_prefix(tokenizer, canvas, model.mask_token_id, printed, eos)
    answer = tokenizer.decode(stream.token_ids[0], skip_special_tokens=True)
    if args.json:
        print(json.dumps({"text": answer, "token_ids": stream.token_ids[0], **stream.stats.to_dict()}))
        return 0
    rest = answer[len(printed):] if answer.startswith(printed) else "\n" + answer
    print(rest, flush=True)
    stats = stream.stats
    print(f"[{args.sampler}] {stats.tokens[0]} tokens in {stats.steps} steps, {stats.forwards} forwards, "
          f"{stats.tokens_per_s:.1f} tokens/s", file=sys.stderr)
    return 0


def print_new_prefix(tokenizer, canvas, mask_id, printed: str, stop_ids) -> str:
    """Print what the committed text adds to ``printed``; the text printed so far."""
    text = committed_text(tokenizer, canvas, mask_id, stop_ids)
    if text.startswith(printed) and len(text) > len(printed):
        print(text[len(printed):], end="", flush=True)
        return text
    return printed


def add_bench_parser(commands) -> None:
    parser = commands.add_parser(
        "bench", help="gsm8k accuracy, tokens/s and forwards per token of sampler settings, beside the AR target")
    add_model_loading_options(parser)
    parser.add_argument("--setting", dest="settings", nargs="+", default=None, metavar="SAMPLER[:k=v,...]",
                        help="settings to compare, e.g. llada:steps=64 fast-dllm:threshold=0.9,cache=dual "
                             "(default: steps = gen-length, /2, /4 and threshold 0.9 with and without a cache)")
    parser.add_argument("--gen-length", type=int, default=128)
    parser.add_argument("--dataset", default="gsm8k", help="gsm8k (or a JSON-lines file with answers)")
    parser.add_argument("--source", default="bundled",
                        help="bundled, hub, or a data directory (e.g. ../shared/datasets)")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts denoised together (default 1)")
    parser.add_argument("--ar-target", default=DEFAULT_TARGET,
                        help="the AR model to compare with on the same prompts "
                             f"('none' to skip; default {DEFAULT_TARGET})")
    parser.add_argument("--seed", type=seed_arg, default=0)
    parser.add_argument("--out", default="runs/dllm-bench",
                        help="where summary.json, samples.jsonl and the plot go (rewritten after every setting)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the settings an earlier run with the same options finished in --out; run the rest")
    parser.set_defaults(run=run_bench)


def run_bench(args) -> int:
    from pathlib import Path

    from blockspec.bench.datasets import load_benchmark_prompts
    from blockspec.dllm import bench
    from blockspec.dllm.model import load_diffusion_model

    require_extra("bench", "blockspec dllm bench (its accuracy-vs-speed plot)")
    if args.batch_size < 1:
        raise BlockspecError(f"--batch-size must be >= 1, got {args.batch_size}")
    specs = args.settings or bench.default_settings(args.gen_length)
    configs = [(spec, bench.parse_setting(spec, args.gen_length, args.seed)) for spec in specs]
    rows = load_benchmark_prompts(args.dataset, source=args.source, num_prompts=args.num_prompts)
    hide_loading_bars()
    model, tokenizer = load_diffusion_model(args.model, trust_remote_code=args.trust_remote_code, device=args.device,
                                            dtype=args.dtype, mask_token_id=args.mask_token_id)
    prompt_ids = [encode_prompt(tokenizer, row["turns"][0]) for row in rows]
    meta = {"model": args.model, "dataset": args.dataset, "num_prompts": len(rows), "gen_length": args.gen_length,
            "batch_size": args.batch_size, "ar_target": args.ar_target, "seed": args.seed}
    out = Path(args.out)
    results = bench.load_report(out, meta) if args.resume else []
    done = {result.name for result in results}
    if done:
        print(f"resuming: {', '.join(sorted(done))} already in {out}")
    if args.ar_target != "none" and bench.AR_NAME not in done:
        results.insert(0, run_ar(args, rows))
        bench.write_report(results, out, meta)
    for spec, config in configs:
        if spec in done:
            continue
        results.append(bench.run_setting(model, tokenizer, rows, prompt_ids, spec, config,
                                         batch_size=args.batch_size))
        bench.write_report(results, out, meta)
    print(bench.format_table(results))
    print(f"report: {args.out}/summary.json, samples.jsonl, accuracy_vs_speed.png")
    return 0


def run_ar(args, rows):
    from blockspec.dllm import bench
    from blockspec.models.target import load_target

    target = load_target(args.ar_target, device=args.device, dtype=args.dtype)
    ar_ids = [target.encode_prompt(row["turns"][0]) for row in rows]  # its own tokenizer and template
    return bench.run_autoregressive(target.model, target.tokenizer, rows, ar_ids, args.gen_length)
