"""Batched speculative decoding: many sequences, one target forward per step, the one verifier.

Each step, every active row asks its own drafter for drafts; the rows' blocks
[last token, drafts...] are right-padded to a common width and the target verifies all of
them in ONE forward; ``verify`` then runs per row, so rows accept different lengths.

The target's KV cache is one ``DynamicCache`` [B, H, L, d] shared by all rows, with a
validity mask [B, L] over its columns. A row's rejected (or padding) positions are masked
out rather than cropped; only the columns no row keeps are cropped from the tail. The
causal part of the attention mask follows the cache columns and the padding part follows
the validity mask, so masked holes are never attended. Each row carries its own position
ids, so RoPE sees the row's own positions whatever its columns are. New rows are
prefilled on their own (exactly as ``speculative_generate`` does) and spliced in,
left-padded to the batch's length; finished rows leave with ``index_select``, and the cache
is compacted when holes make up most of it.

Greedy output of every row equals the row decoded alone; with a seed, a sampled row uses
its own generator in the same order as alone (prefill pick, propose, verify).
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from transformers import DynamicCache

from blockspec.decoding.adaptive import AUTO
from blockspec.decoding.drafter import Drafter, Proposal
from blockspec.decoding.generate import (GenerationConfig, GenerationStats, Step, _as_batch_of_one, _fit_to_context,
                                         record_step, resolve_block_size, wall_clock)
from blockspec.sampling import pick_tokens
from blockspec.decoding.verifier import verify
from blockspec.errors import BlockspecError

#: A callable returning a fresh drafter for one sequence, or None for plain AR decoding.
DrafterFactory = Callable[[], Drafter]

# Compact the cache when fewer than this share of its columns hold kept entries of the
# longest row: rebuilding costs one copy of the cache, so it only pays off when holes dominate.
_COMPACT_BELOW = 0.5


def drafter_factory(drafter: Drafter | None) -> DrafterFactory | None:
    """Fresh per-sequence drafters from one loaded drafter (shallow copies share its weights).

    Every drafter resets its per-sequence state in ``begin``, so a shallow copy is a new,
    independent sequence over the same model.
    """
    if drafter is None:
        return None
    return lambda: copy.copy(drafter)


@dataclass
class BatchRow:
    """One sequence of the batch: its settings, its drafter, its state and its statistics."""

    id: int
    input_ids: torch.LongTensor
    config: GenerationConfig
    drafter: Drafter | None
    block_size: int
    max_new_tokens: int
    stats: GenerationStats
    submitted_at: float
    token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    #: The next token to feed (picked by the target, not yet in its cache) and its position.
    last_token: int = 0
    position: int = 0

    @property
    def finished(self) -> bool:
        return bool(self.stats.finish_reason)

    @property
    def wants_features(self) -> bool:
        return self.drafter is not None and self.drafter.feature_layers is not None

    def features(self, hidden_states, row: int, length: int | None = None) -> torch.Tensor:
        """This row's drafter features [1, T, F] from a forward's hidden states."""
        picked = torch.cat([hidden_states[i + 1][row:row + 1] for i in self.drafter.feature_layers], dim=-1)
        return picked if length is None else picked[:, :length]

    def record(self, step: Step, now: float, decode: bool) -> Step:
        record_step(step, self.token_ids, self.stats, set(self.config.stop_token_ids), self.max_new_tokens,
                    self.max_new_tokens < self.config.max_new_tokens, decode)
        self.stats.total_time = now - self.submitted_at
        return step


@dataclass
class BatchEvent:
    """A step one row produced; ``row.finished`` tells whether it was the row's last."""

    row: BatchRow
    step: Step


