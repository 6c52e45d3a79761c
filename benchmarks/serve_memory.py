"""The default server's memory over many mixed requests: does it grow?

Starts `blockspec serve` (the default pair, its defaults) and sends `--requests` requests, `--concurrency`
at a time, of mixed kinds: chat and completions, streamed or not, with stop strings, log-probabilities,
two choices, penalties, a JSON schema, different lengths, and some streams closed early by the client.
The server's resident memory is read once the server is idle after the first 50 requests and after
every further `--every`; reported: the last against the first (the goal: within 10%). Writes a JSON file.

    .venv/bin/python benchmarks/serve_memory.py --out benchmarks/results/serve-memory
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from serve_batching import Server, gsm8k_prompts

from blockspec.io import write_text_atomically

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--out", default="benchmarks/results/serve-memory")
    return parser.parse_args()


def request(server: Server, prompt: str, rng: random.Random) -> str:
    """One request of a random kind; what it was."""
    chat = rng.random() < 0.6
    body = {"model": server.model, "max_tokens": rng.choice([8, 16, 32, 48]), "temperature": rng.choice([0, 0.8])}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    extra = rng.choice(["plain", "stop", "logprobs", "n", "penalties", "json", "stream", "cancel"])
    if extra == "stop":
        body["stop"] = [".", "\n\n"]
    elif extra == "logprobs":
        body.update({"logprobs": True, "top_logprobs": 3} if chat else {"logprobs": 3})
    elif extra == "n":
        body["n"] = 2
    elif extra == "penalties":
        body.update(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
    elif extra == "json":
        body["response_format" if chat else "guided_json"] = (
            {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}} if chat else SCHEMA)
    url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
    if extra in ("stream", "cancel"):
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=600) as response:
            response.raise_for_status()
            for index, _ in enumerate(response.iter_lines()):
                if extra == "cancel" and index == 3:
                    break  # the client leaves mid-answer
        return extra
    response = httpx.post(url, json=body, timeout=600)
    response.raise_for_status()
    return extra


def wait_idle(server: Server) -> None:
    while httpx.get(f"{server.url}/health").json()["in_flight"]:
        time.sleep(0.2)
    time.sleep(1.0)  # the engine returns freed memory once its batch empties


def main():
    args = parse_args()
    prompts = gsm8k_prompts(200)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = Server([], args.port, out / "server.log")
    samples, kinds, began = [], {}, time.perf_counter()
    try:
        done = 0
        with ThreadPoolExecutor(args.concurrency) as pool:
            for target in [50, *range(args.every, args.requests + 1, args.every)]:
                batch = [(prompts[i % len(prompts)], random.Random(i)) for i in range(done, target)]
                for kind in pool.map(lambda item: request(server, *item), batch):
                    kinds[kind] = kinds.get(kind, 0) + 1
                done = target
                wait_idle(server)
                samples.append({"requests": done, "rss_mb": round(server.rss_mb(), 1),
                                "seconds": round(time.perf_counter() - began, 1)})
                print(samples[-1], flush=True)
    finally:
        server.stop()
    first, last = samples[0]["rss_mb"], samples[-1]["rss_mb"]
    summary = {"requests": args.requests, "concurrency": args.concurrency, "kinds": kinds, "samples": samples,
               "rss_growth": round(last / first - 1, 4), "peak_rss_mb": max(s["rss_mb"] for s in samples)}
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    write_text_atomically(out / "results.json", json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
