"""Total tokens/s of batched decoding, AR and speculative, at several batch sizes, side by side.

Every (method, batch size) decodes the same prompts through ``BatchEngine`` in one process;
greedy rows are checked against the batch-1 run of the same method (and speculative rows
against AR), so a speedup is never bought with different output. Writes a JSON file and a
plot of tokens/s and speedup over AR against the batch size.

    .venv/bin/python benchmarks/batch_throughput.py --num-prompts 16 --max-new-tokens 64 \
        --batch-sizes 1 2 4 8 --out benchmarks/results/batch-smollm2-cpu
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from blockspec import hub
from blockspec.bench.datasets import load_benchmark_prompts
from blockspec.clock import wall_clock
from blockspec.decoding.batch import batch_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.registry import build_drafter, detect_method, shipped_draft
from blockspec.models.target import load_target


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET)
    parser.add_argument("--draft", action="append", default=[], metavar="[METHOD=]DIR",
                        help="drafters to compare with AR (default: the shipped DFlash drafter)")
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    parser.add_argument("--num-prompts", type=int, default=16, help="prompts in all, taken evenly from the sets")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="benchmarks/results/batch-smollm2-cpu")
    return parser.parse_args()


def load_prompts(target, datasets, count):
    per_set = -(-count // len(datasets))
    rows = [row for name in datasets for row in load_benchmark_prompts(name, num_prompts=per_set)][:count]
    return [torch.tensor(target.encode_prompt(row["turns"][0])) for row in rows]


def drafters(target, values):
    if not values:
        values = [str(shipped_draft(target.name))]
    chosen = {}
    for value in values:
        method, _, directory = value.rpartition("=") if "=" in value else (None, "", value)
        method = method or detect_method(directory)
        chosen[method] = build_drafter(method, target, directory)
    return chosen


def measure(target, prompts, drafter, batch_size, config):
    start = wall_clock(target.model.device)
    results = batch_generate(target.model, prompts, drafter, config, max_batch_size=batch_size)
    seconds = wall_clock(target.model.device) - start
    tokens = sum(len(r.token_ids) for r in results)
    lengths = [n for r in results for n in r.stats.acceptance_lengths]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "tau": sum(lengths) / len(lengths) if lengths else 1.0}, [r.token_ids for r in results]


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_target(args.target)
    prompts = load_prompts(target, args.datasets, args.num_prompts)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                              stop_token_ids=target.stop_token_ids())
    methods = {"ar": None, **drafters(target, args.draft)}
    batch_generate(target.model, prompts[:2], None, GenerationConfig(max_new_tokens=4))  # warm-up
    figures, reference = [], None
    for batch_size in args.batch_sizes:
        for name, drafter in methods.items():
            config_used = config if drafter is not None else GenerationConfig(
                max_new_tokens=args.max_new_tokens, stop_token_ids=target.stop_token_ids())
            row, outputs = measure(target, prompts, drafter, batch_size, config_used)
            reference = reference or outputs  # AR at the first batch size
            row.update(method=name, batch_size=batch_size, same_tokens_as_ar=outputs == reference)
            figures.append(row)
            print(f"{name:>8} batch {batch_size:>2}: {row['tokens_per_s']:6.1f} tok/s, tau {row['tau']:.2f}, "
                  f"{row['tokens']} tokens in {row['seconds']:.1f} s, same tokens as ar: {row['same_tokens_as_ar']}",
                  flush=True)
    for row in figures:
        ar = next(r for r in figures if r["method"] == "ar" and r["batch_size"] == row["batch_size"])
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar["tokens_per_s"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_throughput.json").write_text(json.dumps(
        {"args": vars(args), "when": time.strftime("%Y-%m-%d %H:%M"), "threads": torch.get_num_threads(),
         "results": figures}, indent=1))
    print(table(figures))
    plot(figures, out / "batch_throughput.png")


def table(figures):
    lines = ["| method | batch | tok/s | tau | speedup vs ar | same tokens as ar |", "|---|---|---|---|---|---|"]
    for r in figures:
        lines.append(f"| {r['method']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | {r['tau']:.2f} | "
                     f"{r['speedup_vs_ar']:.2f}x | {r['same_tokens_as_ar']} |")
    return "\n".join(lines)


def plot(figures, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["method"] for r in figures):
        rows = [r for r in figures if r["method"] == name]
        sizes = [r["batch_size"] for r in rows]
        left.plot(sizes, [r["tokens_per_s"] for r in rows], marker="o", label=name)
        right.plot(sizes, [r["speedup_vs_ar"] for r in rows], marker="o", label=name)
    left.set(xlabel="batch size", ylabel="total tokens/s", title="throughput", xscale="log", xticks=sizes)
    right.set(xlabel="batch size", ylabel="speedup over AR at the same batch", title="speedup", xscale="log",
              xticks=sizes)
    for axis in (left, right):
        axis.set_xticklabels([str(s) for s in sizes])
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
