"""Exact greedy tau of DFlash drafters, replayed against the AR answers of a `blockspec bench` run.

No timing and no verify forwards (blockspec/bench/replay.py): each drafter drafts step by
step against the recorded greedy answer, at every chain width and tree budget asked for.
The figures equal what `blockspec bench` would measure for tau on the same prompts (first
turn of each), in a fraction of the time; use it to compare drafters and tree settings, and
`blockspec bench` for speed.

    .venv/bin/python benchmarks/replay_tau.py benchmarks/results/shipped-gsm8k-100/results.json \
        --draft blockspec/assets/dflash-smollm2-135m --widths 8 16 --trees 32 --data-dir ../shared/datasets
"""

import argparse
import itertools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.bench.replay import recorded_answers, replay_acceptance
from blockspec.drafters.registry import build_drafter, detect_method
from blockspec.drafters.tree import DEFAULT_TREE_TOP_K
from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import read_config
from blockspec.models.dflash.config import has_reduced_vocabulary
from blockspec.models.target import load_target
from blockspec.training.vocabulary import target_vocabulary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json of a greedy blockspec bench run (its ar records)")
    parser.add_argument("--draft", nargs="+", required=True, metavar="DIR", help="DFlash drafter directories")
    parser.add_argument("--methods", nargs="+", default=["dflash"],
                        help="drafting methods over each drafter: dflash, dflash+suffix, dflash+lookup, suffix "
                             "(copy sources remember each replayed answer, as a server remembers its outputs), or "
                             "auto: each drafter's own (dflash, dflash2, dspark, domino)")
    parser.add_argument("--target", default=None, help="target (default: the run's)")
    parser.add_argument("--quantize", default="none", metavar="{none,fp16,int8,int4}",
                        help="replay on the target with its linear layers on fp16, int8 or int4 weights (the "
                             "features the drafter reads come from it; the answers are the run's)")
    parser.add_argument("--data-dir", default=None,
                        help="where the run read its prompts, for runs whose records lack prompt_ids")
    parser.add_argument("--widths", nargs="*", type=int, default=[16], help="chain verify widths (none: trees only)")
    parser.add_argument("--trees", nargs="*", type=int, default=[], help="tree budgets (nodes)")
    parser.add_argument("--tree-top-k", nargs="+", type=int, default=[DEFAULT_TREE_TOP_K],
                        help="children per tree node")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="K",
                        help="dflash: also replay each drafter over the K tokens most frequent in --draft-vocab-data")
    parser.add_argument("--draft-vocab-data", nargs="+", default=None, metavar="FILE")
    parser.add_argument("--without-sequence-tokens", action="store_true",
                        help="dflash over a reduced vocabulary: also replay it without the rows of each sequence's "
                             "own tokens outside the vocabulary (the drafter's default adds them)")
    parser.add_argument("--out", default=None, help="write the figures here as JSON")
    args = parser.parse_args()
    try:
        rows = run(args)
    except BlockspecError as error:
        print(f"replay_tau: {error}", file=sys.stderr)
        return 2
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


