"""The command line: thin over the library."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from blockspec.bench.cli import add_bench_command
from blockspec.demo import add_demo_command
from blockspec.dllm.cli import add_dllm_parsers
from blockspec.errors import BlockspecError
from blockspec.hub import DEFAULT_TARGET

TREE_TOP_K = 8  # blockspec.decoding.tree.DEFAULT_TREE_TOP_K, not imported: the CLI starts without torch


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        return args.run(args) or 0
    except BlockspecError as error:
        print(f"blockspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("blockspec: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec", description="Lossless speculative decoding with DFlash drafters.")
    commands = parser.add_subparsers(metavar="COMMAND")
    add_generate_command(commands)
    add_models_command(commands)
    add_train_draft_command(commands)
    add_dllm_parsers(commands)
    add_demo_command(commands)
    add_bench_command(commands)
    add_serve_command(commands)
    add_loadtest_command(commands)
    return parser


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"target model: a local directory, a known name, or a hub name (default: {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=None,
                        help="the drafter: a DFlash, EAGLE-3 or MTP checkpoint directory, or for --method draft a small causal LM "
                             "(directory or known name) with the target's tokenizer (default: the shipped DFlash "
                             "drafter for the default target, none for other targets: autoregressive decoding)")
    parser.add_argument("--method", default=None, choices=["dflash", "eagle3", "mtp", "draft", "ngram", "ar"],
                        help="drafting method: dflash, eagle3, mtp, draft (a small draft LM), ngram (prompt lookup, "
                             "no --draft) "
                             "or ar (no drafter) (default: read from the --draft checkpoint)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")


def block_size_arg(value: str):
    """--block-size: a whole number >= 1, or 'auto'."""
    if value == "auto":
        return value
    try:
        return int(value)  # the range is checked with the other decoding values
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {value!r}") from None


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="verify width: the last token + block_size-1 drafts, or 'auto' (chosen each step by "
                             "the cost model from the draft's confidence) (default: auto for a dflash chain, "
                             "else the drafter's trained size)")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="verify a token tree of this many draft nodes per step (dflash; e.g. 16, 32, 64) "
                             "instead of one chain")
    parser.add_argument("--tree-top-k", type=int, default=TREE_TOP_K,
                        help=f"children per tree node at most (default {TREE_TOP_K})")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-sampling", choices=["sample", "greedy"], default="sample",
                        help="at temperature > 0: sample drafts and rejection-sample with q (default), "
                             "or draft greedily and accept with probability p(draft)")
    parser.add_argument("--denoise-steps", type=int, default=1, metavar="K",
                        help="dflash: denoise the draft block in K passes, each committing the most confident "
                             "masked positions (default 1: the whole block in one pass); with K > 1 drafts "
                             "are greedy at any temperature")
    parser.add_argument("--no-chat-template", action="store_true", help="encode the prompt as plain text")


def add_generate_command(commands) -> None:
    parser = commands.add_parser("generate", help="generate text from a prompt, streaming")
    add_model_options(parser)
    add_sampling_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    parser.set_defaults(run=run_generate)


def add_models_command(commands) -> None:
    parser = commands.add_parser("models", help="list or prepare the known models that install offline")
    actions = parser.add_subparsers(metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="show the known models and whether they are prepared")
    listing.set_defaults(run=run_models_list)
    prepare = actions.add_parser("prepare", help="install and convert a known model once")
    prepare.add_argument("name")
    prepare.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prepare.set_defaults(run=run_models_prepare)


def add_train_draft_command(commands) -> None:
    parser = commands.add_parser("train-draft", help="train a DFlash drafter for a target model")
    parser.add_argument("--target", required=True, help="target model: directory, known name, or hub name")
    parser.add_argument("--data", dest="files", nargs="+", required=True, help="prompt files (jsonl / json)")
    parser.add_argument("--out", required=True, help="output directory (checkpoints/, draft/, data/)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    data = parser.add_argument_group("data")
    data.add_argument("--num-prompts", type=int, default=None)
    data.add_argument("--responses", choices=["target", "data", "cache"], default="target",
                      help="train on responses generated by the target (default), given in the data, "
                           "or in an existing --cache as it is")
    data.add_argument("--cache", nargs="+", default=None, metavar="FILE",
                      help="response cache (default: OUT/data/responses.jsonl); with --responses cache, several "
                           "files are pooled")
    data.add_argument("--max-new-tokens", type=int, default=256, help="response length when generating")
    data.add_argument("--generation-batch-size", type=int, default=32)
    data.add_argument("--temperature", type=float, default=0.0, help="sampling temperature when generating")
    data.add_argument("--held-out", type=int, default=4, help="prompts kept out of training for the tau eval")
    draft = parser.add_argument_group("drafter")
    draft.add_argument("--method", choices=["dflash", "eagle3", "mtp", "draft"], default="dflash",
                       help="what to train: dflash, eagle3, mtp, or draft (a small LM made of --num-layers of "
                            "the target's layers) (default dflash)")
    draft.add_argument("--num-layers", type=int, default=2, help="draft layers (dflash, draft)")
    draft.add_argument("--block-size", type=int, default=16)
    draft.add_argument("--mask-token-id", type=int, default=None)
    draft.add_argument("--intermediate-size", type=int, default=None)
    draft.add_argument("--target-layers", dest="target_layer_ids", type=layer_list, default=None, metavar="I,J,...",
                       help="target layers whose outputs the drafter reads, e.g. 1,15,29 (dflash default: as many "
                            "as draft layers, spread over depth; eagle3: three)")
    draft.add_argument("--init-from", default=None, metavar="DIR",
                       help="start from this drafter's weights (same architecture) with a fresh optimizer and "
                            "learning-rate schedule, e.g. to continue a finished run on more data")
    draft.add_argument("--grow-layers", action="store_true",
                       help="dflash, with --init-from: that drafter may have fewer layers than --num-layers; its "
                            "layers keep their weights and the new last ones start as identities (zero output "
                            "projections), so training starts from its drafts with more capacity")
    draft.add_argument("--ttt-steps", type=int, default=4,
                       help="eagle3/mtp: recursion steps unrolled in training (training-time test)")
    draft.add_argument("--step-decay", type=float, default=None,
                       help="eagle3/mtp: loss weight decay per step (default 0.8 eagle3, 0.6 mtp)")
    draft.add_argument("--draft-vocab-size", type=int, default=4096,
                       help="eagle3/mtp: draft vocabulary, the most frequent response tokens (default 4096)")
    recipe = parser.add_argument_group("recipe (ablation switches)")
    recipe.add_argument("--fixed-blocks", dest="random_anchors", action="store_false",
                        help="consecutive blocks instead of random anchors")
    recipe.add_argument("--uniform-weights", dest="decay_weights", action="store_false",
                        help="uniform loss weights instead of exp(-(k-1)/gamma)")
    recipe.add_argument("--gamma", type=float, default=None, help="loss decay (default 7 for block 16)")
    recipe.add_argument("--soft-labels", action="store_true",
                        help="dflash: learn the target's whole next-token distribution at each block position "
                             "(read from its last layer, which must be among --target-layers) instead of its token")
    recipe.add_argument("--anchors-per-sequence", type=int, default=32)
    recipe.add_argument("--max-length", type=int, default=1024)
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--epochs", type=float, default=1.0)
    optim.add_argument("--max-steps", type=int, default=None)
    optim.add_argument("--batch-size", type=int, default=4)
    optim.add_argument("--grad-accum", type=int, default=1)
    optim.add_argument("--lr", type=float, default=6e-4)
    optim.add_argument("--warmup-ratio", type=float, default=0.04)
    optim.add_argument("--grad-clip", type=float, default=1.0)
    optim.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto",
                       help="auto: bf16 autocast on CUDA, fp32 on CPU; bf16 forces autocast "
                            "(worth it on CPUs with bf16 units)")
    optim.add_argument("--seed", type=int, default=0)
    optim.add_argument("--feature-cache", dest="feature_cache_dir", default=None, metavar="DIR",
                       help="keep the target's context features on disk in DIR instead of in memory (length x "
                            "target layers x hidden size values per sequence: 1.8 MB for 512 tokens of SmolLM2 "
                            "with 3 layers in bf16); reused by every run and resume on the same target and layers")
    optim.add_argument("--no-feature-cache", dest="cache_features", action="store_false",
                       help="recompute the target's features every step instead of keeping them")
    optim.add_argument("--save-every", type=int, default=200)
    optim.add_argument("--eval-every", type=int, default=0)
    parser.set_defaults(run=run_train_draft)


def layer_list(text: str) -> list[int]:
    """'1,15,29' -> [1, 15, 29] (for --target-layers)."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers separated by commas, e.g. 1,15,29; got {text!r}")
    if not layers or any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"expected layer numbers >= 0 separated by commas, got {text!r}")
    return layers


