"""One request on top of the serving engine: its tokens turned into text, stop strings, usage, cancelling.

Stop strings are matched on the text: a piece that could begin a stop string is held back until
the next tokens show whether it does.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

from blockspec.decoding.sequence import GenerationConfig, TokenLogprob
from blockspec.decoding.text import Detokenizer
from blockspec.serve.engine import ServingEngine, Submission
from blockspec.serve.schemas import APIError

#: blockspec's finish reasons as OpenAI names them ("context": the context filled up first).
_FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}

#: How often a non-streamed request checks that its client is still there (a stream notices at once).
_DISCONNECT_POLL_S = 0.5


class StopStrings:
    """Cuts streamed text at the first stop string, holding back what may begin one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text safe to send now, and whether a stop string was reached."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = self._longest_stop_prefix_suffix()
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out

    def _longest_stop_prefix_suffix(self) -> int:
        for size in range(min(len(self.pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0


@dataclass
class PreparedRequest:
    """A validated request, ready for the engine."""

    endpoint: str
    prompt_ids: list[int]
    config: GenerationConfig
    stop_strings: list[str]
    #: With min_tokens the row decodes without stop tokens (``config``); the first of ``stop_token_ids``
    #: at or after the min_tokens-th token ends the request.
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    #: Whose earlier answers a drafter that copies may read (the API key's tenant; None without keys).
    namespace: str | None = None
    #: Completions' ``echo``: the prompt's text, answered before the completion (None: not echoed), and with
    #: log-probabilities asked for, the prompt tokens' (``decoding.score``).
    echo: str | None = None
    echo_logprobs: list[TokenLogprob] | None = None
    #: False when the log-probabilities are only the request's own (``best_of`` ranks by them).
    show_logprobs: bool = True
    #: False for ``max_tokens: 0`` with ``echo``: the answer is the prompt alone, nothing is decoded.
    decodes: bool = True


class Generation:
    """Runs one request through the engine; iterate ``pieces()`` for its text.

    ``submit`` happens in ``start`` (so a full queue is refused before any response begins);
    whatever ends the iteration (finished, stop string, client gone, error), the row is
    cancelled if still running and the request is accounted for in the metrics.
    """

    def __init__(self, engine: ServingEngine, tokenizer, request: PreparedRequest):
        self.engine = engine
        self.request = request
        self.detokenizer = Detokenizer(tokenizer)
        self.stops = StopStrings(request.stop_strings)
        self.started_at = time.perf_counter()
        self.submission: Submission | None = None
        self.completion_tokens = 0
        #: With log-probabilities asked for: each taken token's (an echoed prompt's first), and how many were
        #: handed out.
        self.logprobs: list[TokenLogprob] = list(request.echo_logprobs or [])
        self._logprobs_taken = 0
        self.finish_reason: str | None = None
        self._first_token_seen = False
        self._closed = False
        self._disconnect_checked_at = self.started_at

    @property
    def prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def start(self) -> "Generation":
        if self.request.decodes:
            self.submission = self.engine.submit(self.request.prompt_ids, self.request.config,
                                                 namespace=self.request.namespace)
        return self

    async def pieces(self, is_disconnected: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[str]:
        """Text increments (an echoed prompt first) until the request finishes; raises ``APIError`` if decoding
        failed."""
        try:
            if self.request.echo is not None:
                yield self.request.echo
            if not self.request.decodes:
                self.finish_reason = "length"
            while self.finish_reason is None:
                update = await self._next_update(is_disconnected)
                if update is None:  # the client is gone
                    return
                if update.error:
                    raise APIError(500, update.error, type="server_error", code="generation_failed")
                text = self._take(update.tokens, update.logprobs)
                if update.finish_reason and self.finish_reason is None:
                    text += self._rest_of_text()
                    self.finish_reason = _FINISH_REASONS.get(update.finish_reason, "stop")
                if text:
                    yield text
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the row if it still runs, and record the request once."""
        if self._closed:
            return
        self._closed = True
        if self.submission is not None:
            self.engine.cancel(self.submission)
        metrics = self.engine.metrics
        metrics.generated_tokens.inc(self.completion_tokens)
        metrics.latency.labels(self.request.endpoint).observe(time.perf_counter() - self.started_at)

    async def _next_update(self, is_disconnected):
        """The next update, or None once the client has gone (checked every ``_DISCONNECT_POLL_S``)."""
        updates = self.submission.updates
        if is_disconnected is None:
            return await updates.get()
        while True:
            now = time.perf_counter()
            if now - self._disconnect_checked_at >= _DISCONNECT_POLL_S:
                self._disconnect_checked_at = now
                if await is_disconnected():
                    return None
            try:
                return await asyncio.wait_for(updates.get(), _DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                continue

    def take_logprobs(self) -> list[TokenLogprob] | None:
        """The log-probabilities of the tokens taken since the last call (None: none were asked for)."""
        if self.request.config.logprobs is None or not self.request.show_logprobs:
            return None
        taken, self._logprobs_taken = self.logprobs[self._logprobs_taken:], len(self.logprobs)
        return taken

    def mean_logprob(self) -> float:
        """The average log-probability of the completion's tokens (0 without any)."""
        generated = self.logprobs[len(self.request.echo_logprobs or []):]
        return sum(entry.logprob for entry in generated) / len(generated) if generated else 0.0

    def _take(self, tokens: list[int], logprobs: list[TokenLogprob]) -> str:
        """Account for new tokens; the text they add, cut at a stop token past min_tokens or a stop string
        (either ends the request)."""
        if tokens and not self._first_token_seen:
            self._first_token_seen = True
            self.engine.metrics.time_to_first_token.labels(self.request.endpoint).observe(
                time.perf_counter() - self.started_at)
        tokens, stop_token = self._cut_at_late_stop_token(tokens)
        self.completion_tokens += len(tokens)
        self.logprobs.extend(logprobs[:len(tokens)])
        text, stopped = self.stops.feed(self.detokenizer.add(tokens))
        if stop_token and not stopped:
            text += self._rest_of_text()
        if stopped or stop_token:
            self.finish_reason = "stop"
            self.engine.cancel(self.submission)
        return text

    def _cut_at_late_stop_token(self, tokens: list[int]) -> tuple[list[int], bool]:
        """With min_tokens: the tokens up to the first stop token at or after the min_tokens-th, and whether
        there was one."""
        request = self.request
        if not request.min_tokens:
            return tokens, False
        for i, token in enumerate(tokens):
            if token in request.stop_token_ids and self.completion_tokens + i >= request.min_tokens:
                return tokens[:i + 1], True
        return tokens, False

    def _rest_of_text(self) -> str:
        """At the end: half characters the detokenizer held back, and text held for stop strings."""
        detokenizer = self.detokenizer
        tail = detokenizer.text[detokenizer.emitted:]
        detokenizer.emitted += len(tail)
        text, stopped = self.stops.feed(tail)
        return text if stopped else text + self.stops.flush()
