"""The bridge between asyncio request handlers and the one decoding engine.

A step is a blocking torch call, so the engine lives in ONE thread of its own that steps
while there is work (``blockspec serve`` runs it in the process's main thread and the web server
in another: once the main thread has used torch's OpenMP pool, forwards in any other thread ran
at half speed on a CPU). Handlers never touch the engine: they send commands (add, cancel)
through a thread-safe queue, and the thread applies them between steps, so new requests
join the running batch dynamically. Each request's tokens come back through its own
asyncio queue, fed with ``loop.call_soon_threadsafe``.

A ``Generation`` (``generation.py``) runs one request on top of it and turns its tokens into text.

The engine is a ``BatchEngine`` (rows verified together, each a chain or a token tree of its own,
cut each step to the width that pays best for the whole batch under the adaptive width), or, when
the server serves one request at a time anyway (a batch of one), a ``SequentialEngine`` (the
``generate`` loop, with its compiled graphs, one request after another).

A request's tokens are read from its row after every step (not from the step's events), so a
row that is prefilled and finishes within one step keeps all its tokens. One request's failure
never reaches another: when a step fails, the row that failed is found (the one being
prefilled, or the one that fails again when each is tried alone), finished with an error, and
every other row goes on in a fresh engine from the tokens it had (its prompt and answer so far
prefilled anew: greedy rows continue exactly as they would have).
"""

from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import queue
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from blockspec.decoding.batch import BatchEngine
from blockspec.decoding.rows import Row
from blockspec.decoding.score import text_logprobs
from blockspec.decoding.sequence import GenerationConfig, GenerationStats, TokenLogprob, preferred_decoding
from blockspec.decoding.sequential import SequentialEngine
from blockspec.drafters.tree import DEFAULT_TREE_TOP_K
from blockspec.errors import BlockspecError
from blockspec.serve.metrics import ServerMetrics
from blockspec.serve.schemas import APIError

log = logging.getLogger("blockspec.serve")


def return_freed_memory() -> bool:
    """Give the C allocator's free pages back to the system (glibc keeps what a burst's peak freed resident:
    RSS 1618 MB idle, 1938 MB after a burst of 32). False where there is no glibc."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


@dataclass(frozen=True)
class DecodingOptions:
    """How the server verifies, for every request: the width and the token tree."""

    block_size: int | str | None = None
    tree_budget: int | None = None
    tree_top_k: int = DEFAULT_TREE_TOP_K
    #: The target's forward (GenerationConfig.compile): batches run the fast path's static cache eagerly,
    #: one request at a time runs its compiled graphs.
    compile: str = "off"

    def for_drafter(self, drafter) -> "DecodingOptions":
        """With neither a width nor a tree named: what ``blockspec generate`` verifies for this drafter (for a
        one-pass drafter, the adaptive width over a token tree: ``preferred_decoding``)."""
        config = preferred_decoding(drafter, GenerationConfig(**self.config_fields()))
        return replace(self, block_size=config.block_size, tree_budget=config.tree_budget)

    def config_fields(self) -> dict:
        return {"block_size": self.block_size, "tree_budget": self.tree_budget, "tree_top_k": self.tree_top_k,
                "compile": self.compile}


@dataclass
class TokenUpdate:
    """New tokens of one request; ``finish_reason`` is set on its last update."""

    tokens: list[int]
    finish_reason: str = ""
    stats: GenerationStats | None = None
    error: str | None = None
    #: With log-probabilities asked for: each of ``tokens``'.
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class Submission:
    """One request inside the engine: what to decode and where its tokens go."""

    id: int
    input_ids: list[int]
    config: GenerationConfig
    loop: asyncio.AbstractEventLoop
    namespace: str | None = None
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    row: Row | None = None
    done: bool = False
    #: Tokens decoded in the rows this request had before a failed step moved it to a fresh engine.
    earlier: list[int] = field(default_factory=list)
    earlier_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Tokens of ``output`` handed to the request so far.
    delivered: int = 0
    #: Requests ahead of it, not yet decoding, when it was accepted (0: it joins the batch at the next step).
    queue_position: int = 0

    @property
    def output(self) -> list[int]:
        return self.earlier + (self.row.token_ids if self.row is not None else [])

    @property
    def output_logprobs(self) -> list[TokenLogprob]:
        return self.earlier_logprobs + (self.row.sequence.logprobs if self.row is not None else [])

    def resume_config(self) -> GenerationConfig:
        """The config that continues this request from ``output`` (a seeded row draws anew from a seed of its own)."""
        done = len(self.output)
        seed = self.config.seed if self.config.seed is None or not done else (self.config.seed + done) % 2**64
        return replace(self.config, max_new_tokens=self.config.max_new_tokens - done, seed=seed, earlier_output=done)

    def deliver(self, update: TokenUpdate) -> None:
        """Called from the engine thread: hand the update to the request's event loop."""
        try:
            self.loop.call_soon_threadsafe(self.updates.put_nowait, update)
        except RuntimeError:  # the request's loop is closed: nobody is listening any more
            pass


