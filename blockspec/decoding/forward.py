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

from blockspec.decoding.cache import LinearStates, new_target_cache, rewind_cache, sliding_window_of, trim_to_window
from blockspec.decoding.tree import tree_attention_mask, tree_position_ids
from blockspec.decoding.verifier import TargetScores
from blockspec.drafters.tree import Tree
from blockspec.models.target import forward_options, layer_features, position_ids


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
    """One sequence's target forwards over a ``DynamicCache`` of its own (rolled back layer by layer:
    ``blockspec.decoding.cache``)."""

    def __init__(self, model, feature_layers: list[int] | None):
        self.model = model
        self.feature_layers = feature_layers
        self.cache: DynamicCache = new_target_cache(model)
        self.linear = LinearStates(model, self.cache)
        self._window = sliding_window_of(self.cache)
        self._layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
        self._options = forward_options(model)
        self._pending: VerifyBlock | None = None

    def prefill(self, input_ids: torch.LongTensor) -> TargetOutput:
        out = self.model(input_ids=input_ids, cache=self.cache, use_cache=True, logits_to_keep=1,
                         output_hidden_states=self.feature_layers is not None, **self._options)
        trim_to_window(self.cache)
        return TargetOutput(TargetScores(out.logits[0, -1:]), self._features(out))

    def verify(self, blocks: list[VerifyBlock]) -> list[TargetOutput]:
        (block,) = blocks
        device = self.model.device
        with self.linear.recording(self.cache):
            out = self.model(input_ids=torch.tensor([block.tokens], device=device),
                             position_ids=block.position_ids(device), attention_mask=self._tree_mask(block),
                             cache=self.cache, use_cache=True, output_hidden_states=self.feature_layers is not None,
                             **self._options)
        self._pending = block
        return [TargetOutput(TargetScores(out.logits[0]), self._features(out))]

    def keep(self, kept_rows: list[list[int]]) -> None:
        (rows,) = kept_rows
        block = self._pending
        rewind_cache(self.cache, block.start, block.width, rows)
        self.linear.rewind(self.cache, [len(rows)], block.width)
        self._pending = None

    def _tree_mask(self, block: VerifyBlock):
        """None for a chain; a tree's mask, per layer type where sliding-window layers see less context."""
        dtype, device = self.model.dtype, self.model.device
        if block.tree is None or self._window is None:
            return block.attention_mask(dtype, device)
        sliding = sliding_tree_mask(block.tree, block.start, self._window, dtype, device)
        if self._layer_types is None:  # every layer slides (a window set for the whole model)
            return sliding
        full = block.attention_mask(dtype, device)
        return {kind: sliding if kind == "sliding_attention" else full for kind in set(self._layer_types)}

    def _features(self, out) -> torch.Tensor | None:
        return None if self.feature_layers is None else layer_features(out.hidden_states, self.feature_layers)


def sliding_tree_mask(tree: Tree, start: int, window: int, dtype, device) -> torch.Tensor:
    """A tree's additive mask [1, 1, 1 + n, c + 1 + n] for a sliding-window layer, which holds the
    c = min(start, window - 1) positions before the root: a node also loses what is ``window`` or
    more positions behind it."""
    context = min(start, window - 1)
    mask = tree_attention_mask(tree, context, dtype, device)
    depths = torch.tensor([0] + tree.depths)
    offsets = torch.cat([torch.arange(-context, 0), depths])
    too_far = depths.unsqueeze(1) - offsets.unsqueeze(0) >= window
    return mask.masked_fill(too_far.to(device)[None, None], torch.finfo(dtype).min)
