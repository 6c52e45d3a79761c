"""The target's KV caches as the step uses them, and their rollback.

The step's one rollback is "keep these rows of the verified block, drop the rest":
``rewind_cache`` for one sequence's ``DynamicCache`` (a chain's prefix is a crop, a tree's
path is compacted into place), ``BatchCache`` for many rows sharing one cache (rejected
columns are masked out per row, and only columns no row keeps are cropped).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

# Compact the batch cache when fewer than this share of its columns hold kept entries of the
# longest row: rebuilding costs one copy of the cache, so it only pays off when holes dominate.
_COMPACT_BELOW = 0.5


def rewind_cache(cache: DynamicCache, past_length: int, width: int, kept_rows: list[int]) -> None:
    """Keep, of the ``width`` entries after ``past_length``, the given ones in order; drop the rest.

    A chain keeps a prefix: the cache is cropped, no copy. A tree's path is compacted into place.
    """
    if kept_rows == list(range(len(kept_rows))):
        cache.crop(len(kept_rows) - width)
        return
    index = torch.tensor(kept_rows, dtype=torch.long)
    for layer in cache.layers:
        keep = index.to(layer.keys.device) + past_length
        layer.keys = torch.cat([layer.keys[:, :, :past_length], layer.keys.index_select(2, keep)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :past_length], layer.values.index_select(2, keep)], dim=2)


class BatchCache:
    """The target's KV cache for all rows, with a per-row validity mask over its columns."""

    def __init__(self, model_config):
        self.model_config = model_config
        self.kv: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

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
