"""One sequence at a time through ``TokenStream``, behind ``BatchEngine``'s interface.

Token trees and the adaptive width choose each step's verify shape from one sequence's own
draft (which nodes, how wide), so rows cannot share one padded verify forward. A server run
with those options queues its requests here instead: first come, first decoded, each through
the same loop ``blockspec generate`` uses, with width policies whose calibration carries over
from request to request.
"""

from __future__ import annotations

from typing import Iterator

from blockspec.decoding.generate import TokenStream, warm_up_fast_path
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.rows import BatchEvent, Row, RowQueue
from blockspec.decoding.sequence import GenerationConfig, Step
from blockspec.drafters.base import Drafter


class SequentialEngine(RowQueue):
    """Decodes queued sequences one after another; each ``step`` is one step of the running one."""

    max_batch_size = 1

    def __init__(self, target_model, drafter: Drafter | None = None, *,
                 width_policies: WidthPolicies | None = None):
        super().__init__(target_model, drafter, width_policies)
        self._streams: dict[int, TokenStream] = {}
        self._steps: dict[int, Iterator[Step]] = {}

    def fresh(self) -> "SequentialEngine":
        """An empty engine over the same model, drafter and width calibration (after a failed step)."""
        return SequentialEngine(self.model, self.drafter, width_policies=self.width_policies)

    def add(self, input_ids, config: GenerationConfig | None = None, *, namespace: str | None = None) -> Row:
        """Queue one sequence (ids [T] or [1, T]); its options are checked now, not when its turn comes.
        ``namespace``: whose earlier answers a drafter that copies may read and keeps this one for."""
        drafter = self.drafter.for_namespace(namespace) if self.drafter is not None else None
        stream = TokenStream(self.model, input_ids, drafter, config or GenerationConfig(),
                             width_policies=self.width_policies)
        row = self._queue(stream.sequence)
        self._streams[row.id] = stream
        return row

    def prepare(self, config: GenerationConfig, say=None) -> None:
        """Compile (or load) the fast path's graphs requests under ``config`` use, for up to 512 positions."""
        warm_up_fast_path(self.model, self.drafter, config, 256)

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
        self._drop_finished()
        return [BatchEvent(row, step)]

    def _forget(self, row: Row) -> None:
        self._streams.pop(row.id)

    def _drop_finished(self) -> None:
        for row in [row for row in self.rows if row.finished]:
            steps = self._steps.pop(row.id, None)
            if steps is not None:
                steps.close()  # leaves the stream's inference-mode block
            self._streams.pop(row.id, None)
            self.rows.remove(row)
