"""One sequence at a time through ``TokenStream``, behind ``BatchEngine``'s interface.

Token trees and the adaptive width choose each step's verify shape from one sequence's own
draft (which nodes, how wide), so rows cannot share one padded verify forward. A server run
with those options queues its requests here instead: first come, first decoded, each through
the same loop ``blockspec generate`` uses, with one drafter whose width calibration carries
over from request to request.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

from blockspec.decoding.batch import BatchEvent
from blockspec.decoding.drafter import Drafter
from blockspec.decoding.generate import GenerationConfig, GenerationStats, Step, TokenStream, _as_batch_of_one


@dataclass
class SequenceRow:
    """A queued or running sequence; ``stats`` fill in as its stream runs."""

    id: int
    stream: TokenStream
    steps: Iterator[Step] | None = field(default=None, repr=False)

    @property
    def stats(self) -> GenerationStats:
        return self.stream.stats

    @property
    def token_ids(self) -> list[int]:
        return self.stream.token_ids

    @property
    def finished(self) -> bool:
        return bool(self.stream.stats.finish_reason)


class SequentialEngine:
    """Decodes queued sequences one after another; each ``step`` is one step of the running one."""

    max_batch_size = 1

    def __init__(self, target_model, drafter: Drafter | None = None):
        self.model = target_model
        self.drafter = drafter
        self.rows: list[SequenceRow] = []
        self.waiting: deque[SequenceRow] = deque()
        self.batch_sizes: list[int] = []
        self._ids = itertools.count()
        self._cancelled: set[int] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def free_slots(self) -> int:
        return 1 - len(self.rows) - len(self.waiting)

    def fresh(self) -> "SequentialEngine":
        """An empty engine over the same model and drafter (after a failed step)."""
        return SequentialEngine(self.model, self.drafter)

    def add(self, input_ids, config: GenerationConfig | None = None) -> SequenceRow:
        """Queue one sequence (ids [T] or [1, T]); its options are checked now, not when its turn comes."""
        stream = TokenStream(self.model, _as_batch_of_one(input_ids, self.model.device), self.drafter,
                             config or GenerationConfig())
        row = SequenceRow(next(self._ids), stream)
        self.waiting.append(row)
        return row

    def cancel(self, row: SequenceRow | int) -> None:
        """Drop a row (queued or running) before the next step; it yields nothing more."""
        self._cancelled.add(row if isinstance(row, int) else row.id)

    def step(self) -> list[BatchEvent]:
        """One loop step of the running sequence (starting the next queued one if none runs)."""
        self._drop_cancelled()
        if not self.rows and self.waiting:
            row = self.waiting.popleft()
            row.steps = iter(row.stream)
            self.rows.append(row)
        if not self.rows:
            return []
        row = self.rows[0]
        step = next(row.steps)
        if row.stats.acceptance_lengths:  # a decode step, not the prefill
            self.batch_sizes.append(1)
        if row.finished:
            self._close(row)
        return [BatchEvent(row, step)]

    def run(self) -> Iterator[BatchEvent]:
        """Step until every queued and running sequence has finished."""
        while self.has_work:
            yield from self.step()

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for row in [row for row in [*self.waiting, *self.rows] if row.id in self._cancelled]:
            row.stats.finish_reason = "cancelled"
            if row in self.waiting:
                self.waiting.remove(row)
            else:
                self._close(row)
        self._cancelled.clear()

    def _close(self, row: SequenceRow) -> None:
        if row.steps is not None:
            row.steps.close()  # leaves the stream's inference-mode block
        self.rows.remove(row)
