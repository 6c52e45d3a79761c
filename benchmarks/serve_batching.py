"""The default server under concurrent load, against the same server one request at a time and AR serving.

Starts `blockspec serve` once per configuration (one after another, same machine, same prompts) and
measures, with greedy chat requests of `--max-tokens` tokens each (`ignore_eos`, so every answer has
that length):

- one request alone (median of 3): its latency;
- `--burst` requests sent at once: total time, p50 / p95 latency, every answer compared with the same
  request's answer on the AR server (identical text, or the run says which differ);
- output tokens/s at each of `--concurrency` levels on gsm8k prompts and on random synthetic text
  (words drawn from the tokenizer's vocabulary: nothing a drafter can predict).

    .venv/bin/python benchmarks/serve_batching.py --out benchmarks/results/serve-batching
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--burst", type=int, default=32, help="requests sent at once")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--max-batch-size", type=int, default=8, help="of the batched servers (the default: 8)")
    parser.add_argument("--servers", nargs="+", default=["default", "one-at-a-time", "ar"],
                        choices=["default", "one-at-a-time", "ar"])
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--out", default="benchmarks/results/serve-batching")
    return parser.parse_args()


def server_options(name: str, max_batch_size: int) -> list[str]:
    if name == "one-at-a-time":
        return ["--max-batch-size", "1"]
    options = ["--max-batch-size", str(max_batch_size), "--max-queue", "256"]
    return options + (["--method", "ar"] if name == "ar" else [])


def gsm8k_prompts(count: int) -> list[str]:
    from blockspec.bench.datasets import load_benchmark_prompts

    rows = load_benchmark_prompts("gsm8k", num_prompts=count)
    return [row["turns"][0] for row in rows]


def random_prompts(count: int, seed: int = 0) -> list[str]:
    """Sentences of random vocabulary words: text no drafter can continue."""
    from transformers import AutoTokenizer

    from blockspec import hub

    tokenizer = AutoTokenizer.from_pretrained(hub.resolve_model(hub.DEFAULT_TARGET))
    words = [w.strip("Ġ") for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha()]
    rng = random.Random(seed)
    return ["Continue this text: " + " ".join(rng.choice(words) for _ in range(40)) for _ in range(count)]


class Server:
    def __init__(self, options: list[str], port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        command = [sys.executable, "-m", "blockspec.cli", "serve", "--port", str(port), "--log-level", "warning",
                   *options]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.started = time.perf_counter()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited: see {log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.startup_seconds = time.perf_counter() - self.started
        self.model = httpx.get(f"{self.url}/v1/models").json()["data"][0]["id"]

    def ask(self, prompt: str, max_tokens: int) -> dict:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": max_tokens, "ignore_eos": True}
        began = time.perf_counter()
        response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=3600)
        response.raise_for_status()
        answer = response.json()
        return {"text": answer["choices"][0]["message"]["content"], "seconds": time.perf_counter() - began,
                "tokens": answer["usage"]["completion_tokens"]}

    def many(self, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
        began = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(lambda p: self.ask(p, max_tokens), prompts))
        seconds = time.perf_counter() - began
        latencies = sorted(a["seconds"] for a in answers)
        tokens = sum(a["tokens"] for a in answers)
        return {"requests": len(prompts), "concurrency": concurrency, "seconds": seconds, "tokens": tokens,
                "tokens_per_s": tokens / seconds, "p50_latency": statistics.median(latencies),
                "p95_latency": latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))],
                "texts": [a["text"] for a in answers]}

    def rss_mb(self) -> float:
        """The server process's resident memory."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics").text

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(60)
        self.log.close()


def histogram_mean(metrics: str, name: str) -> float | None:
    values = {}
    for line in metrics.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"{name}_{part} "):
                values[part] = float(line.split()[-1])
    return values["sum"] / values["count"] if values.get("count") else None