@dataclass
class ScoreJob:
    """A text to score with the target (its tokens' log-probabilities), answered through ``result``."""

    ids: list[int]
    top: int
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future

    def answer(self, value=None, error: Exception | None = None) -> None:
        """Called from the engine thread."""
        def settle():
            if not self.result.done():
                self.result.set_exception(error) if error is not None else self.result.set_result(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the request's loop is closed
            pass


#: Rows a server decodes together by default: on a 2-core CPU 16 rows gave 1.26x the output tokens/s of 8 at
#: concurrency 16 (benchmarks/serve_batching.py), and the batch's KV cache grows only as its rows need.
DEFAULT_MAX_BATCH_SIZE = 16

#: Prompt tokens a step of the batch prefills at most: a long prompt enters over several steps, so the rows
#: decoding wait for one chunk at a time (about as long as a few decode steps of the default pair on a CPU).
DEFAULT_PREFILL_CHUNK = 256

#: How often an idle engine looks up from its command queue (whether it should stop).
_IDLE_CHECK_S = 0.5


class ServingEngine:
    """Owns the ``BatchEngine`` thread; ``submit`` and ``cancel`` are called from the event loop."""

    def __init__(self, target_model, drafter=None, *, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_queue: int = 64,
                 metrics: ServerMetrics | None = None, per_sequence: bool = False, compile: str = "off",
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, kv_budget: int | None = None):
        if per_sequence:
            self.engine = SequentialEngine(target_model, drafter)
        else:
            self.engine = BatchEngine(target_model, drafter, max_batch_size=max_batch_size, compile=compile,
                                      prefill_chunk=prefill_chunk, kv_budget=kv_budget)
        self.max_queue = max_queue
        self.metrics = metrics or ServerMetrics()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: dict[int, Submission] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        #: Set while ``run_here`` decodes in the calling thread.
        self._here = threading.Event()
        self._stopping = threading.Event()

    # -- the event-loop side -----------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    @property
    def alive(self) -> bool:
        return self._here.is_set() or (self._thread is not None and self._thread.is_alive())

    def submit(self, input_ids: list[int], config: GenerationConfig, *, namespace: str | None = None) -> Submission:
        """Queue a request, or refuse it with 503 when ``max_queue`` requests are already in flight.
        ``namespace``: whose earlier answers the drafter may copy from (and keeps this one for)."""
        if not self.alive:
            raise APIError(503, "the decoding engine is not running: restart the server", type="server_error",
                           code="engine_stopped")
        try:
            self.engine.check_fits(len(input_ids), config.max_new_tokens)
        except BlockspecError as error:
            raise APIError(400, str(error), param="max_tokens", code="kv_budget_exceeded") from error
        submission = Submission(next(self._ids), list(input_ids), config, asyncio.get_running_loop(), namespace)
        with self._lock:
            if len(self._in_flight) >= self.max_queue:
                raise APIError(503, f"the server is at capacity ({self.max_queue} requests in flight): retry later",
                               type="server_error", code="server_overloaded")
            submission.queue_position = max(0, len(self._in_flight) - len(self.engine.rows))
            self._in_flight[submission.id] = submission
            self.metrics.in_flight.set(len(self._in_flight))
        self._commands.put(("add", submission))
        return submission

    async def score(self, ids: list[int], top: int) -> list[TokenLogprob]:
        """The target's log-probability of each token of ``ids`` (none for the first) and the ``top`` most likely
        tokens' at each position, computed by the engine thread between two steps (it owns the model)."""
        if not self.alive:
            raise APIError(503, "the decoding engine is not running: restart the server", type="server_error",
                           code="engine_stopped")
        loop = asyncio.get_running_loop()
        job = ScoreJob(list(ids), top, loop, loop.create_future())
        self._commands.put(("score", job))
        return await job.result

    def cancel(self, submission: Submission) -> None:
        """Stop decoding a request (client gone, or a stop string reached); frees its slot."""
        if not submission.done:
            submission.done = True
            self._commands.put(("cancel", submission))

    def prepare(self, config: GenerationConfig, say=None) -> None:
        """Before serving: what requests under ``config`` need ready (compiled graphs, the batch's T(B, w))."""
        self.engine.prepare(config, say=say)

    def start(self) -> None:
        """Decode in a thread of its own (nothing to do when ``run_here`` decodes in the caller's thread)."""
        if self._here.is_set():
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="blockspec-engine", daemon=True)
        self._thread.start()

    def claim_thread(self) -> None:
        """The calling thread will decode (``run_here``): requests are accepted from now on."""
        self._stopping.clear()
        self._here.set()

    def run_here(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        """Decode in the calling thread (after ``claim_thread``) until ``stop``, or until ``keep_going()``
        turns false (checked at least every ``_IDLE_CHECK_S`` while idle)."""
        self._here.set()
        try:
            self._run(keep_going)
        finally:
            self._here.clear()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the engine thread -------------------------------------------------------------------

    def _run(self, keep_going: Callable[[], bool] = lambda: True) -> None:
        try:
            while not self._stopping.is_set() and keep_going():
                self._apply_commands(wait=not self.engine.has_work)
                if self.engine.has_work and not self._stopping.is_set():
                    self._step()
                    if not self.engine.has_work:  # the batch emptied: what its peak took goes back
                        return_freed_memory()
        except Exception:  # a bug here must not leave requests waiting for ever
            log.exception("the engine thread stopped")
            raise
        finally:
            self._fail_all("the server is shutting down" if self._stopping.is_set() else "the decoding engine stopped")

    def _apply_commands(self, wait: bool) -> None:
        """Apply every queued command; when idle, sleep until one arrives."""
        try:
            command = self._commands.get(timeout=_IDLE_CHECK_S) if wait else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._update_gauges()

    def _apply(self, kind: str, submission) -> None:
        if kind == "score":
            self._score(submission)
        elif kind == "add":
            self._add(submission)
        elif kind == "cancel":
            if submission.row is not None:
                self.engine.cancel(submission.row)
            self._forget(submission)

    def _add(self, submission: Submission) -> None:
        if submission.done:  # cancelled before it reached the engine
            self._forget(submission)
            return
        try:
            submission.row = self.engine.add(submission.input_ids, submission.config, namespace=submission.namespace)
        except Exception as error:  # noqa: BLE001 - the request fails, the server lives on
            self._finish(submission, TokenUpdate([], "error", error=str(error)))
            return
        self.metrics.prompt_tokens.inc(len(submission.input_ids))

    def _score(self, job: ScoreJob) -> None:
        try:
            job.answer(text_logprobs(self.engine.model, job.ids, job.top))
        except Exception as error:  # noqa: BLE001 - the request fails, the server lives on
            log.exception("scoring a prompt failed")
            job.answer(error=APIError(500, f"scoring the prompt failed: {error}", type="server_error",
                                      code="scoring_failed"))

    def _step(self) -> None:
        running = [s for s in self._snapshot() if s.row is not None and not s.done]
        try:
            events = self.engine.step()
        except Exception as error:  # noqa: BLE001 - a failed step must not take the server or other requests down
            log.exception("engine step failed")
            self._recover(running, error)
            return
        for size, width in zip(self.engine.batch_sizes, self.engine.verify_widths):  # none when it only prefilled
            self.metrics.batch_size.observe(size)
            self.metrics.verify_width.observe(width)
        self.engine.batch_sizes.clear()  # a server steps for ever: keep the figures in the histogram only
        self.engine.verify_widths.clear()
        stepped = {event.row.id for event in events}
        for submission in running:
            if submission.row.id in stepped:
                self._deliver_new_tokens(submission)
        self._update_gauges()

    def _deliver_new_tokens(self, submission: Submission) -> None:
        """Hand the request the tokens its row added, finishing it with the row's last."""
        if submission.done:
            return
        output, logprobs = submission.output, submission.output_logprobs[submission.delivered:]
        tokens, submission.delivered = output[submission.delivered:], len(output)
        row = submission.row
        if row.finished:
            self._finish(submission, TokenUpdate(tokens, row.stats.finish_reason, row.stats, logprobs=logprobs))
        elif tokens:
            submission.deliver(TokenUpdate(tokens, logprobs=logprobs))

    # -- a failed step ------------------------------------------------------------------------

    def _recover(self, running: list[Submission], error: Exception) -> None:
        """Finish the request(s) whose row made the step fail; the others go on in a fresh engine."""
        broken = self.engine
        self.engine = broken.fresh()
        failed = self._failed_rows(broken, running)
        for submission in running:
            if submission.done:
                continue
            if submission.row.finished:  # finished within the step, before it failed
                self._deliver_new_tokens(submission)
            elif submission in failed:
                self._finish(submission, TokenUpdate([], "error", error=f"decoding failed: {error}"))
            else:
                self._resume(submission)
        self._update_gauges()

    def _failed_rows(self, broken, running: list[Submission]) -> list[Submission]:
        """The requests to blame: the one being prefilled when the step failed, else the ones whose rows
        fail when each is tried alone; all the step's rows if none does (a fault of the batch itself)."""
        active = {row.id for row in broken.rows}
        queued = {row.id for row in broken.waiting}
        live = [s for s in running if not s.done and not s.row.finished]
        admitting = [s for s in live if s.row.id not in active and s.row.id not in queued]
        if admitting:
            return admitting
        stepping = [s for s in live if s.row.id in active]
        if len(stepping) <= 1:
            return stepping
        return [s for s in stepping if self._fails_alone(broken, s)] or stepping

    def _fails_alone(self, broken, submission: Submission) -> bool:
        """Whether the request's row fails its prefill or first decode step in an engine of its own."""
        trial = broken.fresh()
        try:
            trial.add(submission.input_ids + submission.output, submission.resume_config(),
                      namespace=submission.namespace)
            for _ in range(2):  # a batch engine prefills and decodes in one step, a sequential one in two
                if trial.has_work:
                    trial.step()
        except Exception:  # noqa: BLE001 - this is the question asked
            return True
        return False

    def _resume(self, submission: Submission) -> None:
        """Continue the request in the current engine from the tokens it has."""
        output = submission.output
        config = submission.resume_config()
        submission.earlier, submission.earlier_logprobs = output, submission.output_logprobs
        submission.row = None
        try:
            submission.row = self.engine.add(submission.input_ids + output, config, namespace=submission.namespace)
        except Exception as error:  # noqa: BLE001
            self._finish(submission, TokenUpdate([], "error", error=f"decoding failed: {error}"))

    def _finish(self, submission: Submission, update: TokenUpdate) -> None:
        if update.stats is not None and update.stats.steps:
            self.metrics.tau.observe(update.stats.tau)
        submission.done = True
        submission.deliver(update)
        self._forget(submission)

    def _forget(self, submission: Submission) -> None:
        with self._lock:
            self._in_flight.pop(submission.id, None)
            self.metrics.in_flight.set(len(self._in_flight))

    def _snapshot(self) -> list[Submission]:
        with self._lock:
            return list(self._in_flight.values())

    def _fail_all(self, message: str) -> None:
        for submission in self._snapshot():
            self._finish(submission, TokenUpdate([], "error", error=message))

    def _update_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.engine.waiting))
        self.metrics.active_rows.set(len(self.engine.rows))
        if self.engine.kv_slots is not None:
            self.metrics.kv_slots.set(self.engine.kv_slots)
