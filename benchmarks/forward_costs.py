"""T(w): the target's verify forward time at each width, through each forward path, side by side.

Paths: "dynamic" (the eager forward over a DynamicCache, `--compile off`), "static" (the fast
path's loop over a static cache, each linear layer on the kernel measured fastest here for its
shape and row count, the attention reading only the columns in use), and "compiled" (the same,
compiled per width bucket). The widths are timed round-robin over the paths in one process
(medians of --repeats forwards after a context of --context tokens), so a drift of the machine
hits every path alike. Compiling is timed separately (first call per bucket).

    .venv/bin/python benchmarks/forward_costs.py --paths dynamic,static,compiled --widths 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import psutil
import torch

from blockspec.clock import wall_clock
from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.fast import FastForward
from blockspec.decoding.forward import SequenceTarget
from blockspec.decoding.static_targets import StaticTarget
from blockspec.hub import DEFAULT_TARGET
from blockspec.models.target import load_target

PATHS = ("dynamic", "static", "compiled")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--widths", default="1,2,4,8,16,32")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--feature-layers", default="1,15,29", help="target layers the drafter reads (none: '')")
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    return parser.parse_args()


def new_target(path: str, model, layers, length: int):
    if path == "dynamic":
        return SequenceTarget(model, layers or None)
    return StaticTarget(FastForward(model, layers, compile=path == "compiled"), length)


def time_verify(target, tokens, start, device) -> float:
    began = wall_clock(device)
    target.verify([VerifyBlock(list(tokens), start)])
    seconds = wall_clock(device) - began
    target.keep([[]])
    return seconds


def main() -> None:
    args = parse_args()
    paths = args.paths.split(",")
    widths = [int(w) for w in args.widths.split(",")]
    layers = [int(i) for i in args.feature_layers.split(",") if i]
    target = load_target(args.target, device=args.device)
    model, device = target.model, target.device
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.config.vocab_size, (1, args.context), generator=generator).to(device)
    block = torch.randint(0, model.config.vocab_size, (max(widths),), generator=generator).tolist()
    length = args.context + max(widths) + 1
    targets, compile_seconds = {}, {}
    with torch.inference_mode():
        for path in paths:
            targets[path] = new_target(path, model, layers, length)
            targets[path].prefill(context)
            compile_seconds[path] = {w: time_verify(targets[path], block[:w], args.context, device) for w in widths}
        runs = {(path, w): [] for path in paths for w in widths}
        for _ in range(args.repeats):
            for w in widths:
                for path in paths:
                    runs[(path, w)].append(time_verify(targets[path], block[:w], args.context, device))
    figures = {path: {w: statistics.median(runs[(path, w)]) for w in widths} for path in paths}
    print(f"{target.name} on {device}, {torch.get_num_threads()} threads, context {args.context}: T(w) in ms")
    print("width  " + "  ".join(f"{path:>10}" for path in paths) + "   " +
          "  ".join(f"{path}/dynamic" for path in paths if path != "dynamic" and "dynamic" in paths))
    for w in widths:
        ratios = [f"{figures['dynamic'][w] / figures[path][w]:>10.2f}x" for path in paths
                  if path != "dynamic" and "dynamic" in paths]
        print(f"{w:>5}  " + "  ".join(f"{figures[path][w] * 1e3:>10.1f}" for path in paths) + "   " + "  ".join(ratios))
    for path in paths:
        ratio = figures[path][widths[-1]] / figures[path][widths[0]]
        first = sum(compile_seconds[path].values())
        print(f"{path}: T({widths[-1]})/T({widths[0]}) = {ratio:.2f}; first calls {first:.1f} s")
    fast = next((t.fast for t in targets.values() if isinstance(t, StaticTarget)), None)
    if fast is not None and fast.kernels is not None:
        print(f"linear kernels: {fast.kernels.describe()}")
    print(f"peak RSS {psutil.Process().memory_info().rss / 2**20:.0f} MiB (now)")
    if args.out:
        Path(args.out).write_text(json.dumps({"target": target.name, "context": args.context, "seconds": figures,
                                              "first_calls": compile_seconds, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
