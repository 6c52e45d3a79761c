"""`blockspec bench`: every method side by side on the benchmark sets; `--compare` two runs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from blockspec.cli.options import COMPILE_CHOICES, add_quantize_option, block_size_arg, seed_arg
from blockspec.drafters.registry import DRAFT_METHODS, DRAFTED_METHODS
from blockspec.errors import BlockspecError
from blockspec.extras import require_extra
from blockspec.hub import DEFAULT_TARGET

DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt_bench")
DEFAULT_NUM_PROMPTS = 10
DEFAULT_MAX_NEW_TOKENS = 128


def add_bench_command(commands) -> None:
    parser = commands.add_parser(
        "bench", help="benchmark decoding methods side by side (tau, tokens/s, speedup, TTFT, memory)",
        description="Decode the same prompts with every method in one process, interleaved prompt by prompt, "
                    "and write results.json, results.md and PNG plots. In greedy runs every method's tokens are "
                    "checked against ar's; any difference makes the exit code 1.")
    add_models_group(parser.add_argument_group("models"))
    add_prompts_group(parser.add_argument_group("prompts"))
    add_decoding_group(parser.add_argument_group("decoding"))
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, help="output directory (default: runs/bench-TIMESTAMP)")
    output.add_argument("--no-plots", action="store_true")
    output.add_argument("--no-progress", action="store_true")
    output.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print two earlier runs side by side and exit")
    parser.set_defaults(run=run_bench_command)


def add_models_group(models) -> None:
    drafted_with_method = [name for name in DRAFTED_METHODS if name != "dflash"]
    models.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default: {DEFAULT_TARGET})")
    models.add_argument("--methods", default=None,
                        help="comma-separated: ar, hf, hf-compiled, hf-prompt-lookup, hf-assisted, and the drafters "
                             f"{', '.join(DRAFT_METHODS)}, each also as METHOD@WIDTH with its own verify "
                             "width, e.g. dflash@4,dflash@16,dflash@auto, or with a token tree of N nodes, "
                             "dflash@t32; dflash also as dflash[@WIDTH]/dK, drafting in K denoising passes, "
                             "e.g. dflash/d2,dflash@8/d4, and as dflash[@WIDTH]/vK, drafting over the K tokens most "
                             "frequent in --draft-vocab-data (default: ar,hf,hf-compiled,hf-prompt-lookup,ngram, "
                             "plus the methods of every --draft and of the drafters shipped for the target, plus "
                             "draft,hf-assisted with --assistant or a draft model)")
    models.add_argument("--draft", action="append", default=[], metavar="[METHOD=]DIR",
                        help="a drafter checkpoint: DIR for dflash, or METHOD=DIR for "
                             f"{', '.join(drafted_with_method)} "
                             "(repeatable; default for the default target: the shipped DFlash, EAGLE-3, MTP and "
                             "draft-model drafters)")
    models.add_argument("--assistant", default=None,
                        help="a smaller causal LM with the target's tokenizer (directory or known name), "
                             "the draft model of both 'draft' and 'hf-assisted'")
    models.add_argument("--draft-vocab-data", nargs="+", default=None, metavar="FILE",
                        help="the data dflash/vK methods count their K tokens in: response caches or prompt files "
                             "(never the benchmark's own prompts)")
    models.add_argument("--device", default=None)
    models.add_argument("--dtype", default=None)
    models.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="blockspec's own methods (ar and the drafters) run the target through the fast path "
                             "('on'), the eager forward ('off'), or the fast path where it pays ('auto'); the "
                             "hf-compiled baseline is HF generate with a static cache and torch.compile "
                             "(default: auto)")
    add_quantize_option(models)


def add_prompts_group(data) -> None:
    data.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS),
                      help="gsm8k, math500, humaneval, mbpp, mt_bench, code_edit, or JSON-lines prompt files "
                           f"(default: {' '.join(DEFAULT_DATASETS)})")
    data.add_argument("--data-dir", default=None,
                      help="read the full sets from a directory laid out like the offline copies, or 'hub' "
                           "to load them by hub name (default: the subsets bundled in the package)")
    data.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="prompts per dataset")
    data.add_argument("--seed", type=seed_arg, default=None,
                      help="choose the prompts at random with this seed (default: the first ones); "
                           "also seeds sampling")
    data.add_argument("--max-turns", type=int, default=None, help="turns of a multi-turn prompt to decode")
    data.add_argument("--no-chat-template", action="store_true")


def add_decoding_group(decoding) -> None:
    decoding.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    decoding.add_argument("--block-size", type=block_size_arg, default=None,
                          help="verify width of the drafting methods, or 'auto' (adaptive width)")
    decoding.add_argument("--temperature", type=float, default=0.0)
    decoding.add_argument("--top-p", type=float, default=1.0)
    decoding.add_argument("--top-k", type=int, default=0)
    decoding.add_argument("--warmup-tokens", type=int, default=16)


def run_bench_command(args) -> int:
    from blockspec.bench import report

    if args.compare:
        first, second = (report.load_results(path) for path in args.compare)
        print(report.compare_runs(first, second, labels=tuple(args.compare)), end="")
        return 0
    from blockspec.bench.calibration import write_calibration
    from blockspec.bench.runner import run_benchmark
    from blockspec.bench.setup import load_methods, load_prompts

    check_method_names(args.methods)
    if not args.no_plots:
        require_extra("bench", "blockspec bench's PNG plots", otherwise="pass --no-plots")
    config = bench_config(args)
    prompts = load_prompts(args.datasets, args.data_dir, args.num_prompts, args.seed)
    target, methods = load_methods(args.target, args.methods, args.draft, args.assistant, device=args.device,
                                   dtype=args.dtype, block_size=args.block_size, compile=args.compile,
                                   draft_vocab_data=args.draft_vocab_data, quantize=args.quantize)
    out = Path(args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"blockspec bench: {len(prompts)} prompts x {', '.join(m.name for m in methods)} on {target.name}",
          file=sys.stderr)
    run = run_benchmark(target, methods, prompts, config, progress=not args.no_progress)
    paths = report.write_outputs(run, out, plots=not args.no_plots)
    paths.update(write_calibration(methods, out, plots=not args.no_plots))
    summary = report.summarize(run.records, run.methods)
    print(report.markdown_table(summary), end="")
    for kind, path in paths.items():
        print(f"{kind}: {path}", file=sys.stderr)
    return exit_code(run, len(methods), out)


def check_method_names(value: str | None) -> None:
    """Refuse an unknown --methods name before anything loads, listing every method there is."""
    from blockspec.bench.methods import BASELINES, parse_method_name

    known = [*BASELINES, "hf-assisted", *DRAFT_METHODS]
    for name in [part.strip() for part in (value or "").split(",") if part.strip()]:
        if parse_method_name(name).base not in known:
            raise BlockspecError(f"unknown benchmark method {name!r}: choose from {', '.join(known)} (a drafter also "
                                 "as METHOD@WIDTH, METHOD@tN or dflash/dK)")


def bench_config(args):
    from blockspec.bench.runner import BenchConfig
    from blockspec.decoding.sequence import GenerationConfig

    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  seed=args.seed if args.seed is not None else 0, compile=args.compile)
    return BenchConfig(generation, warmup_tokens=args.warmup_tokens, use_chat_template=not args.no_chat_template,
                       max_turns=args.max_turns)


def exit_code(run, num_methods: int, out: Path) -> int:
    """130 if interrupted, 1 if a method's tokens differ from ar's, else 0 (each reported on stderr)."""
    if run.interrupted:
        print(f"blockspec bench: interrupted; the {len(run.records) // num_methods} prompts done are in {out}",
              file=sys.stderr)
        return 130
    if run.mismatches:
        for record in run.mismatches:
            print(f"blockspec bench: {record['method']} differs from ar on {record['id']} at "
                  f"turn {record['first_mismatch']['turn']} token {record['first_mismatch']['position']}",
                  file=sys.stderr)
        return 1
    return 0