def measure_server(name: str, args, prompts: dict[str, list[str]], out: Path) -> dict:
    server = Server(server_options(name, args.max_batch_size), args.port, out / f"{name}.log")
    print(f"{name}: up in {server.startup_seconds:.0f} s", flush=True)
    try:
        server.ask(prompts["gsm8k"][0], 8)  # warm
        alone = [server.ask(p, args.max_tokens)["seconds"] for p in prompts["gsm8k"][:3]]
        result = {"startup_seconds": server.startup_seconds, "alone_latency": statistics.median(alone),
                  "rss_idle_mb": server.rss_mb()}
        result["burst"] = server.many(prompts["gsm8k"][:args.burst], args.burst, args.max_tokens)
        time.sleep(2)
        result["rss_after_burst_mb"] = server.rss_mb()
        print(f"{name}: burst of {args.burst} in {result['burst']['seconds']:.1f} s", flush=True)
        if name != "one-at-a-time":
            for level in args.concurrency:
                count = max(2 * level, 4)
                for kind in ("gsm8k", "random"):
                    run = server.many(prompts[kind][:count], level, args.max_tokens)
                    result[f"{kind}@{level}"] = run
                    print(f"{name}: {kind} at concurrency {level}: {run['tokens_per_s']:.1f} tok/s", flush=True)
        metrics = server.metrics()
        result["mean_batch_size"] = histogram_mean(metrics, "blockspec_batch_size")
        result["mean_verify_width"] = histogram_mean(metrics, "blockspec_verify_width")
        result["mean_tau"] = histogram_mean(metrics, "blockspec_tau")
        return result
    finally:
        server.stop()


def main():
    args = parse_args()
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    most = max(args.burst, 2 * max(args.concurrency))
    prompts = {"gsm8k": gsm8k_prompts(most), "random": random_prompts(most)}
    results = {name: measure_server(name, args, prompts, out) for name in args.servers}
    (out / "results.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    report(results, args)


def report(results: dict, args) -> None:
    reference = results.get("ar")
    for name, result in results.items():
        burst = result["burst"]
        same = "n/a" if reference is None else \
            sum(a == b for a, b in zip(burst["texts"], reference["burst"]["texts"]))
        print(f"\n{name}: alone {result['alone_latency']:.2f} s; burst of {burst['requests']}: "
              f"{burst['seconds']:.1f} s, p95 {burst['p95_latency']:.1f} s "
              f"({burst['p95_latency'] / result['alone_latency']:.1f}x alone), {burst['tokens_per_s']:.1f} tok/s; "
              f"identical to AR: {same}/{burst['requests']}; mean batch {result['mean_batch_size']}, "
              f"width {result['mean_verify_width']}, tau {result['mean_tau']}; RSS idle "
              f"{result['rss_idle_mb']:.0f} MB, after the burst {result['rss_after_burst_mb']:.0f} MB")
        for key in sorted(k for k in result if "@" in k):
            line = f"  {key}: {result[key]['tokens_per_s']:.1f} tok/s"
            if reference is not None and key in reference and name != "ar":
                line += f" ({result[key]['tokens_per_s'] / reference[key]['tokens_per_s']:.2f}x AR serving)"
            print(line)
    if "default" in results and "one-at-a-time" in results:
        ratio = results["default"]["burst"]["seconds"] / results["one-at-a-time"]["burst"]["seconds"]
        print(f"\nburst total time, default / one at a time: {ratio:.2f}")
    if "default" in results and f"gsm8k@{max(args.concurrency)}" in results["default"]:
        top, one = results["default"][f"gsm8k@{max(args.concurrency)}"], results["default"].get(
            f"gsm8k@{min(args.concurrency)}")
        if one:
            print(f"default: tok/s at concurrency {max(args.concurrency)} / {min(args.concurrency)}: "
                  f"{top['tokens_per_s'] / one['tokens_per_s']:.2f}")


if __name__ == "__main__":
    main()