def run_train_draft(args) -> int:
    from transformers.utils import logging as hf_logging

    from blockspec.training.pipeline import config_from_args, train_draft

    hf_logging.disable_progress_bar()
    data, train = config_from_args(args)
    try:
        path = train_draft(args.target, data, train, resume=args.resume, device=args.device)
    except KeyboardInterrupt:
        print(f"blockspec: training interrupted; resume with --resume --out {args.out}", file=sys.stderr)
        return 130
    print(path)
    return 0


def generation_config(args):
    from blockspec.decoding.sequence import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            tree_budget=args.tree_budget, tree_top_k=args.tree_top_k)


def load_models(args):
    """The target and the drafter the options name (the drafter is None for AR decoding)."""
    from transformers.utils import logging as hf_logging

    from blockspec.drafters.registry import build_drafter, detect_method, shipped_draft
    from blockspec.models.target import load_target

    method = args.method
    if method == "ngram" and args.draft is not None:
        raise BlockspecError("--method ngram drafts from the prompt and takes no --draft: drop --draft")
    if args.draft is None and method in (None, "dflash") and shipped_draft(args.target) is not None:
        args.draft = str(shipped_draft(args.target))
    if method in ("dflash", "eagle3", "mtp", "draft") and args.draft is None:
        what = "MODEL (a causal LM directory or a known name)" if method == "draft" else "DIR"
        raise BlockspecError(f"--method {method} needs --draft {what}")
    autoregressive = method == "ar" or (method is None and args.draft is None)
    if not autoregressive and method is None:
        method = detect_method(args.draft)  # checks the draft before the target loads
    options = drafter_options(args, "ar" if autoregressive else method)
    hf_logging.disable_progress_bar()
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    if autoregressive:
        return target, None
    return target, build_drafter(method, target, None if method == "ngram" else args.draft, **options)


