"""DFlash drafting for a batch's rows in one pass against row by row, side by side in one process.

Part 1 times the drafting of one step for B rows (the token trees the server verifies by default:
16 nodes, 8 children at most, 15 deep) on real drafter states, the one-pass path and the row-by-row
one interleaved. Part 2 decodes the same prompts through ``BatchEngine`` on the fast path (as
``blockspec serve`` does) three ways: AR, DFlash drafting row by row, DFlash drafting in one pass;
every output is checked against AR's. Writes a JSON file.

    .venv/bin/python benchmarks/batched_drafting.py --out benchmarks/results/batched-drafting
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from blockspec import hub
from blockspec.bench.datasets import load_benchmark_prompts
from blockspec.decoding.batch import batch_generate
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.policy import AUTO, WidthPolicies
from blockspec.decoding.sequence import PREFERRED_TREE_BUDGET, GenerationConfig
from blockspec.drafters.base import PositionwiseDrafter
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.registry import load_drafter, shipped_draft
from blockspec.io import write_text_atomically
from blockspec.machine import hardware_name
from blockspec.models.target import load_target


class RowByRow(DFlashDrafter):
    """The same drafter, drafting each row's tree on its own (the path before one-pass drafting)."""

    rows_logits = PositionwiseDrafter.rows_logits


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/batched-drafting")
    return parser.parse_args()


def prompts(target, count):
    rows = [row for name in ("gsm8k", "humaneval", "mt_bench")
            for row in load_benchmark_prompts(name, num_prompts=count)]
    return [torch.tensor(target.encode_prompt(row["turns"][0])) for row in rows[:count]]


def drafter_states(target, drafter, cases):
    """Each prompt's drafter state after a few decoded tokens (context cached, the last step's features pending)."""
    config = GenerationConfig(max_new_tokens=6, block_size=8)
    states, last_tokens = [], []
    for ids in cases:
        stream = speculative_generate(target.model, ids, drafter, config)
        list(stream)
        states.append(stream.sequence.draft_state)
        last_tokens.append(stream.sequence.last_token)
    return states, last_tokens


def time_drafting(drafter, one_by_one, states, last_tokens, repeats):
    depth, budget, top_k = drafter.max_draft_tokens, PREFERRED_TREE_BUDGET, 8
    together, apart = [], []
    for _ in range(repeats):  # interleaved, each on fresh copies of the states
        for path, times in ((drafter, together), (one_by_one, apart)):
            fresh = [copy.deepcopy(state) for state in states]
            began = time.perf_counter()
            path.draft_trees(fresh, last_tokens, depth, budget, top_k)
            times.append(time.perf_counter() - began)
    return statistics.median(together), statistics.median(apart)


def decode_all(target, drafter, cases, max_new_tokens, batch):
    config = GenerationConfig(max_new_tokens=max_new_tokens, block_size=AUTO if drafter else None,
                              tree_budget=PREFERRED_TREE_BUDGET if drafter else None)
    began = time.perf_counter()
    results = batch_generate(target.model, cases, drafter, config, max_batch_size=batch, compile="auto",
                             width_policies=WidthPolicies())
    seconds = time.perf_counter() - began
    return [r.token_ids for r in results], sum(len(r.token_ids) for r in results) / seconds


def main():
    args = parse_args()
    target = load_target(args.target)
    drafter = load_drafter(shipped_draft(target.name), target, packed=True)
    one_by_one = copy.copy(drafter)
    one_by_one.__class__ = RowByRow
    cases = prompts(target, max(args.num_prompts, max(args.batch_sizes)))
    states, last_tokens = drafter_states(target, drafter, cases)
    drafting = {}
    for batch in args.batch_sizes:
        together, apart = time_drafting(drafter, one_by_one, states[:batch], last_tokens[:batch], args.repeats)
        drafting[batch] = {"one_pass_ms": together * 1e3, "row_by_row_ms": apart * 1e3, "speedup": apart / together}
        print(f"drafting {batch:2d} rows: one pass {together * 1e3:6.1f} ms, row by row {apart * 1e3:6.1f} ms "
              f"({apart / together:.2f}x)", flush=True)
    batch = max(args.batch_sizes)
    cases = cases[:args.num_prompts]
    decode_all(target, drafter, cases[:2], 8, batch)  # warm-up: compiled graphs, T(B, w) read or measured
    runs = {}
    for name, method in (("ar", None), ("dflash row by row", one_by_one), ("dflash one pass", drafter)):
        outputs, tokens_per_s = decode_all(target, method, cases, args.max_new_tokens, batch)
        runs[name] = {"tokens_per_s": tokens_per_s, "outputs": outputs}
        print(f"batch {batch}, {len(cases)} prompts: {name:18s} {tokens_per_s:6.1f} tok/s", flush=True)
    for name, run in runs.items():
        assert run["outputs"] == runs["ar"]["outputs"], f"{name} output differs from AR"
    summary = {
        "target": target.name, "machine": hardware_name("cpu"), "threads": torch.get_num_threads(),
        "drafting": drafting, "batch": batch, "prompts": len(cases), "max_new_tokens": args.max_new_tokens,
        "tokens_per_s": {name: run["tokens_per_s"] for name, run in runs.items()},
        "same_output_as_ar": True,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'summary.json'}")


if __name__ == "__main__":
    main()
