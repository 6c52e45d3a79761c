"""One sequence at a time through ``TokenStream``, behind ``BatchEngine``'s interface.

Token trees and the adaptive width choose each step's verify shape from one sequence's own
draft (which nodes, how wide), so rows cannot share one padded verify forward. A server run
with those options queues its requests here instead: first come, first decoded, each through
the same loop ``blockspec generate`` uses, with width policies whose calibration carries over
from request to request.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Iterator

from blockspec.clock import wall_clock
from blockspec.decoding.batch import BatchEvent, Row
from blockspec.decoding.generate import TokenStream, warm_up_fast_path
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig, Step
from blockspec.drafters.base import Drafter


class SequentialEngine:
    """Decodes queued sequences one after another; each ``step`` is one step of the running one."""

    max_batch_size = 1

    def __init__(self, target_model, drafter: Drafter | None = None, *,
                 width_policies: WidthPolicies | None = None):
        self.model = target_model
        self.drafter = drafter
        self.width_policies = width_policies if width_policies is not None else WidthPolicies()
        self.rows: list[Row] = []
        self.waiting: deque[Row] = deque()
        self.batch_sizes: list[int] = []
        self.verify_widths: list[int] = []
        self._streams: dict[int, TokenStream] = {}
        self._steps: dict[int, Iterator[Step]] = {}
        self._ids = itertools.count()
        self._cancelled: set[int] = set()

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def free_slots(self) -> int:
        return 1 - len(self.rows) - len(self.waiting)

    def fresh(self) -> "SequentialEngine":
        """An empty engine over the same model, drafter and width calibration (after a failed step)."""
        return SequentialEngine(self.model, self.drafter, width_policies=self.width_policies)

    def add(self, input_ids, config: GenerationConfig | None = None, *, namespace: str | None = None) -> Row:
        """Queue one sequence (ids [T] or [1, T]); its options are checked now, not when its turn comes.
        ``namespace``: whose earlier answers a drafter that copies may read and keeps this one for."""
        drafter = self.drafter.for_namespace(namespace) if self.drafter is not None else None
        stream = TokenStream(self.model, input_ids, drafter, config or GenerationConfig(),
                             width_policies=self.width_policies)
        row = Row(next(self._ids), stream.sequence, wall_clock(self.model.device))
        self._streams[row.id] = stream
        self.waiting.append(row)
        return row

    def prepare(self, config: GenerationConfig, say=None) -> None:
        """Compile (or load) the fast path's graphs requests under ``config`` use, for up to 512 positions."""
        warm_up_fast_path(self.model, self.drafter, config, 256)

    def cancel(self, row: Row | int) -> None:
        """Drop a row (queued or running) before the next step; it yields nothing more."""
        self._cancelled.add(row if isinstance(row, int) else row.id)

    def step(self) -> list[BatchEvent]:
        """One step of the running sequence (starting the next queued one if none runs)."""
        self._drop_cancelled()
        if not self.rows and self.waiting:
            row = self.waiting.popleft()
            self._steps[row.id] = iter(self._streams[row.id])
            self.rows.append(row)
        if not self.rows:
            return []
        row = self.rows[0]
        step = next(self._steps[row.id])
        if row.stats.steps:  # a decode step, not the prefill
            self.batch_sizes.append(1)
            self.verify_widths.append(step.width)
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
                self._streams.pop(row.id)
            else:
                self._close(row)
        self._cancelled.clear()

    def _close(self, row: Row) -> None:
        steps = self._steps.pop(row.id, None)
        if steps is not None:
            steps.close()  # leaves the stream's inference-mode block
        self._streams.pop(row.id, None)
        self.rows.remove(row)
