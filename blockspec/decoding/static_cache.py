"""A static KV cache for the target: preallocated, written at explicit columns, rolled back without a copy.

Row b's column j holds position j of sequence b, so a row's cache is its first ``lengths[b]``
columns and a forward writes its W new entries at columns ``length .. length + W - 1``.
Rejecting drafts only moves the length back (the stale columns are masked out, then
overwritten); a tree's accepted path is copied into place; rows of a batch keep their own
lengths. The attention mask is built here too: every query sees its row's kept columns and,
within the block being verified, what the block's own structure allows (a chain: the rows
before it; a tree: its ancestors).

``update`` is what Hugging Face attention layers call, so their own modules run over it.
"""

from __future__ import annotations

import torch

#: Capacities are rounded up to a power of two from here, so a compiled forward sees few shapes.
MIN_CAPACITY = 512


def capacity_for(length: int) -> int:
    """The allocated length for sequences of up to ``length`` positions (a power of two >= MIN_CAPACITY)."""
    capacity = MIN_CAPACITY
    while capacity < length:
        capacity *= 2
    return capacity


class StaticKVCache:
    """Keys and values [B, H_kv, capacity, D] per layer, and each row's kept length."""

    def __init__(self, config, batch: int, capacity: int, dtype: torch.dtype, device):
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (batch, heads, capacity, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.lengths = [0] * batch
        #: Columns [B, W] the running forward writes its entries to (set before each forward).
        self.write_columns: torch.LongTensor | None = None
        #: Columns the attention reads: the whole capacity, or fewer for a prefill run eagerly.
        self.view = capacity

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **kwargs):
        """Write this forward's keys/values [B, H, W, D] at ``write_columns``; the layer's whole (viewed) cache."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.shape[0] == 1:
            keys.index_copy_(2, self.write_columns[0], key)
            values.index_copy_(2, self.write_columns[0], value)
        else:
            rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1).expand_as(self.write_columns)
            keys[rows, :, self.write_columns] = key.transpose(1, 2)
            values[rows, :, self.write_columns] = value.transpose(1, 2)
        return keys[:, :, :self.view], values[:, :, :self.view]

    def keep(self, row: int, kept_rows: list[int]) -> None:
        """After a forward wrote a block at the row's length: keep these block rows, in order, drop the rest."""
        start = self.lengths[row]
        if kept_rows != list(range(len(kept_rows))):  # a tree's path: move it into place
            source = torch.tensor(kept_rows, device=self.keys[0].device) + start
            target = torch.arange(start, start + len(kept_rows), device=self.keys[0].device)
            for keys, values in zip(self.keys, self.values):
                keys[row, :, target] = keys[row, :, source]
                values[row, :, target] = values[row, :, source]
        self.lengths[row] = start + len(kept_rows)

    def leading(self, rows: int) -> "StaticKVCache":
        """A view of the first ``rows`` rows (sharing the buffers): what a forward over those rows writes."""
        view = StaticKVCache.__new__(StaticKVCache)
        view.keys = [keys[:rows] for keys in self.keys]
        view.values = [values[:rows] for values in self.values]
        view.lengths = self.lengths[:rows]
        view.write_columns, view.view = None, self.capacity
        return view

    def move_row(self, source: int, target: int) -> None:
        """Row ``source``'s entries and length into row ``target`` (a leaving row's slot is refilled)."""
        for keys, values in zip(self.keys, self.values):
            keys[target] = keys[source]
            values[target] = values[source]
        self.lengths[target] = self.lengths[source]

    def grown(self, capacity: int) -> "StaticKVCache":
        """A copy with room for ``capacity`` columns (every row's entries and length kept)."""
        keys = self.keys[0]
        config = _CacheShape(len(self.keys), keys.shape[1], keys.shape[3])
        bigger = StaticKVCache(config, self.batch, capacity, keys.dtype, keys.device)
        for old, new in zip(self.keys + self.values, bigger.keys + bigger.values):
            new[:, :, :self.capacity] = old
        bigger.lengths = list(self.lengths)
        return bigger


class _CacheShape:
    """The few config fields a ``StaticKVCache`` reads, for growing one without the model's config."""

    def __init__(self, layers: int, heads: int, head_dim: int):
        self.num_hidden_layers, self.num_key_value_heads, self.head_dim = layers, heads, head_dim
        self.num_attention_heads, self.hidden_size = heads, heads * head_dim


def block_visibility(width: int, parents: list[int] | None = None) -> torch.Tensor:
    """[W, W] bool: which rows of a verify block each row sees (row 0 the root, then drafts or tree nodes).

    A chain sees itself and every row before it; a tree node its ancestors, the root and itself.
    """
    if parents is None:
        return torch.ones(width, width, dtype=torch.bool).tril()
    visible = torch.eye(width, dtype=torch.bool)
    visible[:, 0] = True
    for node, parent in enumerate(parents):
        if parent >= 0:
            visible[1 + node] |= visible[1 + parent]
    return visible


def attention_mask(lengths: list[int], visibilities: list[torch.Tensor], width: int, capacity: int,
                   device) -> torch.Tensor:
    """[B, 1, width, capacity] bool: row b's queries see its kept columns and its block as ``visibilities[b]``
    allows; padding queries (past a row's block) see their own column only, so they stay finite."""
    mask = torch.zeros(len(lengths), 1, width, capacity, dtype=torch.bool)
    for row, (length, visible) in enumerate(zip(lengths, visibilities)):
        used = visible.shape[0]
        mask[row, 0, :used, :length] = True
        mask[row, 0, :used, length:length + used] = visible
        padding = torch.arange(used, width)
        mask[row, 0, padding, length + padding] = True
    return mask.to(device)
