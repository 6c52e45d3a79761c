"""``blockspec loadtest``: many concurrent streaming chat requests against a local server.

It only talks to loopback addresses: a load generator pointed at someone else's server is
an attack, so anything but 127.0.0.1, localhost or ::1 is refused. It is bounded by the
number of requests and by a total time limit.

Figures: output tokens/s and requests/s over the whole run; time to first token (request
sent to first text chunk); inter-token latency per request, (last chunk - first chunk) /
(completion tokens - 1), which counts every token even when speculative decoding delivers
several in one chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

from blockspec.errors import BlockspecError
from blockspec.serve.auth import check_api_key

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
DEFAULT_PROMPT = "Write a short story about a robot learning to paint."


def check_loopback(url: str) -> str:
    """The base URL without a trailing slash, if it is http(s) on a loopback host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise BlockspecError(f"--url must start with http:// or https://, got {url!r}")
    if parts.hostname not in LOOPBACK_HOSTS:
        raise BlockspecError(f"loadtest only targets this machine: {parts.hostname or url!r} is not one of "
                             f"{', '.join(LOOPBACK_HOSTS)}; run the server locally and point --url at it")
    return url.rstrip("/")


@dataclass
class RequestTiming:
    """What one streamed request measured (seconds, from when it was sent)."""

    ok: bool
    error: str = ""
    first_chunk: float | None = None
    last_chunk: float | None = None
    completion_tokens: int = 0

    @property
    def inter_token_latency(self) -> float | None:
        if self.first_chunk is None or self.completion_tokens < 2:
            return None
        return (self.last_chunk - self.first_chunk) / (self.completion_tokens - 1)


@dataclass
class LoadtestReport:
    url: str
    model: str
    concurrency: int
    requests: int
    completed: int
    errors: int
    timed_out: bool
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    error_messages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        def ms(value):
            return "-" if value is None else f"{value:.1f} ms"

        rows = [
            ("url", self.url), ("model", self.model), ("concurrency", str(self.concurrency)),
            ("requests", f"{self.completed} completed of {self.requests}"
                         + (" (time limit reached)" if self.timed_out else "")),
            ("errors", str(self.errors)), ("duration", f"{self.duration_s:.2f} s"),
            ("output tokens", str(self.output_tokens)),
            ("output tokens/s", f"{self.output_tokens_per_s:.1f}"), ("requests/s", f"{self.requests_per_s:.2f}"),
            ("time to first token p50", ms(self.ttft_p50_ms)), ("time to first token p99", ms(self.ttft_p99_ms)),
            ("inter-token latency p50", ms(self.itl_p50_ms)), ("inter-token latency p99", ms(self.itl_p99_ms)),
        ]
        rows += [("error", message) for message in self.error_messages]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def run_loadtest(url: str, *, concurrency: int, requests: int, max_tokens: int = 64,
                 prompt: str | list[str] = DEFAULT_PROMPT, timeout: float = 300.0, model: str | None = None,
                 api_key: str | None = None, temperature: float | None = None) -> LoadtestReport:
    """Send ``requests`` streaming chat requests, ``concurrency`` at a time, within ``timeout`` seconds.

    ``prompt``: one prompt, or a list that the requests cycle through. ``temperature``: None
    leaves the server's default (the OpenAI API's 1.0); 0 asks for greedy decoding.
    """
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    if not prompts:
        raise BlockspecError("the load test needs at least one prompt")
    base = check_loopback(url)
    for name, value in (("concurrency", concurrency), ("requests", requests), ("max_tokens", max_tokens)):
        if value < 1:
            raise BlockspecError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise BlockspecError(f"--timeout must be a number of seconds > 0, got {timeout}")
    check_api_key(api_key)
    return asyncio.run(_run(base, concurrency, requests, max_tokens, prompts, timeout, model, api_key, temperature))


async def _run(base, concurrency, requests, max_tokens, prompts, timeout, model, api_key,
               temperature) -> LoadtestReport:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=timeout,
                                 trust_env=False) as client:
        model = model or await _served_model(client)
        base_body = {"model": model, "max_tokens": max_tokens, "stream": True,
                     "stream_options": {"include_usage": True}}
        if temperature is not None:
            base_body["temperature"] = temperature
        timings: list[RequestTiming] = []
        tickets = iter(range(requests))

        async def worker():
            for ticket in tickets:  # shared: every request is sent exactly once
                body = {**base_body, "messages": [{"role": "user", "content": prompts[ticket % len(prompts)]}]}
                timings.append(await _timed_request(client, body))

        started = time.perf_counter()
        workers = [asyncio.create_task(worker()) for _ in range(min(concurrency, requests))]
        done, pending = await asyncio.wait(workers, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - started
    return _report(base, model, concurrency, requests, timings, duration, timed_out=bool(pending))


async def _served_model(client: httpx.AsyncClient) -> str:
    try:
        response = await client.get("/v1/models")
    except httpx.HTTPError as error:
        raise BlockspecError(f"cannot reach the server at {client.base_url}: {error}; is `blockspec serve` "
                             "running?") from error
    if response.status_code != 200:
        raise BlockspecError(f"GET /v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json()["data"][0]["id"]


async def _timed_request(client: httpx.AsyncClient, body: dict) -> RequestTiming:
    sent = time.perf_counter()
    timing = RequestTiming(ok=False)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return timing
            async for line in response.aiter_lines():
                if not _take_line(line, timing, time.perf_counter() - sent):
                    break
    except httpx.HTTPError as error:
        timing.error = f"{type(error).__name__}: {error}"
        return timing
    timing.ok = not timing.error
    return timing


def _take_line(line: str, timing: RequestTiming, elapsed: float) -> bool:
    """Account for one SSE line; False once the stream is over."""
    if not line.startswith("data: "):
        return True
    data = line[len("data: "):]
    if data == "[DONE]":
        return False
    chunk = json.loads(data)
    if "error" in chunk:
        timing.error = chunk["error"].get("message", "error")
        return False
    if chunk.get("usage"):
        timing.completion_tokens = chunk["usage"]["completion_tokens"]
    if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
        timing.first_chunk = elapsed if timing.first_chunk is None else timing.first_chunk
        timing.last_chunk = elapsed
    return True


def _report(base, model, concurrency, requests, timings: list[RequestTiming], duration: float,
            timed_out: bool) -> LoadtestReport:
    good = [t for t in timings if t.ok]
    failed = [t for t in timings if not t.ok]
    unfinished = requests - len(timings)  # cut off by the time limit
    ttfts = [t.first_chunk * 1000 for t in good if t.first_chunk is not None]
    itls = [t.inter_token_latency * 1000 for t in good if t.inter_token_latency is not None]
    tokens = sum(t.completion_tokens for t in good)
    messages = sorted({t.error for t in failed})[:5]
    return LoadtestReport(
        url=base, model=model, concurrency=concurrency, requests=requests, completed=len(good),
        errors=len(failed) + unfinished, timed_out=timed_out, duration_s=duration, output_tokens=tokens,
        output_tokens_per_s=tokens / duration if duration > 0 else 0.0,
        requests_per_s=len(good) / duration if duration > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(itls, 50), itl_p99_ms=percentile(itls, 99), error_messages=messages,
    )


def print_report(report: LoadtestReport, as_json: bool) -> None:
    print(json.dumps(report.to_dict(), indent=2) if as_json else report.table())
