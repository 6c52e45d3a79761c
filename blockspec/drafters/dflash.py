"""DFlash behind the drafter protocol: one forward pass of the block denoiser drafts the whole block.

The drafter's per-sequence state is its context cache (projected keys/values of committed
positions) and the features of positions committed since the last draft, which the next
pass appends to that cache. A drafter over a reduced vocabulary also keeps, per sequence, the
target-head rows of the sequence's own tokens outside that vocabulary (see ``SequenceRows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.drafters.base import PositionwiseDrafter, Proposal
from blockspec.errors import BlockspecError
from blockspec.models.dflash.checkpoint import check_fits_target, load_dflash_model
from blockspec.models.dflash.modules import ContextCache, DFlashDraftModel
from blockspec.models.packed import bf16_faster, linear_layers, module_twin, packing_available, plan_kernels, planned
from blockspec.models.target import position_ids
from blockspec.sampling import draft_confidence, sample_from, sampling_probs


def denoise_schedule(num_tokens: int, steps: int) -> list[int]:
    """Positions committed at each pass: ``num_tokens`` over ``min(steps, num_tokens)`` passes, as
    evenly as possible, the first ``num_tokens % passes`` passes taking one more (as LLaDA's
    num_transfer_tokens)."""
    if num_tokens == 0:
        return []
    passes = min(steps, num_tokens)
    share, extra = divmod(num_tokens, passes)
    return [share + 1] * extra + [share] * (passes - extra)


def check_denoise_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BlockspecError(f"denoise_steps must be a whole number >= 1 (1 drafts the block in one pass), "
                             f"got {steps!r}")
    return steps


def most_confident(logits: torch.Tensor, masked: torch.Tensor, count: int) -> torch.LongTensor:
    """The ``count`` still-masked rows of logits [n, V] whose top probability is highest, highest first."""
    confidence = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
    return confidence.masked_fill(~masked, -1.0).topk(count).indices


#: By default at most this many of a sequence's own tokens join a reduced draft vocabulary (a long
#: prompt's rare tokens would otherwise grow every pass's head without bound).
MAX_SEQUENCE_ROWS = 2048


@dataclass
class SequenceRows:
    """A sequence's own tokens (prompt and output) that a reduced draft vocabulary lacks, and their rows of
    the target's LM head: scored next to the K rows, so identifiers the prompt names (function and variable
    names, doctest markers) can be drafted when the output repeats them."""

    #: Their target ids, on the CPU (bookkeeping only, so a step adds no device round trip).
    ids: torch.LongTensor
    weight: torch.Tensor
    #: The target id of every row a draft scores, on the drafter's device: the vocabulary's K, then ``ids``.
    row_ids: torch.LongTensor


@dataclass
class DFlashState:
    """One sequence: the drafter's context cache and the features not yet in it."""

    cache: ContextCache
    pending: torch.Tensor | None
    #: The sequence's own tokens outside a reduced draft vocabulary (None: none, or not tracked).
    sequence_rows: SequenceRows | None = None


