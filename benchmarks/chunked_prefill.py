"""How long a long prompt joining the batch holds the decoding rows up: whole prefill against chunks.

The default pair through ``BatchEngine`` on the fast path (as ``blockspec serve`` runs it): four gsm8k
rows decode; after a few steps a long prompt (several gsm8k problems, ``--long-tokens`` tokens) joins.
Reported per prefill setting, interleaved: the longest step while the long prompt enters (what every
decoding row waits between two of its tokens), the median step, and every output checked against
the whole-prefill run. Writes a JSON file.

    .venv/bin/python benchmarks/chunked_prefill.py --out benchmarks/results/chunked-prefill
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from blockspec import hub
from blockspec.bench.datasets import load_benchmark_prompts
from blockspec.decoding.batch import BatchEngine
from blockspec.decoding.policy import AUTO, WidthPolicies
from blockspec.decoding.sequence import PREFERRED_TREE_BUDGET, GenerationConfig
from blockspec.drafters.registry import load_drafter, shipped_draft
from blockspec.io import write_text_atomically
from blockspec.machine import hardware_name
from blockspec.models.target import load_target


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256, 128], help="0: whole prompts")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results/chunked-prefill")
    return parser.parse_args()


def run(target, drafter, short, long, chunk, policies):
    config = GenerationConfig(max_new_tokens=96, block_size=AUTO, tree_budget=PREFERRED_TREE_BUDGET,
                              stop_token_ids=tuple(target.stop_token_ids()))
    engine = BatchEngine(target.model, drafter, max_batch_size=8, compile="auto", width_policies=policies,
                         prefill_chunk=chunk or None)
    rows = [engine.add(ids, config) for ids in short]
    steps, joined, entering = [], None, []
    while engine.has_work:
        if joined is None and len(steps) == 4:
            joined = engine.add(long, config)
        entering_now = joined is not None and not joined.token_ids  # this step prefills (a part of) it
        started = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - started
        steps.append(seconds)
        if entering_now:
            entering.append(seconds)
    return {"longest_step_while_entering": max(entering), "median_step": statistics.median(steps),
            "steps_while_entering": len(entering), "total": sum(steps),
            "outputs": [row.token_ids for row in rows] + [joined.token_ids]}


def main():
    args = parse_args()
    torch.manual_seed(0)
    target = load_target(args.target)
    drafter = load_drafter(shipped_draft(target.name), target, packed=True)
    problems = [row["turns"][0] for row in load_benchmark_prompts("gsm8k", num_prompts=40)]
    short = [torch.tensor(target.encode_prompt(text)) for text in problems[:4]]
    text, more = "", iter(problems[4:])
    while len(target.tokenizer.encode(text)) < args.long_tokens:
        text += next(more) + "\n\n"
    long = torch.tensor(target.encode_prompt("Solve each problem.\n\n" + text))
    policies = WidthPolicies()
    run(target, drafter, short, long, 0, policies)  # warm-up: packed kernels, T(B, w)
    results = {chunk: [] for chunk in args.chunks}
    for _ in range(args.repeats):
        for chunk in args.chunks:
            results[chunk].append(run(target, drafter, short, long, chunk, policies))
    reference = results[args.chunks[0]][0]["outputs"]
    summary = {"machine": hardware_name(target.model.device), "target": target.name,
               "long_prompt_tokens": long.shape[-1], "settings": {}}
    for chunk, runs in results.items():
        longest = statistics.median(r["longest_step_while_entering"] for r in runs)
        summary["settings"][str(chunk or "whole")] = {
            "longest_step_while_entering_s": round(longest, 3),
            "median_step_s": round(statistics.median(r["median_step"] for r in runs), 3),
            "total_s": round(statistics.median(r["total"] for r in runs), 2),
            "outputs_equal_whole": all(r["outputs"] == reference for r in runs)}
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out / "results.json", json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
