"""`blockspec bench`: every method side by side on the benchmark sets; `--compare` two runs."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from blockspec.errors import BlockspecError

DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt_bench")
DEFAULT_NUM_PROMPTS = 10
DEFAULT_MAX_NEW_TOKENS = 128


def add_bench_command(commands) -> None:
    parser = commands.add_parser(
        "bench", help="benchmark decoding methods side by side (tau, tokens/s, speedup, TTFT, memory)",
        description="Decode the same prompts with every method in one process, interleaved prompt by prompt, "
                    "and write results.json, results.md and PNG plots. In greedy runs every method's tokens are "
                    "checked against ar's; any difference makes the exit code 1.")
    from blockspec.cli import block_size_arg
    from blockspec.hub import DEFAULT_TARGET

    models = parser.add_argument_group("models")
    models.add_argument("--target", default=DEFAULT_TARGET, help=f"target model (default: {DEFAULT_TARGET})")
    models.add_argument("--methods", default=None,
                        help="comma-separated: ar, hf, hf-prompt-lookup, hf-assisted, and the drafters "
                             "dflash, eagle3, mtp, draft, ngram, each also as METHOD@WIDTH with its own verify "
                             "width, e.g. dflash@4,dflash@16,dflash@auto, or with a token tree of N nodes, "
                             "dflash@t32; dflash also as dflash[@WIDTH]/dK, drafting in K denoising passes, "
                             "e.g. dflash/d2,dflash@8/d4 (default: ar,hf,hf-prompt-lookup,ngram, plus dflash "
                             "when a DFlash drafter is known, plus the methods of every --draft, plus "
                             "draft,hf-assisted with --assistant)")
    models.add_argument("--draft", action="append", default=[], metavar="[METHOD=]DIR",
                        help="a drafter checkpoint: DIR for dflash, or METHOD=DIR for eagle3, mtp, draft "
                             "(repeatable; "
                             "default for the default target: the shipped DFlash drafter)")
    models.add_argument("--assistant", default=None,
                        help="a smaller causal LM with the target's tokenizer (directory or known name), "
                             "the draft model of both 'draft' and 'hf-assisted'")
    models.add_argument("--device", default=None)
    models.add_argument("--dtype", default=None)
    data = parser.add_argument_group("prompts")
    data.add_argument("--datasets", nargs="+", default=list(DEFAULT_DATASETS),
                      help="gsm8k, math500, humaneval, mbpp, mt_bench, or JSON-lines prompt files "
                           f"(default: {' '.join(DEFAULT_DATASETS)})")
    data.add_argument("--data-dir", default=None,
                      help="read the full sets from a directory laid out like the offline copies, or 'hub' "
                           "to load them by hub name (default: the subsets bundled in the package)")
    data.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="prompts per dataset")
    data.add_argument("--seed", type=int, default=None,
                      help="choose the prompts at random with this seed (default: the first ones); "
                           "also seeds sampling")
    data.add_argument("--max-turns", type=int, default=None, help="turns of a multi-turn prompt to decode")
    data.add_argument("--no-chat-template", action="store_true")
    decoding = parser.add_argument_group("decoding")
    decoding.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    decoding.add_argument("--block-size", type=block_size_arg, default=None,
                          help="verify width of the drafting methods, or 'auto' (adaptive width)")
    decoding.add_argument("--temperature", type=float, default=0.0)
    decoding.add_argument("--top-p", type=float, default=1.0)
    decoding.add_argument("--top-k", type=int, default=0)
    decoding.add_argument("--warmup-tokens", type=int, default=16)
    output = parser.add_argument_group("output")
    output.add_argument("--out", default=None, help="output directory (default: runs/bench-TIMESTAMP)")
    output.add_argument("--no-plots", action="store_true")
    output.add_argument("--no-progress", action="store_true")
    output.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                        help="print two earlier runs side by side and exit")
    parser.set_defaults(run=run_bench_command)


def run_bench_command(args) -> int:
    from blockspec.bench import report

    if args.compare:
        first, second = (report.load_results(path) for path in args.compare)
        print(report.compare_runs(first, second, labels=tuple(args.compare)), end="")
        return 0
    from blockspec.bench.runner import BenchConfig, run_benchmark
    from blockspec.decoding.sequence import GenerationConfig

    generation = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                  seed=args.seed if args.seed is not None else 0)
    config = BenchConfig(generation, warmup_tokens=args.warmup_tokens, use_chat_template=not args.no_chat_template,
                         max_turns=args.max_turns)
    prompts = load_prompts(args.datasets, args.data_dir, args.num_prompts, args.seed)
    target, methods = load_methods(args)
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
    if run.interrupted:
        print(f"blockspec bench: interrupted; the {len(run.records) // len(methods)} prompts done are in {out}",
              file=sys.stderr)
        return 130
    if run.mismatches:
        for record in run.mismatches:
            print(f"blockspec bench: {record['method']} differs from ar on {record['id']} at "
                  f"turn {record['first_mismatch']['turn']} token {record['first_mismatch']['position']}",
                  file=sys.stderr)
        return 1
    return 0


def write_calibration(methods, out: Path, *, plots: bool) -> dict[str, Path]:
    """The adaptive-width policies' confidence calibration (predicted vs observed acceptance), if any ran."""
    from blockspec.bench.methods import parse_method_name
    from blockspec.decoding.policy import WidthPolicies

    curves = {}
    for method in methods:
        label = parse_method_name(method.name).drafter  # dflash and dflash/d2: two drafters of one name
        for (kind, widest), policy in getattr(method, "width_policies", WidthPolicies()).policies.items():
            curves[f"{label} {kind} (widest {widest})"] = policy.calibrator.curve()
    if not curves:
        return {}
    import json

    path = out / "calibration.json"
    path.write_text(json.dumps(curves, indent=1))
    paths = {"calibration": path}
    if plots:
        from blockspec.bench.plots import calibration_plot

        paths["calibration_plot"] = calibration_plot(curves, out / "calibration.png")
    return paths