def run(args) -> list[dict]:
    results = json.loads(Path(args.results).read_text())
    target = load_target(args.target or results["target"], quantize=args.quantize)
    answers = recorded_answers(results, target, args.data_dir)
    if args.limit:
        by_dataset = defaultdict(list)
        for answer in answers:
            by_dataset[answer.dataset].append(answer)
        answers = [a for group in by_dataset.values() for a in group[: args.limit]]
    max_new = results["config"]["max_new_tokens"]
    settings = [(f"chain@{w}", {"block_size": w}) for w in args.widths]
    settings += [(f"tree{b}" + (f"/k{k}" if len(args.tree_top_k) > 1 else ""), {"tree_budget": b, "tree_top_k": k})
                 for b in args.trees for k in args.tree_top_k]
    vocabularies = [None]
    if args.draft_vocab_size:
        vocabularies.append(target_vocabulary(target, args.draft_vocab_data or [], args.draft_vocab_size))
    sequence_choices = [True, False] if args.without_sequence_tokens else [True]
    rows = []
    for directory, vocabulary, sequence_tokens, method, (name, options) in itertools.product(
            args.draft, vocabularies, sequence_choices, args.methods, settings):
        method = detect_method(directory) if method == "auto" else method
        if vocabulary is not None and (method != "dflash" or has_reduced_vocabulary(read_config(directory))):
            continue
        extra = {} if vocabulary is None else {"draft_vocabulary": vocabulary}
        if not sequence_tokens:
            if method != "dflash":
                continue
            extra["sequence_tokens"] = False
        drafter = build_drafter(method, target, None if method == "suffix" else directory, **extra)
        if not sequence_tokens and drafter.draft_to_target is None:
            continue
        lengths = defaultdict(list)  # dataset -> each answer's step lengths
        for answer in tqdm(answers, desc=f"{Path(directory).name} {method} {name}", leave=False):
            lengths[answer.dataset].append(replay_acceptance(target.model, drafter, answer.prompt_ids,
                                                             answer.answer_ids, max_new_tokens=max_new,
                                                             **options))
        for dataset, per_answer in lengths.items():
            rows.append({"draft": directory, "method": method, "setting": name, "dataset": dataset,
                         "vocabulary": drafter_vocabulary_size(drafter),
                         "sequence_tokens": sequence_tokens_of(drafter),
                         "prompts": len(per_answer), **step_figures(per_answer),
                         "outside": outside_share(drafter, [a for a in answers if a.dataset == dataset])})
    return rows


def dflash_of(drafter):
    """The DFlash drafter itself (a hybrid's primary)."""
    return getattr(drafter, "primary", drafter)


def step_figures(per_answer: list[list[int]]) -> dict:
    """tau over all steps, and apart: the first decode step's tokens (drafted from the prompt and the
    prefill's token, where an answer's opening phrase is won or lost) and tau over the steps after it."""
    steps = [n for lengths in per_answer for n in lengths]
    later = [n for lengths in per_answer for n in lengths[1:]]
    return {"tau": sum(steps) / len(steps),
            "first_step": sum(lengths[0] for lengths in per_answer) / len(per_answer),
            "tau_after_first": sum(later) / len(later) if later else None}


def drafter_vocabulary_size(drafter) -> int | None:
    rows = getattr(dflash_of(drafter), "draft_to_target", None)
    return None if rows is None else len(rows)


def sequence_tokens_of(drafter) -> bool | None:
    """Whether a reduced-vocabulary drafter also drafts each sequence's own tokens (None: whole vocabulary)."""
    if drafter_vocabulary_size(drafter) is None:
        return None
    return getattr(dflash_of(drafter), "sequence_head", None) is not None


def outside_share(drafter, answers) -> float | None:
    """The share of the target's answer tokens a reduced draft vocabulary cannot draft (None: whole vocabulary):
    outside its K rows and, when it drafts the sequence's own tokens, not earlier in the prompt or answer."""
    if drafter_vocabulary_size(drafter) is None:
        return None
    inside, tracked = set(dflash_of(drafter).draft_to_target.tolist()), sequence_tokens_of(drafter)
    outside = total = 0
    for answer in answers:
        seen = set(answer.prompt_ids) if tracked else set()
        for token in answer.answer_ids:
            outside += token not in inside and token not in seen
            if tracked:
                seen.add(token)
        total += len(answer.answer_ids)
    return outside / max(1, total)


def print_table(rows: list[dict]) -> None:
    print("| draft | vocabulary | sequence tokens | method | setting | dataset | prompts | tau "
          "| first step | tau after it | answer tokens outside the vocabulary |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        outside = "-" if row.get("outside") is None else f"{100 * row['outside']:.2f}%"
        tokens = {None: "-", True: "yes", False: "no"}[row.get("sequence_tokens")]
        print(f"| {Path(row['draft']).name} | {row.get('vocabulary') or 'whole'} | {tokens} | {row['method']} "
              f"| {row['setting']} | {row['dataset']} | {row['prompts']} | {row['tau']:.3f} "
              f"| {row['first_step']:.2f} | {_figure(row['tau_after_first'])} | {outside} |")


def _figure(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
