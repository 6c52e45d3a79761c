"""The targets of the fast path: one sequence's, and a batch's rows in the leading slots of one static cache."""

from __future__ import annotations

import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.costs import MEASURED_CONTEXT, CostModel, batch_cost_model, cost_model_for, measure_costs
from blockspec.decoding.fast import FastForward
from blockspec.decoding.forward import TargetOutput
from blockspec.decoding.verifier import TargetScores


def sequence_cost_model(fast: FastForward, model, widest: int) -> CostModel:
    """T(w) of one sequence through the fast path (measuring it compiles every bucket up to ``widest`` on a first
    run)."""
    def measure(model, max_width):
        if fast.progress is not None:
            fast.progress(f"measuring the target's forward time at widths 1..{max_width} ({fast.path})")
        length = MEASURED_CONTEXT + max_width + 1
        return measure_costs(model, max_width, new_target=lambda: StaticTarget(fast, length))

    return cost_model_for(model, widest, measure=measure, path=fast.path)


class StaticTarget:
    """One sequence's target forwards through the fast path: a ``VerifyTarget`` over a static cache."""

    def __init__(self, fast: FastForward, length: int):
        self.fast = fast
        self.cache = fast.new_cache(length)

    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        logits, features = self.fast.prefill(self.cache, 0, input_ids)
        return TargetOutput(TargetScores(logits[0]), features)

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        (block,) = blocks
        logits, features = self.fast.verify(self.cache, [block], [self.cache.lengths[0]])
        width = block.width
        return [TargetOutput(TargetScores(logits[0, :width]), None if features is None else features[:, :width])]

    def keep(self, kept_rows: list[list[int]]) -> None:
        (rows,) = kept_rows
        self.cache.keep(0, rows)


class StaticBatchTarget:
    """The batch engine's target forwards through the fast path: rows in the leading slots of one static cache.

    A new row is prefilled into the next free slot; a leaving row's slot is refilled by moving the last
    row into it, so the active rows are always the first ones and a forward runs over exactly them.
    Rows keep their own lengths (their own columns), so nothing is ever left-padded or compacted.
    The cache grows (by doubling) as the longest row needs and as rows join, and shrinks back when the rows
    that needed it leave, so memory follows the rows decoding rather than the batch's limit and the
    longest answer a request may ask for.
    Runs eagerly (oneDNN-packed on a CPU): a batch's row count changes step to step.
    """

    def __init__(self, fast: FastForward, max_batch_size: int):
        self.fast = fast
        self.max_batch_size = max_batch_size
        self.cache = fast.new_cache(0, batch=1)
        self.rows = 0
        #: Whether the slot after the active rows holds a prompt prefilled in part (it joins with its last part).
        self.prefilling = False

    @property
    def path(self) -> str:
        """The forward path's name in the cost cache."""
        return f"batch{self.max_batch_size}-{self.fast.path}"

    def cost_model(self, model, widest: int) -> CostModel:
        """T(B, w) of this path for 1..max_batch_size rows (measured once per machine, then read from disk)."""
        def fresh():
            target = StaticBatchTarget(self.fast, self.max_batch_size)
            target.reserve(MEASURED_CONTEXT + widest + 1)
            return target

        return batch_cost_model(model, widest, self.max_batch_size, fresh, self.path)

    def reserve(self, length: int) -> None:
        """Make room for a row of up to ``length`` positions (the cache grows; rows keep their entries)."""
        needed = self.fast.capacity(length)
        if needed > self.cache.capacity:
            self.cache = self.cache.resized(needed)

    def prefill(self, input_ids: torch.LongTensor, start: int = 0, last: bool = True) -> TargetOutput:
        """Prefill the next free slot: the whole prompt, or its part from ``start`` (in order); the row joins the
        active ones with its ``last`` part."""
        if self.rows >= self.cache.batch:
            self.cache = self.cache.resized(self.cache.capacity, min(self.max_batch_size, 2 * self.cache.batch))
        logits, features = self.fast.prefill(self.cache, self.rows, input_ids, start)
        self.prefilling = not last
        if last:
            self.rows += 1
        return TargetOutput(TargetScores(logits[0]), features)

    def drop_prefill(self) -> None:
        """Forget a prompt prefilled in part (its request was cancelled)."""
        self.prefilling = False
        self.cache.lengths[self.rows] = 0

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        self.reserve(max(b.start + b.width for b in blocks))
        view = self.cache.leading(len(blocks))
        logits, features = self.fast.verify(view, blocks, [b.start for b in blocks])
        return [TargetOutput(TargetScores(logits[r, :b.width]),
                             None if features is None else features[r:r + 1, :b.width])
                for r, b in enumerate(blocks)]

    def keep(self, kept_rows: list[list[int]]) -> None:
        for row, rows in enumerate(kept_rows):
            self.cache.keep(row, rows)

    def keep_sequences(self, indices: list[int]) -> None:
        """Only these rows (by index, in order) go on; the others leave their slots, and the cache shrinks to
        what the rows left need once that is half of its length or less, or a quarter of its rows (it only
        shrinks when rows leave, and grows by doubling, so it cannot swing back and forth step by step)."""
        partial = self.rows
        for slot, row in enumerate(indices):
            if row != slot:
                self.cache.move_row(row, slot)
        self.rows = len(indices)
        if self.prefilling and partial != self.rows:  # the prompt being prefilled follows the active rows
            self.cache.move_row(partial, self.rows)
        held = self.rows + self.prefilling
        for slot in range(held, self.cache.batch):
            self.cache.lengths[slot] = 0
        needed = self.fast.capacity(max(self.cache.lengths[:held], default=0))
        rows = self.cache.batch if held > self.cache.batch // 4 else rows_allocated(held, self.max_batch_size)
        if 2 * needed <= self.cache.capacity or rows < self.cache.batch:
            self.cache = self.cache.resized(min(needed, self.cache.capacity), rows)

    def kv_slots(self, rows: int, longest: int) -> int:
        """Token slots (rows x columns) the cache takes to hold ``rows`` rows of up to ``longest`` positions."""
        return rows_allocated(rows, self.max_batch_size) * self.fast.capacity(longest)

    @property
    def kv_slots_held(self) -> int:
        return self.cache.batch * self.cache.capacity


def rows_allocated(rows: int, max_batch_size: int) -> int:
    """The rows a batch cache holding ``rows`` allocates: a power of two, at least one, at most the batch's limit."""
    held = 1
    while held < rows:
        held *= 2
    return min(held, max_batch_size)