class BatchCache:
    """The target's KV cache for all rows, with a per-row validity mask over its columns."""

    def __init__(self, model_config):
        self.model_config = model_config
        self.kv: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    def layers(self):
        return self.kv.layers

    def append_row(self, row_cache: DynamicCache, prompt_length: int) -> None:
        """Splice a row prefilled on its own into the batch (both left-padded to a common length)."""
        row_valid = torch.ones(1, prompt_length, dtype=torch.bool, device=self.valid.device)
        if self.kv is None or self.valid.shape[0] == 0:
            self.kv, self.valid = row_cache, row_valid.to(_device_of(row_cache))
            return
        length = max(self.length, prompt_length)
        self._left_pad(length - self.length)
        for mine, theirs in zip(self.kv.layers, row_cache.layers):
            mine.keys = torch.cat([mine.keys, _left_pad(theirs.keys, length - prompt_length)], dim=0)
            mine.values = torch.cat([mine.values, _left_pad(theirs.values, length - prompt_length)], dim=0)
        row_valid = torch.nn.functional.pad(row_valid.to(self.valid.device), (length - prompt_length, 0))
        self.valid = torch.cat([self.valid, row_valid], dim=0)

    def keep_rows(self, indices: list[int]) -> None:
        if not indices:
            self.kv, self.valid = None, self.valid[:0, :0]
            return
        index = torch.tensor(indices, dtype=torch.long, device=self.valid.device)
        for layer in self.kv.layers:
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))
        self.valid = self.valid.index_select(0, index)
        self.compact_if_sparse()

    def attention_mask(self, block_valid: torch.Tensor) -> torch.Tensor:
        """The 2D key mask [B, L + W] for a forward over blocks whose real columns are ``block_valid``."""
        return torch.cat([self.valid, block_valid], dim=1)

    def settle(self, block_valid: torch.Tensor) -> None:
        """After a forward appended W columns: keep what each row accepted, crop what no row keeps."""
        self.valid = torch.cat([self.valid, block_valid], dim=1)
        used = self.valid.any(dim=0).nonzero()
        last_used = int(used.max()) + 1 if used.numel() else 0
        if last_used < self.length:
            self.kv.crop(last_used - self.length)
            self.valid = self.valid[:, :last_used]
        self.compact_if_sparse()

    def compact_if_sparse(self) -> None:
        if self.kv is None:
            return
        longest = int(self.valid.sum(dim=1).max())
        if longest < self.length * _COMPACT_BELOW or self.valid[:, 0].sum() == 0:
            self.compact()

    def compact(self) -> None:
        """Move every row's kept entries together, right-aligned, dropping all holes."""
        counts = self.valid.sum(dim=1)
        length = int(counts.max())
        # For row r, column j of the new cache takes old column index[r, j]; the first
        # length - counts[r] columns are padding (they copy column 0 and stay masked).
        order = torch.argsort((~self.valid).int(), dim=1, stable=True)[:, :length]  # kept columns, in order
        shift = length - counts
        columns = torch.arange(length, device=self.valid.device)
        source = (columns.unsqueeze(0) - shift.unsqueeze(1)).clamp_min(0)
        index = order.gather(1, source)
        new_valid = columns.unsqueeze(0) >= shift.unsqueeze(1)
        for layer in self.kv.layers:
            gather = index.to(layer.keys.device)[:, None, :, None].expand(
                layer.keys.shape[0], layer.keys.shape[1], length, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.valid = new_valid

    def _left_pad(self, columns: int) -> None:
        if columns <= 0:
            return
        for layer in self.kv.layers:
            layer.keys = _left_pad(layer.keys, columns)
            layer.values = _left_pad(layer.values, columns)
        self.valid = torch.nn.functional.pad(self.valid, (columns, 0))


def _left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, L, d] with ``columns`` zero columns before L."""
    if columns <= 0:
        return states
    return torch.nn.functional.pad(states, (0, 0, columns, 0))


def _device_of(cache: DynamicCache) -> torch.device:
    return cache.layers[0].keys.device


class BatchEngine:
    """Decodes many sequences at once; rows may join and leave between steps.

    ``make_drafter`` returns a fresh drafter for each new row (see ``drafter_factory``),
    None for plain autoregressive decoding. ``add`` queues a sequence; each ``step``
    admits queued rows up to ``max_batch_size`` (prefilling each) and runs one batched
    verify forward, returning the ``BatchEvent`` of every row that produced tokens.
    """

    def __init__(self, target_model, make_drafter: DrafterFactory | None = None, *, max_batch_size: int = 8):
        if max_batch_size < 1:
            raise BlockspecError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.model = target_model
        self.make_drafter = make_drafter
        self.max_batch_size = max_batch_size
        self.rows: list[BatchRow] = []
        self.waiting: deque[BatchRow] = deque()
        self.cache = BatchCache(target_model.config)
        self.pad_token_id = 0
        self._ids = itertools.count()
        self._cancelled: set[int] = set()
        #: Active rows in each decode forward so far (for the batch-size figures).
        self.batch_sizes: list[int] = []

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def has_work(self) -> bool:
        return bool(self.rows or self.waiting)

    @property
    def free_slots(self) -> int:
        return self.max_batch_size - len(self.rows) - len(self.waiting)

    def fresh(self) -> "BatchEngine":
        """An empty engine over the same model and drafters (after a failed step)."""
        return BatchEngine(self.model, self.make_drafter, max_batch_size=self.max_batch_size)

    def add(self, input_ids, config: GenerationConfig | None = None) -> BatchRow:
        """Queue one sequence (ids [T] or [1, T]); it joins the batch at the next step."""
        config = config or GenerationConfig()
        if config.block_size == AUTO:
            raise BlockspecError("block_size 'auto' chooses widths for one sequence at a time; batched decoding "
                                 "verifies a fixed width: give a number (a server started with --block-size auto "
                                 "decodes requests one at a time)")
        ids = _as_batch_of_one(input_ids, self.device)
        drafter = self.make_drafter() if self.make_drafter is not None else None
        row = BatchRow(
            id=next(self._ids), input_ids=ids, config=config, drafter=drafter,
            block_size=resolve_block_size(drafter, config.block_size),
            max_new_tokens=_fit_to_context(self.model, ids.shape[1], config.max_new_tokens),
            stats=GenerationStats(prompt_tokens=ids.shape[1]), submitted_at=wall_clock(self.device),
        )
        self.waiting.append(row)
        return row

    def cancel(self, row: BatchRow | int) -> None:
        """Drop a row (queued or active) before the next step; it yields nothing more."""
        self._cancelled.add(row if isinstance(row, int) else row.id)

    def step(self) -> list[BatchEvent]:
        """Admit queued rows, then one verify forward over every active row."""
        with torch.inference_mode():
            self._drop_cancelled()
            events = self._admit()
            if self.rows:
                events += self._decode()
            self._drop_finished()
        return events

    def run(self) -> Iterator[BatchEvent]:
        """Step until every queued and active row has finished."""
        while self.has_work:
            yield from self.step()

    # -- joining and leaving -------------------------------------------------------------

    def _admit(self) -> list[BatchEvent]:
        events = []
        while self.waiting and len(self.rows) < self.max_batch_size:
            row = self.waiting.popleft()
            events.append(self._prefill(row))
        return events

    def _prefill(self, row: BatchRow) -> BatchEvent:
        """Prefill the row on its own, as ``speculative_generate`` does, and splice its cache in."""
        sampling = row.config.sampling
        row.generator = sampling.make_generator(self.device) if not sampling.greedy else None
        row_cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=row.input_ids, cache=row_cache, use_cache=True, logits_to_keep=1,
                         output_hidden_states=row.wants_features)
        row.last_token = int(pick_tokens(out.logits[0, -1], sampling, row.generator))
        row.position = row.input_ids.shape[1]
        if row.drafter is not None:
            row.drafter.begin(row.input_ids, row.features(out.hidden_states, 0) if row.wants_features else None)
        now = wall_clock(self.device)
        row.stats.time_to_first_token = now - row.submitted_at
        step = row.record(Step([row.last_token], 0, 0), now, decode=False)
        if not row.finished:
            _check_full_attention(row_cache)
            self.cache.append_row(row_cache, row.position)
            self.rows.append(row)
        return BatchEvent(row, step)

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        for row in [r for r in self.waiting if r.id in self._cancelled]:
            self.waiting.remove(row)
            row.stats.finish_reason = "cancelled"
        for row in self.rows:
            if row.id in self._cancelled:
                row.stats.finish_reason = "cancelled"
        self._cancelled.clear()
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if not row.finished]
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.cache.keep_rows(keep)

    # -- one decode step -------------------------------------------------------------------

    def _decode(self) -> list[BatchEvent]:
        proposals = [self._propose(row) for row in self.rows]
        blocks = [[row.last_token] + p.tokens.tolist() for row, p in zip(self.rows, proposals)]
        width = max(len(b) for b in blocks)
        input_ids = torch.full((len(blocks), width), self.pad_token_id, dtype=torch.long, device=self.device)
        block_valid = torch.zeros(len(blocks), width, dtype=torch.bool, device=self.device)
        for r, block in enumerate(blocks):
            input_ids[r, :len(block)] = torch.tensor(block, dtype=torch.long, device=self.device)
            block_valid[r, :len(block)] = True
        starts = torch.tensor([row.position for row in self.rows], device=self.device)
        position_ids = starts.unsqueeze(1) + torch.arange(width, device=self.device).unsqueeze(0)
        wants_features = any(row.wants_features for row in self.rows)
        self.batch_sizes.append(len(self.rows))

        out = self.model(input_ids=input_ids, attention_mask=self.cache.attention_mask(block_valid),
                         position_ids=position_ids, cache=self.cache.kv, use_cache=True,
                         output_hidden_states=wants_features)
        now = wall_clock(self.device)
        events = []
        for r, (row, proposal, block) in enumerate(zip(self.rows, proposals, blocks)):
            logits = out.logits[r, :len(block)]
            verdict = verify(proposal.tokens, logits, row.config.sampling, proposal.probs, row.generator)
            kept = verdict.num_accepted + 1
            block_valid[r, kept:] = False
            if row.drafter is not None:
                features = row.features(out.hidden_states, r, kept) if row.wants_features else None
                row.drafter.commit(input_ids[r:r + 1, :kept], features)
            row.position += kept
            row.last_token = verdict.next_token
            new_tokens = block[1:1 + verdict.num_accepted] + [verdict.next_token]
            step = Step(new_tokens, len(proposal.tokens), verdict.num_accepted)
            events.append(BatchEvent(row, row.record(step, now, decode=True)))
        self.cache.settle(block_valid)
        return events

    def _propose(self, row: BatchRow) -> Proposal:
        remaining = row.max_new_tokens - len(row.token_ids)
        num_tokens = min(row.block_size - 1, remaining - 1)
        if row.drafter is None or num_tokens <= 0:
            return Proposal.empty(self.device)
        return row.drafter.propose(row.last_token, num_tokens, row.config.sampling, row.generator)


def _check_full_attention(cache: DynamicCache) -> None:
    if any(getattr(layer, "is_sliding", False) for layer in cache.layers):
        raise BlockspecError("batched decoding needs a full-attention target; this model has sliding-window "
                             "layers: decode it one sequence at a time with speculative_generate")


@dataclass
class BatchResult:
    token_ids: list[int]
    stats: GenerationStats


def batch_generate(target_model, prompts, make_drafter: DrafterFactory | None = None,
                   configs: GenerationConfig | list[GenerationConfig] | None = None, *,
                   max_batch_size: int = 8) -> list[BatchResult]:
    """Decode every prompt (ids) through one ``BatchEngine``; results in prompt order.

    ``configs`` is one config for all prompts or one per prompt.
    """
    prompts = list(prompts)
    if configs is None or isinstance(configs, GenerationConfig):
        configs = [configs or GenerationConfig()] * len(prompts)
    if len(configs) != len(prompts):
        raise BlockspecError(f"got {len(configs)} generation configs for {len(prompts)} prompts: give one or one each")
    engine = BatchEngine(target_model, make_drafter, max_batch_size=max_batch_size)
    rows = [engine.add(ids, config) for ids, config in zip(prompts, configs)]
    for _ in engine.run():
        pass
    return [BatchResult(row.token_ids, row.stats) for row in rows]
