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
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from tqdm import tqdm

from blockspec.bench.replay import recorded_answers, replay_acceptance
from blockspec.drafters.registry import build_drafter
from blockspec.drafters.tree import DEFAULT_TREE_TOP_K
from blockspec.errors import BlockspecError
from blockspec.models.target import load_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json of a greedy blockspec bench run (its ar records)")
    parser.add_argument("--draft", nargs="+", required=True, metavar="DIR", help="DFlash drafter directories")
    parser.add_argument("--methods", nargs="+", default=["dflash"],
                        help="drafting methods over each drafter: dflash, dflash+suffix, dflash+ngram, suffix "
                             "(copy sources remember each replayed answer, as a server remembers its outputs)")
    parser.add_argument("--target", default=None, help="target (default: the run's)")
    parser.add_argument("--data-dir", default=None,
                        help="where the run read its prompts, for runs whose records lack prompt_ids")
    parser.add_argument("--widths", nargs="*", type=int, default=[16], help="chain verify widths (none: trees only)")
    parser.add_argument("--trees", nargs="*", type=int, default=[], help="tree budgets (nodes)")
    parser.add_argument("--tree-top-k", nargs="+", type=int, default=[DEFAULT_TREE_TOP_K],
                        help="children per tree node")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each dataset")
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
    target = load_target(args.target or results["target"])
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
    rows = []
    for directory in args.draft:
        for method in args.methods:
            for name, options in settings:
                drafter = build_drafter(method, target, None if method == "suffix" else directory)
                lengths = defaultdict(list)
                for answer in tqdm(answers, desc=f"{Path(directory).name} {method} {name}", leave=False):
                    lengths[answer.dataset] += replay_acceptance(target.model, drafter, answer.prompt_ids,
                                                                 answer.answer_ids, max_new_tokens=max_new,
                                                                 **options)
                for dataset, steps in lengths.items():
                    rows.append({"draft": directory, "method": method, "setting": name, "dataset": dataset,
                                 "prompts": sum(a.dataset == dataset for a in answers),
                                 "tau": sum(steps) / len(steps)})
    return rows


def print_table(rows: list[dict]) -> None:
    print("| draft | method | setting | dataset | prompts | tau |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {Path(row['draft']).name} | {row['method']} | {row['setting']} | {row['dataset']} | "
              f"{row['prompts']} | {row['tau']:.3f} |")


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
