"""The command line: thin over the library."""

from __future__ import annotations

import argparse
import json
import sys

from blockspec.errors import BlockspecError


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
    return parser


def add_model_options(parser: argparse.ArgumentParser) -> None:
    from blockspec.hub import DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"target model: a local directory, a known name, or a hub name (default: {DEFAULT_TARGET})")
    parser.add_argument("--draft", default=None, help="drafter checkpoint directory (none: autoregressive decoding)")
    parser.add_argument("--method", default=None, choices=["dflash", "ar"],
                        help="drafting method (default: read from the draft checkpoint; 'ar' decodes without a drafter)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=None,
                        help="verify width: the last token + block_size-1 drafts (default: the drafter's trained size)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-sampling", choices=["sample", "greedy"], default="sample",
                        help="at temperature > 0: sample drafts and rejection-sample with q (default), "
                             "or draft greedily and accept with probability p(draft)")
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


def generation_config(args):
    from blockspec.decoding.generate import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed)


def load_models(args):
    """The target and the drafter the options name (the drafter is None for AR decoding)."""
    from transformers.utils import logging as hf_logging

    from blockspec.models import detect_method, load_drafter
    from blockspec.models.target import load_target

    if args.method not in (None, "ar") and args.draft is None:
        raise BlockspecError(f"--method {args.method} needs --draft DIR")
    autoregressive = args.method == "ar" or args.draft is None
    method = None if autoregressive else (args.method or detect_method(args.draft))  # checks the draft early
    hf_logging.disable_progress_bar()
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    if autoregressive:
        return target, None
    options = {"sample_drafts": args.draft_sampling == "sample"}
    return target, load_drafter(args.draft, target, method=method, **options)


def run_generate(args) -> int:
    from blockspec.decoding.text import stream_text

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = generation_config(args)
    target, drafter = load_models(args)
    stream = stream_text(target, prompt, drafter, config, use_chat_template=not args.no_chat_template)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps(result.to_dict()))
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


if __name__ == "__main__":
    sys.exit(main())
