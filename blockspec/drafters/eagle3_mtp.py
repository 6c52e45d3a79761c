"""EAGLE-3 and MTP behind the drafter protocol: one decoder layer run step by step.

Row i of the draft's KV cache pairs the target's feature at committed position i with the
token at i+1. ``propose`` first feeds the rows whose next token is now known (the last of
them pairs with ``last_token``) into that persistent cache, then chains: each drafted
token's embedding is paired with the previous step's own output hidden state, with
temporary cache entries that are dropped afterwards (the next proposal starts from the
target's real features again).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.drafters.base import Drafter, Proposal
from blockspec.errors import IncompatibleDraftError
from blockspec.models.recursive_head import RecursiveDraftModel
from blockspec.models.target import position_ids
from blockspec.sampling import pick_draft


@dataclass
class RecursiveState:
    """One sequence: its tokens, the draft layer's persistent cache, and the features not yet fed to it."""

    tokens: list[int]
    pending: torch.Tensor | None
    #: Keys/values of the rows already fed (row i pairs the feature at i with token i + 1).
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    fed: int = 0


class RecursiveDrafter(Drafter):
    """An EAGLE-3 or MTP draft model drafting token by token with its own KV cache."""

    def __init__(self, model: RecursiveDraftModel, target_model, *, name: str, block_size: int | None = None,
                 sample_drafts: bool = True):
        check_fits_target(model, target_model.config, draft_name=f"the {name} draft")
        param = next(target_model.parameters())
        self.name = name
        self.model = model.to(device=param.device, dtype=param.dtype).eval()
        self.model.requires_grad_(False)
        if hasattr(self.model, "attach_target"):
            self.model.attach_target(target_model)
        self.embed_tokens = target_model.get_input_embeddings()
        self.feature_layers = list(model.feature_layers)
        self.default_block_size = block_size or model.ttt_steps + 1
        self.vocab_size = target_model.config.vocab_size
        self.draft_ids = model.draft_to_target.to(param.device)
        #: At temperature > 0: sample drafts from q and use full rejection sampling (True),
        #: or draft greedily and accept with probability p(draft) (False).
        self.sample_drafts = sample_drafts
        self.device = param.device

    def start(self, prompt_ids, features) -> RecursiveState:
        return RecursiveState(prompt_ids[0].tolist(), features)

    def commit(self, state: RecursiveState, tokens, features) -> None:
        state.tokens.extend(tokens[0].tolist())
        state.pending = features if state.pending is None else torch.cat([state.pending, features], dim=1)

    @torch.inference_mode()
    def propose(self, state: RecursiveState, last_token, num_tokens, sampling, generator) -> Proposal:
        if num_tokens == 0:
            return Proposal.empty(self.device)
        hidden = self._feed_pending(state, last_token)[:, -1:]
        past, position, token = state.past, len(state.tokens) - 1, last_token
        sampled = not sampling.greedy and self.sample_drafts
        drafts, probs, confidence = [], [], []
        for step in range(num_tokens):
            if step > 0:
                hidden, new = self.model.step(self._embed([token]), hidden, position_ids(position, 1, self.device),
                                              past)
                past = _append(past, new)
            logits = self._full_vocabulary(self.model.head_logits(hidden[0, -1]).float())
            token, q, p = pick_draft(logits, sampling, generator, sampled)
            drafts.append(token)
            probs.append(q)
            confidence.append(p)
            position += 1
        tokens = torch.tensor(drafts, dtype=torch.long, device=self.device)
        if sampled:  # each q follows the draws before it: no confidence the width could use losslessly
            return Proposal(tokens, torch.stack(probs))
        return Proposal(tokens, confidence=torch.tensor(confidence))

    def _feed_pending(self, state: RecursiveState, last_token: int) -> torch.Tensor:
        """Put every row whose next token is known into the persistent cache; their output hidden states."""
        start, count = state.fed, state.pending.shape[1]
        next_tokens = (state.tokens + [last_token])[start + 1: start + count + 1]
        mask = _causal(count, start, self.device)
        hidden, new = self.model.step(self._embed(next_tokens), self.model.fuse(state.pending),
                                      position_ids(start, count, self.device), state.past, mask)
        state.past = _append(state.past, new)
        state.fed += count
        state.pending = None
        return hidden

    def _embed(self, token_ids: list[int]) -> torch.Tensor:
        return self.embed_tokens(torch.tensor([token_ids], dtype=torch.long, device=self.device))

    def _full_vocabulary(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [K] placed in the target's vocabulary [V], -inf elsewhere."""
        if draft_logits.shape[-1] == self.vocab_size:
            return draft_logits
        full = torch.full((self.vocab_size,), float("-inf"), device=draft_logits.device)
        return full.index_copy(0, self.draft_ids, draft_logits)


def _append(past, new):
    if past is None:
        return new
    return torch.cat([past[0], new[0]], dim=-2), torch.cat([past[1], new[1]], dim=-2)


def _causal(count: int, offset: int, device) -> torch.Tensor | None:
    """Mask for ``count`` new rows after ``offset`` cached ones: each sees the cache and rows up to itself."""
    if count == 1:
        return None
    rows = torch.arange(count, device=device)[:, None]
    cols = torch.arange(offset + count, device=device)[None, :]
    return cols <= rows + offset


def check_fits_target(model: RecursiveDraftModel, target_config, *, draft_name: str = "the draft") -> None:
    """Refuse an EAGLE-3 / MTP draft made for another target, naming the mismatch."""
    config = model.config
    layers = target_config.num_hidden_layers
    if config.vocab_size != target_config.vocab_size:
        raise IncompatibleDraftError(f"{draft_name} has vocabulary {config.vocab_size} but the target has "
                                     f"{target_config.vocab_size}: use a draft trained for this target")
    if config.hidden_size != target_config.hidden_size:
        raise IncompatibleDraftError(f"{draft_name} has hidden size {config.hidden_size} but the target has "
                                     f"{target_config.hidden_size}: use a draft trained for this target")
    declared = getattr(config, "num_target_layers", None)
    if declared is not None and declared != layers:
        raise IncompatibleDraftError(f"{draft_name} was made for a target of {declared} layers but the target has "
                                     f"{layers}: use a draft trained for this target")
    if any(not 0 <= i < layers for i in model.feature_layers):
        raise IncompatibleDraftError(f"{draft_name} reads target layers {model.feature_layers} "
                                     f"(output-of-layer indices), outside the target's 0..{layers - 1}")


def build_eagle3(directory, target, *, block_size: int | None = None, sample_drafts: bool = True) -> RecursiveDrafter:
    """An EAGLE-3 drafter for ``target`` (a ``Target``) from its checkpoint directory."""
    from blockspec.models.eagle3 import load_eagle3_model

    return RecursiveDrafter(load_eagle3_model(directory), target.model, name="eagle3", block_size=block_size,
                            sample_drafts=sample_drafts)


def build_mtp(directory, target, *, block_size: int | None = None, sample_drafts: bool = True) -> RecursiveDrafter:
    """An MTP drafter for ``target`` (a ``Target``) from its checkpoint directory."""
    from blockspec.models.mtp import load_mtp_model

    return RecursiveDrafter(load_mtp_model(directory), target.model, name="mtp", block_size=block_size,
                            sample_drafts=sample_drafts)