def drafter_options(args, method: str) -> dict:
    """The options of the drafter ``method`` from the command line."""
    denoise_steps = getattr(args, "denoise_steps", 1)  # serve has no --denoise-steps
    if denoise_steps != 1 and method != "dflash":
        raise BlockspecError(f"--denoise-steps is for the dflash drafter (a block denoiser), not {method}: "
                             "drop it or use --method dflash")
    options = {} if method in ("ngram", "ar") else {"sample_drafts": args.draft_sampling == "sample"}
    if method == "dflash":
        options["denoise_steps"] = denoise_steps
    return options


def run_generate(args) -> int:
    from blockspec.decoding.sequence import preferred_block_size
    from blockspec.decoding.text import stream_text

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = generation_config(args)  # bad values are refused before the models load
    target, drafter = load_models(args)
    config = dataclasses.replace(config, block_size=preferred_block_size(drafter, config))
    stream = stream_text(target, prompt, drafter, config, use_chat_template=not args.no_chat_template)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"method": "ar" if drafter is None else drafter.name, **result.to_dict()}))
    else:
        stats = result.stats
        print(f"\n[{'AR' if drafter is None else drafter.name}] {stats.new_tokens} tokens, "
              f"tau {stats.tau:.2f}, {stats.tokens_per_s:.1f} tokens/s, "
              f"first token {stats.time_to_first_token * 1000:.0f} ms", file=sys.stderr)
    return 0


