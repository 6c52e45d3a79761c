"""The target's side of a step: prefill a prompt, run verify blocks in one forward, keep what was accepted.

A ``VerifyTarget`` is what the step talks to. ``SequenceTarget`` is one sequence with its own
KV cache; the batch engine's target verifies many rows in one padded forward; replaying a
recorded answer uses a target that reads the answer instead of running forwards. Rollback is
one call, ``keep(kept_rows)``: for each row, the rows of its verified block that stay (a chain's
accepted prefix, or a tree's accepted path), in order; the cache drops the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from blockspec.decoding.cache import rewind_cache
from blockspec.decoding.tree import Tree, tree_attention_mask, tree_position_ids
from blockspec.decoding.verifier import TargetScores
from blockspec.models.target import layer_features, position_ids


@dataclass
class VerifyBlock:
    """What one sequence sends through a verify forward: its last token, then its drafts.

    A chain's drafts follow one another; a tree's nodes are listed parents first, each seeing
    only the context, the root and its own ancestors.
    """

    tokens: list[int]
    #: Position of the last token (the root).
    start: int
    tree: Tree | None = None

    @property
    def width(self) -> int:
        return len(self.tokens)

    def position_ids(self, device) -> torch.LongTensor:
        if self.tree is None:
            return position_ids(self.start, self.width, device)
        return tree_position_ids(self.tree, self.start, device)

    def attention_mask(self, dtype, device) -> torch.Tensor | None:
        """A tree's 4D mask over [the context; the block]; None for a chain (plain causal attention)."""
        if self.tree is None:
            return None
        return tree_attention_mask(self.tree, self.start, dtype, device)


@dataclass
class TargetOutput:
    """One row's share of a forward: the scores the verifier reads and the features its drafter reads."""

    scores: TargetScores
    #: [1, W, F]: the outputs of the layers the drafter reads, at each of the row's verified positions.
    features: torch.Tensor | None = None


class VerifyTarget(Protocol):
    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        """Put the prompt [1, P] into the cache; the scores of its last position, features of every position."""

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        """One forward over every row's block (row r of the batch is ``blocks[r]``)."""

    def keep(self, kept_rows: list[list[int]]) -> None:
        """After ``verify``: keep, per row, these rows of its block in order; drop the rest."""


class SequenceTarget:
    """One sequence's target forwards over a ``DynamicCache`` of its own."""

    def __init__(self, model, feature_layers: list[int] | None):
        self.model = model
        self.feature_layers = feature_layers
        self.cache = DynamicCache(config=model.config)
        self._pending: VerifyBlock | None = None

    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1,
                         output_hidden_states=self.feature_layers is not None)
        return TargetOutput(TargetScores(out.logits[0, -1:]), self._features(out))

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        (block,) = blocks
        device = self.model.device
        out = self.model(input_ids=torch.tensor([block.tokens], device=device),
                         position_ids=block.position_ids(device),
                         attention_mask=block.attention_mask(self.model.dtype, device),
                         cache=self.cache, use_cache=True, output_hidden_states=self.feature_layers is not None)
        self._pending = block
        return [TargetOutput(TargetScores(out.logits[0]), self._features(out))]

    def keep(self, kept_rows: list[list[int]]) -> None:
        (rows,) = kept_rows
        rewind_cache(self.cache, self._pending.start, self._pending.width, rows)
        self._pending = None

    def _features(self, out) -> torch.Tensor | None:
        return None if self.feature_layers is None else layer_features(out.hidden_states, self.feature_layers)
