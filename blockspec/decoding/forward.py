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

from blockspec.decoding.block import VerifyBlock, sequence_mask
from blockspec.decoding.cache import new_target_cache, rewind_cache, sliding_window_of, trim_to_window
from blockspec.decoding.linear_states import LinearStates
from blockspec.decoding.verifier import TargetScores
from blockspec.models.target import forward_options, layer_features


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
                             position_ids=block.position_ids(device), attention_mask=self._mask(block),
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

    def _mask(self, block: VerifyBlock):
        return sequence_mask(block, self._layer_types, self._window, self.model.dtype, self.model.device)

    def _features(self, out) -> torch.Tensor | None:
        return None if self.feature_layers is None else layer_features(out.hidden_states, self.feature_layers)
