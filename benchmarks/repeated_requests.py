"""Repeated requests through the server: the same prompts asked twice, each pass timed.

A server drafting by suffix (``--method dflash+suffix`` or ``suffix``) keeps every answer in its
store, so the second time a prompt comes it drafts the whole answer from the first. This starts
``blockspec serve`` once per method (the same target, greedy, one request at a time, so the
tokens/s are the decoding's and not the batching's), sends the prompts through the ``openai``
client, and prints each pass's output tokens/s, the second pass over the first, and each over
the baseline method's first pass (``ar`` by default). The texts of every pass and method must be
identical: any difference is reported and makes the exit code 1.

    .venv/bin/python benchmarks/repeated_requests.py --methods ar,dflash+suffix \
        --method-args "dflash+suffix=--tree-budget 16 --block-size auto" --out runs/repeated
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI

from blockspec.bench.datasets import load_bundled
from blockspec.io import write_text_atomically


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="ar,dflash+suffix", help="comma-separated; the first is the baseline")
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mt_bench"], help="bundled prompt sets")
    parser.add_argument("--num-prompts", type=int, default=20, help="prompts in all, split over the datasets")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--serve-args", default="", help="more arguments for every blockspec serve (one string)")
    parser.add_argument("--method-args", action="append", default=[], metavar="METHOD=ARGS",
                        help="more arguments for one method's server, e.g. 'dflash+suffix=--tree-budget 16 "
                             "--block-size auto' (repeatable)")
    parser.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for a server to come up")
    parser.add_argument("--out", default=None, help="a directory for results.json")
    return parser.parse_args()


def prompts(datasets: list[str], count: int) -> list[str]:
    share = -(-count // len(datasets))
    rows = [row for name in datasets for row in load_bundled(name, limit=share)]
    return [row["turns"][0] for row in rows][:count]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """``blockspec serve`` in a child process, for as long as the ``with`` block runs."""

    def __init__(self, method: str, args, extra: str = ""):
        self.port = free_port()
        self.command = [sys.executable, "-m", "blockspec.cli", "serve", "--port", str(self.port),
                        "--compile", args.compile, "--max-batch-size", "1", "--log-level", "warning",
                        "--method", method, *args.serve_args.split(), *extra.split()]
        self.timeout = args.startup_timeout

    def __enter__(self) -> str:
        self.process = subprocess.Popen(self.command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with code {self.process.returncode}: {' '.join(self.command)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.process.terminate()
        raise SystemExit(f"the server did not come up within {self.timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def run_pass(client: OpenAI, model: str, texts: list[str], max_tokens: int) -> dict:
    answers, tokens, seconds = [], 0, 0.0
    for text in texts:
        began = time.perf_counter()
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                               max_tokens=max_tokens, temperature=0)
        seconds += time.perf_counter() - began
        tokens += reply.usage.completion_tokens
        answers.append(reply.choices[0].message.content)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "answers": answers}


def run_method(method: str, texts: list[str], args, extra: str) -> list[dict]:
    with Server(method, args, extra) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600)
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0)  # warm-up, forgotten by no later prompt
        return [run_pass(client, model, texts, args.max_tokens) for _ in range(args.passes)]


def report(results: dict[str, list[dict]], baseline: str) -> tuple[str, int]:
    reference = results[baseline][0]
    lines = [f"| method | pass | tokens | s | tokens/s | vs its pass 1 | vs {baseline} |", "|---" * 7 + "|"]
    differences = 0
    for method, passes in results.items():
        for number, figures in enumerate(passes, start=1):
            differing = sum(a != b for a, b in zip(figures["answers"], reference["answers"]))
            differences += differing
            speed = figures["tokens_per_s"]
            lines.append(f"| {method} | {number} | {figures['tokens']} | {figures['seconds']:.1f} | {speed:.1f} | "
                         f"{speed / passes[0]['tokens_per_s']:.2f}x | {speed / reference['tokens_per_s']:.2f}x |"
                         + (f" {differing} answers differ from {baseline}'s" if differing else ""))
    return "\n".join(lines), differences


def main() -> int:
    args = parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    texts = prompts(args.datasets, args.num_prompts)
    extras = dict(spec.split("=", 1) for spec in args.method_args)
    unknown = set(extras) - set(methods)
    if unknown:
        raise SystemExit(f"--method-args names methods not in --methods: {', '.join(sorted(unknown))}")
    results = {}
    for method in methods:
        results[method] = run_method(method, texts, args, extras.get(method, ""))
        print(f"{method}: " + ", ".join(f"pass {n}: {p['tokens_per_s']:.1f} tokens/s"
                                         for n, p in enumerate(results[method], start=1)), flush=True)
    table, differences = report(results, methods[0])
    print(table)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_text_atomically(Path(args.out) / "results.json",
                          json.dumps({"config": vars(args), "prompts": texts, "results": results}, indent=1))
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
