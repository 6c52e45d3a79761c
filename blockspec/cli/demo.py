"""`blockspec demo`: DFlash against plain autoregressive decoding on a few bundled prompts."""

from __future__ import annotations

import sys

from blockspec.bench.datasets import BUNDLED
from blockspec.cli.options import add_device_options, add_target_option, block_size_arg, hide_loading_bars
from blockspec.demo import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DATASETS,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NUM_PROMPTS,
    DEFAULT_TREE_BUDGET,
    demo_prompts,
    run_demo,
)
from blockspec.errors import BlockspecError


def add_demo_command(commands) -> None:
    """Add ``demo`` to an argparse subparsers object."""
    parser = commands.add_parser("demo", help="DFlash vs autoregressive decoding on a few bundled prompts")
    add_target_option(parser)
    parser.add_argument("--draft", default=None,
                        help="DFlash drafter directory (default: the one shipped for the default target)")
    parser.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                        help=f"tokens per prompt (default: {DEFAULT_MAX_NEW_TOKENS})")
    parser.add_argument("--block-size", type=block_size_arg, default=DEFAULT_BLOCK_SIZE,
                        help="verify width: the last token + block_size-1 drafts, or 'auto' (chosen each step by the "
                             "cost model from the draft's confidence) (default: auto)")
    parser.add_argument("--tree-budget", type=int, default=DEFAULT_TREE_BUDGET,
                        help="verify a token tree of this many draft nodes (0: a chain) "
                             f"(default: {DEFAULT_TREE_BUDGET})")
    parser.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS,
                        help="number of prompts, dealt round-robin over the data sets "
                             f"(default: {DEFAULT_NUM_PROMPTS})")
    parser.add_argument("--dataset", action="append", default=None, metavar="NAME",
                        help=f"bundled prompt set, repeatable: {', '.join(BUNDLED)} "
                             f"(default: {', '.join(DEFAULT_DATASETS)})")
    add_device_options(parser)
    parser.set_defaults(run=run_demo_command)


def run_demo_command(args) -> int:
    """Load the models the options name and run the demo; 1 if any output differed from AR, else 0."""
    from rich.console import Console
    from rich.markup import escape

    from blockspec.decoding.compile_policy import compile_choice
    from blockspec.decoding.fast import fast_forward
    from blockspec.drafters.registry import load_drafter, shipped_draft
    from blockspec.models.target import load_target

    hide_loading_bars()
    prompts = demo_prompts(args.dataset, args.num_prompts)  # bad names fail before any loading
    draft = args.draft if args.draft is not None else shipped_draft(args.target)
    if draft is None:
        raise BlockspecError(f"no drafter is shipped for {args.target}: pass --draft DIR with a DFlash checkpoint "
                             "made for it")
    # Piped to a file or a CI log, rich would assume 80 columns and cut the table's figures.
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(f"loading the target {escape(str(args.target))} and the drafter {escape(str(draft))} ...",
                  style="dim")
    target = load_target(args.target, device=args.device, dtype=args.dtype, quantize=args.quantize)
    compiled, reason = compile_choice(target.model, args.compile)
    console.print(reason, style="dim")
    drafter = load_drafter(draft, target, packed=compiled)
    if compiled:
        fast_forward(target.model, drafter.feature_layers, progress=lambda line: console.print(line, style="dim"))
        fast_forward(target.model, None, progress=lambda line: console.print(line, style="dim"))
    figures = run_demo(target, drafter, prompts, max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                       tree_budget=args.tree_budget or None, compile=args.compile, console=console)
    return 0 if all(f["match"] for f in figures) else 1
