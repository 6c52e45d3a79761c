"""Many rows in one target cache: a per-row validity mask over shared columns, compacted when holes dominate."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from blockspec.decoding.cache import ROLLBACK_LAYERS
from blockspec.errors import BlockspecError

# Compact the batch cache when fewer than this share of its columns hold kept entries of the
# longest row: rebuilding costs one copy of the cache, so it only pays off when holes dominate.
_COMPACT_BELOW = 0.5

#: Layer types of a config that a batch's masks express (the rest hold no keys).
BATCH_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "moe", "mlp")


def check_batchable(model) -> None:
    """Refuse, in one line, a target whose cache layers or attention kinds a batch cannot hold."""
    cache = DynamicCache(config=model.config)
    others = {type(layer).__name__ for layer in cache.layers if type(layer) not in ROLLBACK_LAYERS}
    layer_types = getattr(model.config.get_text_config(decoder=True), "layer_types", None) or []
    others |= set(layer_types) - set(BATCH_LAYER_TYPES)
    if others:
        raise BlockspecError(f"batched decoding cannot hold this target's {', '.join(sorted(others))} layers: "
                             "decode it one sequence at a time with speculative_generate")


class BatchCache:
    """The target's cache for all rows, with a per-row validity mask and position over its columns.

    Attention layers share the columns; a sliding-window layer keeps every column too (rows' holes
    differ, so "the last window of columns" is no row's window) and its mask follows the positions.
    Linear-attention layers hold one state per row and no columns.
    """

    def __init__(self, model_config):
        self.model_config = model_config
        self.kv: DynamicCache | None = None
        self.valid = torch.zeros(0, 0, dtype=torch.bool)
        self.positions = torch.zeros(0, 0, dtype=torch.long)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    @property
    def attention_layers(self) -> list[DynamicLayer]:
        return [layer for layer in self.kv.layers if type(layer) is DynamicLayer and layer.is_initialized]

    @property
    def linear_layers(self) -> list[LinearAttentionLayer]:
        return [layer for layer in self.kv.layers if type(layer) is LinearAttentionLayer]

    def append_row(self, row_cache: DynamicCache, prompt_length: int) -> None:
        """Splice a row prefilled on its own into the batch (both left-padded to a common length)."""
        _unwindow(row_cache)
        device = _device_of(row_cache)
        row_valid = torch.ones(1, prompt_length, dtype=torch.bool, device=device)
        row_positions = torch.arange(prompt_length, device=device).unsqueeze(0)
        if self.kv is None or self.valid.shape[0] == 0:
            self.kv, self.valid, self.positions = row_cache, row_valid, row_positions
            return
        length = max(self.length, prompt_length)
        self._left_pad(length - self.length)
        for mine, theirs in zip(self.kv.layers, row_cache.layers):
            if type(mine) is DynamicLayer and mine.is_initialized:
                mine.keys = torch.cat([mine.keys, _left_pad(theirs.keys, length - prompt_length)], dim=0)
                mine.values = torch.cat([mine.values, _left_pad(theirs.values, length - prompt_length)], dim=0)
            elif type(mine) is LinearAttentionLayer:
                _concat_states(mine, theirs)
        pad = length - prompt_length
        self.valid = torch.cat([self.valid, torch.nn.functional.pad(row_valid.to(self.valid.device), (pad, 0))])
        self.positions = torch.cat([self.positions,
                                    torch.nn.functional.pad(row_positions.to(self.positions.device), (pad, 0))])

    def keep_rows(self, indices: list[int]) -> None:
        if not indices:
            self.kv, self.valid, self.positions = None, self.valid[:0, :0], self.positions[:0, :0]
            return
        index = torch.tensor(indices, dtype=torch.long, device=self.valid.device)
        for layer in self.attention_layers:
            layer.keys = layer.keys.index_select(0, index.to(layer.keys.device))
            layer.values = layer.values.index_select(0, index.to(layer.values.device))
        for layer in self.linear_layers:
            _select_states(layer, index.to(layer.device))
        self.valid = self.valid.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.compact_if_sparse()

    def settle(self, block_valid: torch.Tensor, block_positions: torch.Tensor) -> None:
        """After a forward appended W columns: keep what each row accepted, crop what no row keeps."""
        self.valid = torch.cat([self.valid, block_valid], dim=1)
        self.positions = torch.cat([self.positions, block_positions.to(self.positions.device)], dim=1)
        used = self.valid.any(dim=0).nonzero()
        last_used = int(used.max()) + 1 if used.numel() else 0
        if last_used < self.length:
            for layer in self.attention_layers:
                layer.crop(last_used - self.length)
            self.valid = self.valid[:, :last_used]
            self.positions = self.positions[:, :last_used]
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
        for layer in self.attention_layers:
            gather = index.to(layer.keys.device)[:, None, :, None]
            layer.keys = layer.keys.gather(2, gather.expand(*layer.keys.shape[:2], length, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, gather.expand(*layer.values.shape[:2], length,
                                                                layer.values.shape[3]))
        self.positions = self.positions.gather(1, index)
        self.valid = new_valid

    def _left_pad(self, columns: int) -> None:
        if columns <= 0:
            return
        for layer in self.attention_layers:
            layer.keys = _left_pad(layer.keys, columns)
            layer.values = _left_pad(layer.values, columns)
        self.valid = torch.nn.functional.pad(self.valid, (columns, 0))
        self.positions = torch.nn.functional.pad(self.positions, (columns, 0))


def _unwindow(cache: DynamicCache) -> None:
    """Sliding-window layers (which recorded the whole prompt) become plain layers holding every column."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            plain = DynamicLayer()
            plain.lazy_initialization(layer.keys, layer.values)
            plain.keys, plain.values = layer.keys, layer.values
            cache.layers[i] = plain


def _concat_states(mine: LinearAttentionLayer, theirs: LinearAttentionLayer) -> None:
    for states in ("conv_states", "recurrent_states"):
        ours, new = getattr(mine, states), getattr(theirs, states)
        for s, state in ours.items():
            if state is not None:
                ours[s] = torch.cat([state, new[s]], dim=0)


def _select_states(layer: LinearAttentionLayer, index: torch.Tensor) -> None:
    for states in (layer.conv_states, layer.recurrent_states):
        for s, state in states.items():
            if state is not None:
                states[s] = state.index_select(0, index)


def _left_pad(states: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, L, d] with ``columns`` zero columns before L."""
    if columns <= 0:
        return states
    return torch.nn.functional.pad(states, (0, 0, columns, 0))


def _device_of(cache: DynamicCache) -> torch.device:
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            return layer.keys.device
        if type(layer) is LinearAttentionLayer and layer.device is not None:
            return layer.device
    return torch.device("cpu")