class DFlashDrafter(PositionwiseDrafter):
    """One pass over [last token, MASK, ...] drafts every block position.

    With ``denoise_steps`` K > 1 the block is denoised in K passes: after each pass the most
    confident masked positions are committed (their token replaces MASK in the next pass), per
    ``denoise_schedule``.
    """

    name = "dflash"
    #: Whether it runs a head that chains the block's positions (DSpark's, Domino's, DFlash2's selector): a plain
    #: DFlash drafter refuses a draft that has one.
    chains_positions = False

    def __init__(self, model: DFlashDraftModel, target_model, *, sample_drafts: bool = True,
                 denoise_steps: int = 1, packed: bool = False, draft_vocabulary=None,
                 sequence_tokens: bool = True, max_sequence_rows: int = MAX_SEQUENCE_ROWS, draft_dtype=None):
        if model.method != "dflash" and not self.chains_positions:
            raise BlockspecError(f"this draft's {model.method} head chains its block's positions: run it with "
                                 f"--method {model.method}")
        check_fits_target(model, target_model.config)
        if draft_vocabulary is not None:
            model.compress_vocabulary(draft_vocabulary, target_model.get_output_embeddings().weight)
        param = next(target_model.parameters())
        #: The drafter's own precision: the target's, or bf16 (``draft_dtype``; "auto": where bf16 measures faster
        #: on this CPU). Only the proposals depend on it: the target verifies them in its own precision.
        self.dtype = self._draft_dtype(draft_dtype, model, param)
        self.model = model.to(device=param.device, dtype=self.dtype).eval()
        self.model.requires_grad_(False)
        self.embed_tokens = target_model.get_input_embeddings()
        self.vocab_size = target_model.get_output_embeddings().weight.shape[0]
        #: The LM head a pass spends most of its time in: the draft's own over its K-token vocabulary, else the
        #: target's. With ``packed`` (a CPU), it and the drafter's linear layers run on the kernels measured
        #: fastest here.
        self.lm_head = model.lm_head if model.compressed else target_model.get_output_embeddings()
        #: Target id of each row of the head (None: the head is the target's, row = id).
        self.draft_to_target = model.draft_to_target.to(param.device) if model.compressed else None
        #: With a reduced vocabulary and ``sequence_tokens``: the target's head, whose rows of each sequence's
        #: own tokens outside the vocabulary are scored too; ``in_vocabulary`` marks the K ids (on the CPU).
        self.sequence_head = None
        if model.compressed and sequence_tokens:
            self.sequence_head = target_model.get_output_embeddings().weight
            self.in_vocabulary = torch.zeros(self.vocab_size, dtype=torch.bool)
            self.in_vocabulary[model.draft_to_target.cpu()] = True
            self.max_sequence_rows = max_sequence_rows
        #: What the head computes in: the drafter's own head is in its precision, the target's in the target's.
        self.head_dtype = self.dtype if model.compressed else param.dtype
        if packed and packing_available(target_model) and self.dtype == param.dtype:
            heads = [self.lm_head] if isinstance(self.lm_head, nn.Linear) else []  # a quantized head is prepacked
            plan = plan_kernels(heads + linear_layers(self.model))
            self.lm_head = planned(self.lm_head, plan) if heads else self.lm_head
            self.model = module_twin(self.model, plan=plan)
        self.feature_layers = list(model.target_layer_ids)
        self.max_draft_tokens = model.max_draft_tokens
        self.default_block_size = model.max_draft_tokens + 1
        #: Block slots before the first that predicts: the anchor's, unless the anchor's slot predicts itself.
        self.lead = 0 if model.anchor_predicts else 1
        self.mask_token_id = int(model.mask_token_id)
        #: At temperature > 0: sample drafts from q and use full rejection sampling (True),
        #: or draft greedily and accept with probability p(draft) (False, the reference).
        self.sample_drafts = sample_drafts
        self.denoise_steps = check_denoise_steps(denoise_steps)
        if self.denoise_steps > 1 and model.anchor_predicts:
            raise BlockspecError("denoise_steps > 1 refills masked slots with their drafts, but this draft's slot k "
                                 "predicts the token after it (sample_from_anchor): draft it in one pass")
        self.device = param.device

    @staticmethod
    def _draft_dtype(draft_dtype, model: DFlashDraftModel, param: torch.Tensor) -> torch.dtype:
        if draft_dtype is None:
            return param.dtype
        if draft_dtype == "auto":
            fast = param.device.type == "cpu" and param.dtype == torch.float32 and \
                bf16_faster(linear_layers(model), model.block_size)
            return torch.bfloat16 if fast else param.dtype
        if draft_dtype not in (torch.bfloat16, torch.float32):
            raise BlockspecError(f"draft_dtype must be None, 'auto', torch.bfloat16 or torch.float32, "
                                 f"got {draft_dtype!r}")
        return draft_dtype

    def start(self, prompt_ids, features) -> DFlashState:
        state = DFlashState(self.model.new_cache(), features)
        self._add_sequence_tokens(state, prompt_ids)
        return state

    def commit(self, state: DFlashState, tokens, features) -> None:
        state.pending = features if state.pending is None else torch.cat([state.pending, features], dim=1)
        self._add_sequence_tokens(state, tokens)

    def _add_sequence_tokens(self, state: DFlashState, tokens) -> None:
        """Give the sequence's tokens outside the reduced vocabulary rows of their own (up to the cap)."""
        if self.sequence_head is None:
            return
        ids = torch.as_tensor(tokens).reshape(-1).cpu()
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]
        new = ids[~self.in_vocabulary[ids]].unique()
        known = state.sequence_rows
        if known is not None:
            new = new[~torch.isin(new, known.ids)]
        room = self.max_sequence_rows - (0 if known is None else known.ids.numel())
        new = new[:max(room, 0)]
        if new.numel() == 0:
            return
        weight = self.sequence_head.detach()[new.to(self.device)].to(self.dtype)
        if known is not None:
            new, weight = torch.cat([known.ids, new]), torch.cat([known.weight, weight])
        row_ids = torch.cat([self.draft_to_target, new.to(self.device)])
        state.sequence_rows = SequenceRows(ids=new, weight=weight, row_ids=row_ids)

    @torch.inference_mode()
    def propose(self, state: DFlashState, last_token, num_tokens, sampling, generator) -> Proposal:
        if num_tokens == 0:
            return Proposal.empty(self.device)
        logits = self.head_logits(state, last_token, num_tokens)
        row_ids = self.row_ids(state)
        # Drafted out of left-to-right order, a sampled token's q is not its distribution given the
        # drafts before it, so rejection sampling with q would be biased: denoised drafts are
        # deterministic (accepted with probability p(draft), exact for any deterministic draft).
        denoised = len(denoise_schedule(num_tokens, self.denoise_steps)) > 1
        if sampling.greedy or not self.sample_drafts or denoised:
            rows = logits.argmax(dim=-1)
            return Proposal(self._target_ids(rows, row_ids), confidence=draft_confidence(logits, rows))
        probs = self._target_probs(sampling_probs(logits, sampling), row_ids)  # zero outside the drafted rows
        # every position's q comes from the one pass, before any draw: its peak is a confidence the draws
        # do not move
        return Proposal(sample_from(probs, generator), probs, confidence=probs.amax(dim=-1))

    @torch.inference_mode()
    def draft_logits(self, state: DFlashState, last_token: int, num_tokens: int) -> torch.Tensor:
        """Logits [num_tokens, V] for the positions after ``last_token`` (-inf outside a reduced draft
        vocabulary and the sequence's own tokens)."""
        logits, row_ids = self.row_logits(state, last_token, num_tokens)
        if row_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, row_ids, logits)

    def row_logits(self, state: DFlashState, last_token: int, num_tokens: int):
        logits = self.head_logits(state, last_token, num_tokens)
        return logits, self.row_ids(state)

    @torch.inference_mode()
    def rows_logits(self, states: list[DFlashState], last_tokens: list[int], num_tokens: int):
        """One pass over every sequence's block: the projections, MLPs and head run over all rows together
        (their weights read once), each row attending its own context cache."""
        if len(states) == 1 or self.denoise_steps > 1 or not self.model.attends_rows_alike:
            return super().rows_logits(states, last_tokens, num_tokens)
        hidden = self.rows_hidden(states, last_tokens, num_tokens)
        heads = self.lm_head(hidden.reshape(-1, hidden.shape[-1]).to(self.head_dtype))
        heads = heads.view(len(states), num_tokens, -1)
        return [(self._scored(hidden[row], heads[row], state), self.row_ids(state)) for row, state in enumerate(states)]

    def rows_hidden(self, states: list[DFlashState], last_tokens: list[int], num_tokens: int) -> torch.Tensor:
        """The final hidden states [B, num_tokens, D] of every sequence's block, from one pass (each row's pending
        context enters its cache)."""
        block_ids = self._block_ids(last_tokens, num_tokens)
        positions = torch.tensor([_block_start(s) for s in states], device=self.device).unsqueeze(1) + \
            torch.arange(block_ids.shape[1], device=self.device).unsqueeze(0)
        embeddings = self.model.embed_block(self.embed_tokens, block_ids).to(self.dtype)
        contexts = [None if s.pending is None else s.pending.to(self.dtype) for s in states]
        hidden = self.model.forward_rows(embeddings, positions, contexts, [s.cache for s in states])[:, self.lead:]
        for state in states:
            state.pending = None
        return hidden

    def row_ids(self, state: DFlashState) -> torch.LongTensor | None:
        """The target id of each row this sequence's drafts score (None: the target's whole vocabulary)."""
        rows = state.sequence_rows
        return self.draft_to_target if rows is None else rows.row_ids

    def _target_ids(self, rows: torch.LongTensor, row_ids: torch.LongTensor | None) -> torch.LongTensor:
        return rows if row_ids is None else row_ids[rows]

    def _target_probs(self, probs: torch.Tensor, row_ids: torch.LongTensor | None) -> torch.Tensor:
        if row_ids is None:
            return probs
        return probs.new_zeros((probs.shape[0], self.vocab_size)).index_copy_(1, row_ids, probs)

    @torch.inference_mode()
    def head_logits(self, state: DFlashState, last_token: int, num_tokens: int) -> torch.Tensor:
        """Logits [num_tokens, K] over the rows of the drafter's head (the target's V, or its own K) for the
        positions after ``last_token``.

        Row i comes from the pass that committed position i, so its argmax is that position's
        draft. Only the first pass appends the pending context features to the cache.
        """
        pending, start = state.pending, _block_start(state)
        block_ids = self._block_ids([last_token], num_tokens)
        logits = self._block_logits(state, block_ids, start, pending)
        state.pending = None
        schedule = denoise_schedule(num_tokens, self.denoise_steps)
        if len(schedule) <= 1:  # one pass commits every position: nothing to rank or feed back
            return logits
        committed = torch.empty_like(logits)
        row_ids = self.row_ids(state)
        masked = torch.ones(num_tokens, dtype=torch.bool, device=self.device)
        for index, count in enumerate(schedule):
            if index > 0:
                logits = self._block_logits(state, block_ids, start)
            chosen = most_confident(logits, masked, count)
            committed[chosen] = logits[chosen]
            block_ids[0, self.lead + chosen] = self._target_ids(logits[chosen].argmax(dim=-1), row_ids)
            masked[chosen] = False
        return committed

    def _block_logits(self, state: DFlashState, block_ids, start: int,
                      context: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over the block at positions ``start``...; ``context``: features of the positions
        just before ``start``, appended to the cache (None: attend the cache as it is). Its rows: the
        head's, then the sequence's own tokens'."""
        hidden = self._block_hidden(state, block_ids, start, context)
        return self._scored(hidden, self.lm_head(hidden.to(self.head_dtype)), state)

    def _block_hidden(self, state: DFlashState, block_ids, start: int,
                      context: torch.Tensor | None = None) -> torch.Tensor:
        """The final hidden states [num_tokens, D] of the slots that predict, from one pass (as ``_block_logits``)."""
        context_positions = None if context is None else \
            position_ids(start - context.shape[1], context.shape[1], self.device)
        embeddings = self.model.embed_block(self.embed_tokens, block_ids).to(self.dtype)
        hidden = self.model(embeddings, position_ids(start, block_ids.shape[1], self.device),
                            None if context is None else context.to(self.dtype), context_positions, state.cache)
        return hidden[0, self.lead:]

    def _block_ids(self, last_tokens: list[int], num_tokens: int) -> torch.LongTensor:
        """[B, slots]: each row's last token, then MASK up to the slot that predicts the last position to draft."""
        block_ids = torch.full((len(last_tokens), num_tokens + self.lead), self.mask_token_id, dtype=torch.long,
                               device=self.device)
        block_ids[:, 0] = torch.tensor(last_tokens, dtype=torch.long, device=self.device)
        return block_ids

    def _scored(self, hidden: torch.Tensor, head: torch.Tensor, state: DFlashState) -> torch.Tensor:
        """Logits [n, K] in float32 from the block's final hidden states [n, D] and the head's output over
        them: the head's rows, then the sequence's own tokens'."""
        if state.sequence_rows is not None:
            head = torch.cat([head, F.linear(hidden, state.sequence_rows.weight)], dim=-1)
        logits = head.float()
        scale = self.model.logit_scale * self.model.output_multiplier
        logits = logits if scale == 1.0 else logits * scale
        cap = self.model.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _block_start(state: DFlashState) -> int:
    """The position of the block's first row: after the cached context and the features still pending."""
    return state.cache.length + (0 if state.pending is None else state.pending.shape[1])


def build(directory, target, *, sample_drafts: bool = True, denoise_steps: int = 1,
          packed: bool = False, draft_vocabulary=None, sequence_tokens: bool = True) -> DFlashDrafter:
    """A DFlash drafter for ``target`` (a ``Target``) from its checkpoint directory; ``draft_vocabulary``
    (target ids) makes it draft over those tokens only, through their rows of the target's head;
    ``sequence_tokens``: a reduced vocabulary also drafts each sequence's own tokens. ``packed`` (the fast path on a
    CPU): its layers on the kernels measured fastest here, in bf16 where that measures faster than fp32."""
    return DFlashDrafter(load_dflash_model(directory), target.model, sample_drafts=sample_drafts,
                         denoise_steps=denoise_steps, packed=packed, draft_vocabulary=draft_vocabulary,
                         sequence_tokens=sequence_tokens, draft_dtype="auto" if packed else None)
