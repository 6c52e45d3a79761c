"""A static KV cache for the target: preallocated, written at explicit columns, rolled back without a copy.

Row b's column j holds position j of sequence b, so a row's cache is its first ``lengths[b]``
columns and a forward writes its W new entries at columns ``length .. length + W - 1``.
Rejecting drafts only moves the length back (the stale columns are masked out, then
overwritten); a tree's accepted path is copied into place; rows of a batch keep their own
lengths (the attention mask over them: ``blockspec.decoding.block.static_mask``).

``update`` is what Hugging Face attention layers call, so their own modules run over it; their
attention then runs through ``static_cache_attention``, which reads only the columns the mask
covers (the rows' kept lengths plus the block, not the whole capacity) and lets SDPA share each
key/value head among its query heads instead of copying it per head (``repeat_kv``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

#: The name the fast path's attention is registered under in transformers' ``AttentionInterface``.
STATIC_ATTENTION = "blockspec_static_cache"

#: Capacities are rounded up to a power of two from here, so a compiled forward sees few shapes.
MIN_CAPACITY = 512


def capacity_for(length: int) -> int:
    """The allocated length for sequences of up to ``length`` positions (a power of two >= MIN_CAPACITY)."""
    capacity = MIN_CAPACITY
    while capacity < length:
        capacity *= 2
    return capacity


def kv_slot_bytes(config, dtype: torch.dtype) -> int:
    """Bytes one token slot of one row takes in a ``StaticKVCache`` of a model with ``config``: its keys and
    values in every layer."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty(0, dtype=dtype).element_size()


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

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **kwargs):
        """Write this forward's keys/values [B, H, W, D] at ``write_columns``; the layer's whole cache."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys.shape[0] == 1:
            keys.index_copy_(2, self.write_columns[0], key)
            values.index_copy_(2, self.write_columns[0], value)
        else:
            rows = torch.arange(keys.shape[0], device=keys.device).unsqueeze(1).expand_as(self.write_columns)
            keys[rows, :, self.write_columns] = key.transpose(1, 2)
            values[rows, :, self.write_columns] = value.transpose(1, 2)
        return keys, values

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
        view.write_columns = None
        return view

    def move_row(self, source: int, target: int) -> None:
        """Row ``source``'s entries and length into row ``target`` (a leaving row's slot is refilled)."""
        for keys, values in zip(self.keys, self.values):
            keys[target] = keys[source]
            values[target] = values[source]
        self.lengths[target] = self.lengths[source]

    def resized(self, capacity: int, batch: int | None = None) -> "StaticKVCache":
        """A copy with room for ``capacity`` columns (at least every row's length) and ``batch`` rows (default:
        as many as now), the leading rows' entries and lengths kept."""
        batch = self.batch if batch is None else batch
        if capacity < max(self.lengths, default=0):
            raise ValueError(f"a cache of {capacity} columns cannot hold rows of {max(self.lengths)} positions")
        keys = self.keys[0]
        config = _CacheShape(len(self.keys), keys.shape[1], keys.shape[3])
        copy = StaticKVCache(config, batch, capacity, keys.dtype, keys.device)
        kept, rows = min(capacity, self.capacity), min(batch, self.batch)
        for old, new in zip(self.keys + self.values, copy.keys + copy.values):
            new[:rows, :, :kept] = old[:rows, :, :kept]
        copy.lengths = list(self.lengths[:rows]) + [0] * (batch - rows)
        return copy


class _CacheShape:
    """The few config fields a ``StaticKVCache`` reads, for growing one without the model's config."""

    def __init__(self, layers: int, heads: int, head_dim: int):
        self.num_hidden_layers, self.num_key_value_heads, self.head_dim = layers, heads, head_dim
        self.num_attention_heads, self.hidden_size = heads, heads * head_dim


def static_cache_attention(module, query, key, value, attention_mask, *, scaling=None, dropout=0.0, **kwargs):
    """Attention over a ``StaticKVCache``: only the first ``attention_mask.shape[-1]`` columns are read, and SDPA
    shares each key/value head among its query heads. Returns [B, W, H, D] and no weights, as HF's functions do."""
    columns = attention_mask.shape[-1]
    key, value = key[:, :, :columns], value[:, :, :columns]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(STATIC_ATTENTION, static_cache_attention)


def attend_through_static_cache(network) -> None:
    """Make ``network``'s attention layers (a twin's copies, which share the original's config) use
    ``static_cache_attention``: each gets a copy of the config naming it, so the original model is untouched."""
    config = copy.copy(network.config)
    config._attn_implementation_internal = STATIC_ATTENTION
    for layer in network.model.layers:
        layer.self_attn.config = config
