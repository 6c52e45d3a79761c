"""Prometheus metrics of one server.

Each app gets its own ``CollectorRegistry`` so that several apps (tests, or two servers in
one process) never share or double-register metrics.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

#: Paths counted under their own name; anything else is "other", so that scanners hitting
#: random URLs cannot grow the label set without bound.
KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TAU_BUCKETS = (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10, 12, 16)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
_WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


def endpoint_label(path: str) -> str:
    if path.startswith("/v1/models"):
        return "/v1/models"
    return path if path in KNOWN_ENDPOINTS else "other"


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockspec_requests", "HTTP requests answered, by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("blockspec_generated_tokens", "Completion tokens sent to clients",
                                        registry=r)
        self.tau = Histogram("blockspec_tau", "Mean acceptance length (tokens per target forward) of each "
                             "finished request", buckets=_TAU_BUCKETS, registry=r)
        self.batch_size = Histogram("blockspec_batch_size", "Rows in each batched verify forward",
                                    buckets=_BATCH_BUCKETS, registry=r)
        self.verify_width = Histogram("blockspec_verify_width", "Tokens per row in each verify forward (the last "
                                      "token and the drafts verified; 1: no drafting)", buckets=_WIDTH_BUCKETS,
                                      registry=r)
        self.active_rows = Gauge("blockspec_active_rows", "Rows in the running batch", registry=r)
        self.queue_depth = Gauge("blockspec_queue_depth", "Requests waiting to join the batch", registry=r)
        self.kv_slots = Gauge("blockspec_kv_slots", "Token slots (rows x columns) the batch's KV cache holds",
                              registry=r)
        self.kv_budget = Gauge("blockspec_kv_budget", "Token slots the batch's KV cache may take (0: no bound)",
                               registry=r)
        self.in_flight = Gauge("blockspec_requests_in_flight", "Requests accepted and not finished", registry=r)
        self.latency = Histogram("blockspec_request_latency_seconds", "Time from receiving a generation "
                                 "request to its last token", ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.time_to_first_token = Histogram("blockspec_time_to_first_token_seconds", "Time from receiving a "
                                             "generation request to its first token", ["endpoint"],
                                             buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting every response by endpoint and status; a request answered with nothing because
    its client had gone is counted as status "disconnected".

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would buffer streamed
    responses and hide client disconnects from them.
    """

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = endpoint_label(scope["path"])
        answered = False

        async def count_and_send(message):
            nonlocal answered
            if message["type"] == "http.response.start":
                answered = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, count_and_send)
        if not answered:
            self.metrics.requests.labels(endpoint, "disconnected").inc()
