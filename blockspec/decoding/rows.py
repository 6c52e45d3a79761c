"""What the engines share: their rows, the queue rows wait in, cancelling, and the events a step yields.

``BatchEngine`` (rows verified together) and ``SequentialEngine`` (one row at a time) differ only in
how a step admits and decodes rows; both queue, cancel and finish rows through ``RowQueue``.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from blockspec.clock import wall_clock
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import Sequence, SequenceView, Step
from blockspec.drafters.base import Drafter


@dataclass
class Row(SequenceView):
    """A queued or running sequence of an engine, with the time it was submitted."""

    id: int
    sequence: Sequence
    submitted_at: float


@dataclass
class BatchEvent:
    """A step one row produced; ``row.finished`` tells whether it was the row's last."""

    row: Row
    step: Step


class RowQueue:
    """An engine's rows: ``waiting`` (queued, first come first served) and ``rows`` (decoding).

    A subclass admits and decodes rows in ``step``, and lets finished rows go in ``_drop_finished``.
    """

    max_batch_size: int

    def __init__(self, target_model, drafter: Drafter | None, width_policies: WidthPolicies | None):
        self.model = target_model
        self.drafter = drafter
        self.width_policies = width_policies if width_policies is not None else WidthPolicies()
        self.rows: list[Row] = []
        self.waiting: deque[Row] = deque()
        #: Active rows, and the widest block, of each decode forward so far (for the batch figures).
        self.batch_sizes: list[int] = []
        self.verify_widths: list[int] = []
        self._ids = itertools.count()
        self._cancelled: set[int] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    #: Token slots the KV cache may take (None: no bound); the batch engine admits rows within it.
    kv_budget: int | None = None

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a row that could never be decoded within the KV budget (an engine without one refuses none)."""

    @property
    def kv_slots(self) -> int | None:
        """Token slots the target's KV cache holds now (None: the engine does not track them)."""
        return None

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.rows) - len(self.waiting)

    def cancel(self, row: Row | int) -> None:
        """Drop a row (queued or running) before the next step; it yields nothing more."""
        self._cancelled.add(row if isinstance(row, int) else row.id)

    def step(self) -> list[BatchEvent]:
        raise NotImplementedError

    def run(self) -> Iterator[BatchEvent]:
        """Step until every queued and running row has finished."""
        while self.has_work:
            yield from self.step()

    def _queue(self, sequence: Sequence) -> Row:
        row = Row(next(self._ids), sequence, wall_clock(self.model.device))
        self.waiting.append(row)
        return row

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for row in [row for row in self.waiting if row.id in self._cancelled]:
            self.waiting.remove(row)
            row.stats.finish_reason = "cancelled"
            self._forget(row)
        for row in self.rows:
            if row.id in self._cancelled:
                row.stats.finish_reason = "cancelled"
        self._cancelled.clear()
        self._drop_finished()

    def _forget(self, row: Row) -> None:
        """Let go of what a row cancelled while queued holds."""

    def _drop_finished(self) -> None:
        raise NotImplementedError
