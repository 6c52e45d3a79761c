"""Batched speculative decoding: many sequences, one target forward per step, the one step.

Each step, every active row drafts from its own drafter state; the rows' blocks
[last token, drafts...] (a chain, or a token tree's nodes) are right-padded to a common width
and the target verifies all of them in ONE forward; the verifier then runs per row, so rows
accept different lengths (a tree row its own path: each of its nodes sees its ancestors only,
at the position of its depth).

The target's KV cache is one ``BatchCache`` [B, H, L, d] shared by all rows, with a validity
mask [B, L] over its columns (``blockspec.decoding.batch_cache``). The causal part of the attention
mask follows the cache columns and the padding part follows the validity mask, so masked
holes are never attended. Each row carries its own position ids, so RoPE sees the row's own
positions whatever its columns are. New rows are prefilled on their own (exactly as a single
sequence is) and spliced in, left-padded to the batch's length; finished rows leave with
``index_select``.

Greedy output of every row equals the row decoded alone; with a seed, a sampled row uses its
own generator in the same order as alone (prefill pick, propose, verify).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.batch_cache import BatchCache, check_batchable
from blockspec.decoding.block import VerifyBlock, batch_masks
from blockspec.decoding.cache import new_target_cache, sliding_window_of
from blockspec.decoding.compile_policy import compile_choice
from blockspec.decoding.costs import CostModel, batch_cost_model
from blockspec.decoding.fast import fast_forward
from blockspec.decoding.forward import TargetOutput
from blockspec.decoding.linear_states import LinearStates
from blockspec.decoding.policy import AUTO, WidthPolicies
from blockspec.decoding.rows import BatchEvent, Row, RowQueue
from blockspec.decoding.sequence import (
    GenerationConfig,
    GenerationStats,
    adapts_width,
    chain_unless_trees_verify,
    new_sequence,
    widest_verify,
)
from blockspec.decoding.static_targets import StaticBatchTarget
from blockspec.decoding.step import decode_step, end_sequence, start_sequence
from blockspec.decoding.verifier import TargetScores
from blockspec.drafters.base import Drafter
from blockspec.errors import BlockspecError
from blockspec.models.target import forward_options, layer_features


class BatchTarget:
    """The target's forwards for the batch's rows: each prefilled alone, all verified together.

    Every kind of cache layer is batched: attention and MLA layers share columns with a per-row
    validity mask; sliding-window layers keep every column and see their window through a mask
    built from each column's position; linear-attention layers hold one state per row, rolled back
    row by row (``blockspec.decoding.linear_states``).
    """

    def __init__(self, model, feature_layers: list[int] | None, pad_token_id: int = 0, max_batch_size: int = 8):
        self.model = model
        self.feature_layers = feature_layers
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        check_batchable(model)
        self.cache = BatchCache(model.config)
        template = new_target_cache(model)
        self.linear = LinearStates(model, template)
        self._window = sliding_window_of(template)
        self._layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        self._options = forward_options(model)
        #: The cache of a prompt prefilled in part (it joins the batch with its last part).
        self._partial = None
        self._block_valid: torch.Tensor | None = None
        self._block_positions: torch.Tensor | None = None

    def prefill(self, input_ids: torch.LongTensor, start: int = 0, last: bool = True) -> TargetOutput:
        """Prefill one new row on its own cache (the whole prompt, or its part from ``start``, in order), then, with
        its ``last`` part, splice that cache into the batch as its last row."""
        row_cache = self._partial if start else new_target_cache(self.model)
        out = self.model(input_ids=input_ids, cache=row_cache, use_cache=True, logits_to_keep=1,
                         output_hidden_states=self.feature_layers is not None, **self._options)
        self._partial = None if last else row_cache
        if last:
            self.cache.append_row(row_cache, start + input_ids.shape[1])
        return TargetOutput(TargetScores(out.logits[0, -1:]), self._features(out.hidden_states, 0))

    def drop_prefill(self) -> None:
        """Forget a prompt prefilled in part (its request was cancelled)."""
        self._partial = None

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        device = self.model.device
        width = max(block.width for block in blocks)
        input_ids = torch.full((len(blocks), width), self.pad_token_id, dtype=torch.long, device=device)
        block_valid = torch.zeros(len(blocks), width, dtype=torch.bool, device=device)
        for r, block in enumerate(blocks):
            input_ids[r, :block.width] = torch.tensor(block.tokens, dtype=torch.long, device=device)
            block_valid[r, :block.width] = True
        starts = torch.tensor([block.start for block in blocks], device=device)
        position_ids = starts.unsqueeze(1) + torch.arange(width, device=device).unsqueeze(0)
        for r, block in enumerate(blocks):
            position_ids[r, :block.width] = block.position_ids(device)[0]
        mask = batch_masks(blocks, self.cache.valid, self.cache.positions, block_valid, position_ids, self._layer_types,
                           self._window, self.model.dtype)
        with self.linear.recording(self.cache.kv):
            out = self.model(input_ids=input_ids, attention_mask=mask,
                             position_ids=position_ids, cache=self.cache.kv, use_cache=True,
                             output_hidden_states=self.feature_layers is not None, **self._options)
        self._block_valid, self._block_positions = block_valid, position_ids
        return [TargetOutput(TargetScores(out.logits[r, :block.width]),
                             self._features(out.hidden_states, r, block.width))
                for r, block in enumerate(blocks)]

    def keep(self, kept_rows: list[list[int]]) -> None:
        block_valid = self._block_valid
        for r, rows in enumerate(kept_rows):
            block_valid[r] = False
            block_valid[r, rows] = True
        self.linear.rewind(self.cache.kv, [len(rows) for rows in kept_rows], block_valid.shape[1])
        self.cache.settle(block_valid, self._block_positions)
        self._block_valid = self._block_positions = None

    def keep_sequences(self, indices: list[int]) -> None:
        """Only these rows (by index) go on; the others leave the batch."""
        self.cache.keep_rows(indices)

    def reserve(self, length: int) -> None:
        """Nothing to do: the dynamic cache grows as it goes."""

    def kv_slots(self, rows: int, longest: int) -> int:
        """Token slots (rows x columns) the cache takes to hold ``rows`` rows of up to ``longest`` positions (the
        columns the rows share, compacted when sparse: about the longest row's)."""
        return rows * longest

    @property
    def kv_slots_held(self) -> int:
        return self.cache.valid.numel()

    @property
    def path(self) -> str:
        """The forward path's name in the cost cache."""
        return f"batch{self.max_batch_size}-dynamic"

    def cost_model(self, model, widest: int) -> CostModel:
        """T(B, w) of this path for 1..max_batch_size rows (measured once per machine, then read from disk)."""
        def fresh():
            return BatchTarget(self.model, self.feature_layers, self.pad_token_id, self.max_batch_size)

        return batch_cost_model(model, widest, self.max_batch_size, fresh, self.path)

    def _features(self, hidden_states, row: int, length: int | None = None) -> torch.Tensor | None:
        if self.feature_layers is None:
            return None
        features = layer_features([h[row:row + 1] for h in hidden_states], self.feature_layers)
        return features if length is None else features[:, :length]


class BatchEngine(RowQueue):
    """Decodes many sequences at once; rows may join and leave between steps.

    ``drafter`` (None for plain autoregressive decoding) drafts for every row, each from its own
    state. ``add`` queues a sequence; each ``step`` admits queued rows up to ``max_batch_size``
    (prefilling each) and runs one batched verify forward, returning the ``BatchEvent`` of every
    row that produced tokens. ``compile``: "on"/"auto" run the rows through the fast path's static
    cache (oneDNN-packed on a CPU, eagerly: the row count changes from step to step).
    Rows with ``block_size="auto"`` share the engine's adaptive width (``width_policies``, kept
    across engines when passed in): each step cuts their drafts to the width that pays best for
    the whole batch, from T(B, w) measured through this engine's target. ``prefill_chunk``: a step
    prefills at most this many prompt tokens (a long prompt enters over several steps, so it never
    holds the running rows up for longer than one chunk); None: new prompts whole.
    """

    def __init__(self, target_model, drafter: Drafter | None = None, *, max_batch_size: int = 8,
                 compile: str = "off", width_policies: WidthPolicies | None = None, prefill_chunk: int | None = None,
                 kv_budget: int | None = None):
        if max_batch_size < 1:
            raise BlockspecError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if kv_budget is not None and kv_budget < 1:
            raise BlockspecError(f"kv_budget must be >= 1 token slots (or None: no bound), got {kv_budget}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise BlockspecError(f"prefill_chunk must be >= 1 tokens (or None: whole prompts), got {prefill_chunk}")
        super().__init__(target_model, drafter, width_policies)
        self.max_batch_size = max_batch_size
        self.compile = compile
        self.prefill_chunk = prefill_chunk
        #: Token slots (rows x columns) the target's KV cache may take: a row joins only when the cache would
        #: hold every row's prompt and longest answer within it (so no row is ever cut short for memory).
        self.kv_budget = kv_budget
        #: The first waiting row while its prompt enters the cache in parts: the tokens in so far, their features.
        self._prefilling: Row | None = None
        self._prefilled = 0
        self._prefill_features: list[torch.Tensor] = []
        layers = drafter.feature_layers if drafter is not None else None
        if compile_choice(target_model, compile)[0]:
            self.target = StaticBatchTarget(fast_forward(target_model, layers, compile=False), max_batch_size)
        else:
            self.target = BatchTarget(target_model, layers, max_batch_size=max_batch_size)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def cache(self):
        return self.target.cache

    def fresh(self) -> "BatchEngine":
        """An empty engine over the same model and drafter (after a failed step)."""
        return BatchEngine(self.model, self.drafter, max_batch_size=self.max_batch_size, compile=self.compile,
                           width_policies=self.width_policies, prefill_chunk=self.prefill_chunk,
                           kv_budget=self.kv_budget)

    def add(self, input_ids, config: GenerationConfig | None = None, *, namespace: str | None = None) -> Row:
        """Queue one sequence (ids [T] or [1, T]); it joins the batch at the next step. Each row verifies a chain
        or a token tree of its own (``config.tree_budget``). ``namespace``: whose earlier answers a drafter
        that copies may read and keeps this one for."""
        config = config or GenerationConfig()
        drafter = self.drafter.for_namespace(namespace) if self.drafter is not None else None
        sequence = new_sequence(self.model, input_ids, drafter, config)
        self.check_fits(sequence.input_ids.shape[1], sequence.max_new_tokens)
        if adapts_width(config):
            sequence.width_policy = self._width_policy(drafter, sequence.config)
        return self._queue(sequence)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a row the KV budget could not hold even alone."""
        need = self.target.kv_slots(1, prompt_tokens + max_new_tokens)
        if self.kv_budget is not None and need > self.kv_budget:
            raise BlockspecError(f"a prompt of {prompt_tokens} tokens and up to {max_new_tokens} new ones take "
                                 f"{need} KV cache slots, more than the budget of {self.kv_budget}: ask for fewer "
                                 "new tokens or send a shorter prompt")

    @property
    def kv_slots(self) -> int:
        """Token slots the target's KV cache holds now."""
        return self.target.kv_slots_held

    def prepare(self, config: GenerationConfig, say=None) -> None:
        """Measure (or read from disk) the T(B, w) rows under ``config`` will choose their widths by."""
        if config.block_size != AUTO or self.drafter is None:
            return
        config = chain_unless_trees_verify(self.model, config)
        if say is not None:
            say(f"the adaptive width's forward times for 1..{self.max_batch_size} rows ({self.target.path}; "
                "measured once per machine)")
        self._width_policy(self.drafter, config)

    def _width_policy(self, drafter: Drafter, config: GenerationConfig):
        """The engine's adaptive width for rows under ``config`` (as the sequence resolved it), timed through its
        own target."""
        return self.width_policies.get(self.model, widest_verify(drafter, config), tree=bool(config.tree_budget),
                                       path=self.target.path, measure=self.target.cost_model)

    def step(self) -> list[BatchEvent]:
        """Admit queued rows, then one verify forward over every active row."""
        with torch.inference_mode():
            self._drop_cancelled()
            events = self._admit()
            self._drop_finished()  # rows whose first token ended them
            if self.rows:
                events += self._decode()
            self._drop_finished()
        return events

    def _admit(self) -> list[BatchEvent]:
        """Prefill waiting rows in order, up to ``prefill_chunk`` prompt tokens this step; each row whose prompt is
        all in picks its first token and joins the batch."""
        events = []
        budget = self.prefill_chunk or float("inf")
        while self.waiting and len(self.rows) < self.max_batch_size and budget > 0 and self._fits(self.waiting[0]):
            row = self.waiting[0]
            out, budget = self._prefill_part(row, budget)
            if out is None:
                break
            self.waiting.popleft()
            step = start_sequence(row.sequence, out)
            row.stats.time_to_first_token = row.stats.total_time = wall_clock(self.device) - row.submitted_at
            self.rows.append(row)
            events.append(BatchEvent(row, step))
        return events

    def _fits(self, row: Row) -> bool:
        """Whether the KV budget holds the running rows and ``row`` (one already entering: yes), each to its longest."""
        if self.kv_budget is None or row is self._prefilling:
            return True
        reach = max(_reach(r) for r in [*self.rows, row])
        return self.target.kv_slots(len(self.rows) + 1, reach) <= self.kv_budget

    def _prefill_part(self, row: Row, budget: float) -> tuple[TargetOutput | None, float]:
        """Prefill the next part of the row's prompt within ``budget`` tokens: the whole prompt's output once its
        last part is in (None before), and the budget left."""
        ids, start = row.sequence.input_ids, self._prefilled
        total = ids.shape[1]
        self.target.reserve(total + 1)  # the whole prompt (rows leaving may have shrunk it); verify grows it later
        end = int(min(total, start + budget))
        out = self.target.prefill(ids[:, start:end], start=start, last=end == total)
        budget -= end - start
        if out.features is not None:
            self._prefill_features.append(out.features)
        if end < total:
            self._prefilled, self._prefilling = end, row
            return None, budget
        features = torch.cat(self._prefill_features, dim=1) if self._prefill_features else None
        self._prefilled, self._prefill_features, self._prefilling = 0, [], None
        return TargetOutput(out.scores, features), budget

    def _forget(self, row: Row) -> None:
        if row is self._prefilling:  # cancelled with its prompt partly in the cache
            self.target.drop_prefill()
            self._prefilled, self._prefill_features, self._prefilling = 0, [], None

    def _decode(self) -> list[BatchEvent]:
        self.batch_sizes.append(len(self.rows))
        steps = decode_step(self.target, [row.sequence for row in self.rows])
        self.verify_widths.append(max(step.width for step in steps))
        now = wall_clock(self.device)
        for row in self.rows:
            row.stats.total_time = now - row.submitted_at
        return [BatchEvent(row, step) for row, step in zip(self.rows, steps)]

    def _drop_finished(self) -> None:
        keep = [i for i, row in enumerate(self.rows) if not row.finished]
        for row in self.rows:
            if row.finished:
                end_sequence(row.sequence)
        if len(keep) < len(self.rows):
            self.rows = [self.rows[i] for i in keep]
            self.target.keep_sequences(keep)


def _reach(row: Row) -> int:
    """The positions a row may come to hold: its prompt and its longest answer."""
    return row.sequence.input_ids.shape[1] + row.sequence.max_new_tokens


@dataclass
class BatchResult:
    token_ids: list[int]
    stats: GenerationStats


def batch_generate(target_model, prompts, drafter: Drafter | None = None,
                   configs: GenerationConfig | list[GenerationConfig] | None = None, *,
                   max_batch_size: int = 8, compile: str = "off",
                   width_policies: WidthPolicies | None = None) -> list[BatchResult]:
    """Decode every prompt (ids) through one ``BatchEngine``; results in prompt order.

    ``configs`` is one config for all prompts or one per prompt.
    """
    prompts = list(prompts)
    if configs is None or isinstance(configs, GenerationConfig):
        configs = [configs or GenerationConfig()] * len(prompts)
    if len(configs) != len(prompts):
        raise BlockspecError(f"got {len(configs)} generation configs for {len(prompts)} prompts: give one or one each")
    engine = BatchEngine(target_model, drafter, max_batch_size=max_batch_size, compile=compile,
                         width_policies=width_policies)
    rows = [engine.add(ids, config) for ids, config in zip(prompts, configs)]
    for _ in engine.run():
        pass
    return [BatchResult(row.token_ids, row.stats) for row in rows]