def load_prompts(datasets, data_dir, num_prompts, seed) -> list[dict]:
    from blockspec.bench.datasets import load_benchmark_prompts

    source = "bundled" if data_dir is None else data_dir
    if source not in ("bundled", "hub") and not Path(source).is_dir():
        raise BlockspecError(f"--data-dir {source} is not a directory (or 'hub')")
    prompts = []
    for name in datasets:
        prompts.extend(load_benchmark_prompts(name, source=source, num_prompts=num_prompts, seed=seed))
    return prompts


def load_methods(args):
    """The target and the methods the options name, each drafter loaded once."""
    from transformers.utils import logging as hf_logging

    from blockspec.bench.methods import build_methods, parse_method_name
    from blockspec.drafters.registry import CHECKPOINT_METHODS, DRAFT_METHODS, build_drafter
    from blockspec.models.target import load_target

    hf_logging.disable_progress_bar()
    drafts = parse_drafts(args.draft, args.target)
    names = parse_methods(args.methods, drafts, args.assistant)
    # dflash@4 and dflash@auto share one drafter; dflash/d2 has its own (its own state and calibration).
    specs = {spec.drafter: spec for spec in map(parse_method_name, names)}
    target = load_target(args.target, device=args.device, dtype=args.dtype)
    drafters = {}
    for key, spec in specs.items():
        name = spec.base
        if name in DRAFT_METHODS:
            draft = drafts.get(name) or (args.assistant if name == "draft" else None)
            if name in CHECKPOINT_METHODS and draft is None:
                raise BlockspecError(f"the {name} method needs --draft {name}=DIR (its checkpoint) for this target")
            options = {} if spec.denoise_steps == 1 else {"denoise_steps": spec.denoise_steps}
            drafters[key] = build_drafter(name, target, draft, **options)
    assistant = None
    if "hf-assisted" in names:  # the draft method's LM when it is the same one, loaded once
        wanted = args.assistant or drafts["draft"]
        same = "draft" in drafters and (drafts.get("draft") or args.assistant) == wanted
        assistant = drafters["draft"].model if same else \
            load_target(wanted, device=str(target.device), dtype=target.model.dtype).model
    return target, build_methods(names, target, drafters=drafters, assistant=assistant, block_size=args.block_size)


def parse_drafts(values: list[str], target: str) -> dict[str, str]:
    """``--draft`` values as {method: directory}; a bare directory is DFlash's."""
    from blockspec.drafters.registry import DRAFTED_METHODS, shipped_draft

    drafts = {}
    for value in values:
        method, _, directory = value.rpartition("=") if "=" in value else ("dflash", "", value)
        if not directory:
            raise BlockspecError(f"--draft {value!r}: give DIR or METHOD=DIR")
        if method not in DRAFTED_METHODS:
            raise BlockspecError(f"--draft {value!r}: METHOD must be one of {', '.join(DRAFTED_METHODS)}")
        drafts[method] = directory
    if "dflash" not in drafts and shipped_draft(target) is not None:
        drafts["dflash"] = str(shipped_draft(target))
    return drafts


def parse_methods(value: str | None, drafts: dict[str, str], assistant: str | None) -> list[str]:
    if value is None:
        names = ["ar", "hf", "hf-prompt-lookup", "ngram"]
        names += [m for m in drafts if m not in names]
        if assistant or "draft" in drafts:
            names += [m for m in ("draft", "hf-assisted") if m not in names]
    else:
        names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise BlockspecError("--methods is empty: name at least one method, e.g. ar,dflash")
    if "ar" not in names:
        names.insert(0, "ar")  # the reference every speedup and token check is measured against
    if ("draft" in names or "hf-assisted" in names) and not assistant and "draft" not in drafts:
        raise BlockspecError("the draft and hf-assisted methods need --assistant MODEL or --draft draft=DIR "
                             "(a smaller LM with the target's tokenizer)")
    return names