def run_models_list(args) -> int:
    from blockspec import hub

    for row in hub.list_models():
        state = f"prepared at {row['path']}" if row["prepared"] else "not prepared"
        default = " (default)" if row["default"] else ""
        print(f"{row['name']}{default}: {row['role']}, {row['size']}, {row['licence']}; {state}")
    return 0


def run_models_prepare(args) -> int:
    from blockspec import hub

    print(hub.prepare(args.name, force=args.force))
    return 0


def add_serve_command(commands) -> None:
    parser = commands.add_parser("serve", help="serve the target over an OpenAI-compatible HTTP API")
    add_model_options(parser)
    parser.add_argument("--draft-sampling", choices=["sample", "greedy"], default="sample",
                        help="at temperature > 0: sample drafts (default) or draft greedily")
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="verify width of every request (default: the drafter's trained size); 'auto' "
                             "chooses it each step, and then requests are decoded one at a time")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="verify a token tree of this many draft nodes (dflash); requests are then decoded "
                             "one at a time")
    parser.add_argument("--tree-top-k", type=int, default=TREE_TOP_K,
                        help=f"children per tree node at most (default {TREE_TOP_K})")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=8, help="rows decoded together (default 8)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests in flight (waiting + decoding) before new ones get 503 (default 64)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 endpoints")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(run=run_serve)


def run_serve(args) -> int:
    import uvicorn

    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.serve.app import create_app
    from blockspec.serve.engine import DecodingOptions

    if not 0 < args.port < 65536:
        raise BlockspecError(f"--port must be 1..65535, got {args.port}")
    decoding = DecodingOptions(args.block_size, args.tree_budget, args.tree_top_k)
    GenerationConfig(**decoding.config_fields())  # bad values are refused before the models load
    target, drafter = load_models(args)
    app = create_app(target, drafter, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                     api_key=args.api_key, decoding=decoding)
    how = "one request at a time" if decoding.per_sequence else f"batches of up to {args.max_batch_size}"
    print(f"blockspec: serving {target.name} ({'AR' if drafter is None else drafter.name}, {how}) at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def add_loadtest_command(commands) -> None:
    parser = commands.add_parser("loadtest",
                                 help="measure a local `blockspec serve` with concurrent streaming requests")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback addresses only)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=None, help="the user message of every request")
    parser.add_argument("--dataset", default=None,
                        help="cycle through the prompts of a bundled benchmark set instead (gsm8k, humaneval, ...)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature of the requests (default: the server's, 1.0; 0 is greedy)")
    parser.add_argument("--model", default=None, help="model id to request (default: the one the server lists)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=300.0, help="time limit for the whole run in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run_loadtest)


def run_loadtest(args) -> int:
    from blockspec.serve.loadtest import DEFAULT_PROMPT, print_report
    from blockspec.serve.loadtest import run_loadtest as load

    prompt = args.prompt or DEFAULT_PROMPT
    if args.dataset:
        from blockspec.bench.datasets import load_benchmark_prompts

        prompt = [row["turns"][0] for row in load_benchmark_prompts(args.dataset, num_prompts=args.requests)]
    report = load(args.url, concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
                  prompt=prompt, timeout=args.timeout, model=args.model, api_key=args.api_key,
                  temperature=args.temperature)
    print_report(report, args.json)
    return 0 if report.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
