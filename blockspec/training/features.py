"""The frozen target's context features: the drafter's input, computed once per sample and kept if asked."""

from __future__ import annotations

import torch

from blockspec.models.target import layer_features
from blockspec.training.feature_store import FeatureStore


class FeatureSource:
    """Context features of the frozen target, computed once per sample and kept if asked.

    Kept in memory, or on disk when a FeatureStore is given (then not in memory).
    ``keep_dtype``: the dtype of the kept copies (bf16 under bf16 autocast, where the drafter's
    first product rounds them to bf16 anyway: half the memory, the same training); batches
    come back in float32.
    """

    def __init__(self, target_model, layer_ids: list[int], keep: bool, keep_dtype: torch.dtype = torch.float32,
                 store: FeatureStore | None = None):
        self.model = target_model
        self.layer_ids = layer_ids
        self.keep = keep
        self.keep_dtype = keep_dtype
        self.store = store
        self.kept: dict[int, torch.Tensor] = {}

    @property
    def in_memory(self) -> bool:
        return self.keep and self.store is None

    @property
    def bytes_per_token(self) -> int:
        hidden = self.model.get_input_embeddings().weight.shape[1]
        return len(self.layer_ids) * hidden * self.keep_dtype.itemsize

    @torch.no_grad()
    def __call__(self, indices: list[int], input_ids: torch.LongTensor, lengths: torch.LongTensor) -> torch.Tensor:
        tokens = [input_ids[row, : int(lengths[row])] for row in range(len(indices))]
        found = [self._kept_features(index, ids) for index, ids in zip(indices, tokens)]
        missing = [row for row, features in enumerate(found) if features is None]
        if missing:
            computed = self.store.layer_ids if self.store is not None else self.layer_ids
            out = self.model.base_model(input_ids=input_ids[missing].to(self.model.device), output_hidden_states=True)
            features = layer_features(out.hidden_states, computed).float().cpu()
            for position, row in enumerate(missing):
                # a copy, not a view pinning the whole batch
                found[row] = features[position, : int(lengths[row])].to(self.keep_dtype).clone()
                self._keep(indices[row], tokens[row], found[row])
                if self.store is not None:
                    found[row] = self.store.select(found[row])
        width = input_ids.shape[1]
        return torch.stack([torch.nn.functional.pad(f, (0, 0, 0, width - f.shape[0])) for f in found]).float()

    def _kept_features(self, index: int, token_ids: torch.Tensor) -> torch.Tensor | None:
        if self.store is not None:
            return self.store.load(token_ids)
        return self.kept.get(index)

    def _keep(self, index: int, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        if self.store is not None:
            self.store.save(token_ids, features)
        elif self.keep:
            self.kept[index] = features
