"""The target's caches as the step uses them, and their rollback, for every kind of cache layer.

The step's one rollback is "keep these rows of the verified block, drop the rest". How a cache
layer takes a rejected tail back depends on what it stores:

- attention (full, and MLA's compressed latents, which are cached the same way): one entry per
  position; a chain's rejected tail is cropped, a tree's accepted path compacted into place;
- sliding-window attention: records its past while a block is pending (Hugging Face's
  ``activate_past_recording``), so the window the kept rows need is still there; the crop that
  drops the rejected tail trims it back to the window;
- linear attention / SSM (Gated DeltaNet, Mamba): one state per sequence, not per position. The
  state is copied before each verify and each such layer's input is recorded during it; a row
  that keeps fewer rows than the forward carried gets the copy back and the layer alone (not the
  model) replays its kept rows from the recorded input (``LinearStates``);
- KV-sharing layers (Gemma 4's consumers) store nothing.

``new_target_cache`` makes one sequence's cache ready for this; ``rewind_cache`` rolls back its
attention layers; ``BatchCache`` holds many rows in one cache with a per-row validity mask
(rejected columns are masked out per row, only columns no row keeps are cropped).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from blockspec.errors import BlockspecError

# Compact the batch cache when fewer than this share of its columns hold kept entries of the
# longest row: rebuilding costs one copy of the cache, so it only pays off when holes dominate.
_COMPACT_BELOW = 0.5

#: The cache layers whose rollback is implemented here.
ROLLBACK_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, DummyLayer)
#: Layer types of a config whose attention a tree's mask can express.
TREE_LAYER_TYPES = ("full_attention", "sliding_attention")


def new_target_cache(model) -> DynamicCache:
    """One sequence's cache for ``model``: sliding-window layers record their past until each rollback."""
    cache = DynamicCache(config=model.config)
    check_rollback(cache, model)
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer:
            layer.activate_past_recording()
    return cache


def check_rollback(cache: DynamicCache, model) -> None:
    """Refuse a target with cache layers that can be neither rolled back here nor cropped by their own class."""
    unknown = sorted({type(layer).__name__ for layer in cache.layers
                      if type(layer) not in ROLLBACK_LAYERS and not _crops_itself(layer)})
    if unknown:
        raise BlockspecError(f"{model.config.model_type} targets are not supported: their {', '.join(unknown)} cache "
                             "layers cannot be rolled back after rejected drafts")


def _crops_itself(layer) -> bool:
    """A per-position layer of another kind (an indexer's keys beside the keys) whose own crop undoes a chain."""
    return isinstance(layer, CacheLayerMixin) and getattr(layer, "is_croppable", False)


def drafting_unsupported_reason(model) -> str | None:
    """Why drafts cannot be verified losslessly on ``model`` (None: they can)."""
    cache = DynamicCache(config=model.config)
    if any(isinstance(layer, DynamicIndexedLayer) for layer in cache.layers):
        return ("its indexed sparse attention chooses the keys it reads per forward, so a verified block can "
                "differ from decoding token by token")
    return None


def tree_unsupported_reason(model) -> str | None:
    """Why one forward cannot verify a token tree on ``model`` (None: it can)."""
    cache = DynamicCache(config=model.config)
    if any(type(layer) is LinearAttentionLayer for layer in cache.layers):
        return "its linear-attention layers carry one state along one sequence, not along a tree's branches"
    others = sorted({type(layer).__name__ for layer in cache.layers if type(layer) not in ROLLBACK_LAYERS})
    if others:
        return f"its {', '.join(others)} cache layers are rolled back by their own crop, which keeps a prefix only"
    text_config = model.config.get_text_config(decoder=True)
    other = sorted(set(getattr(text_config, "layer_types", None) or []) - set(TREE_LAYER_TYPES) - {"moe", "mlp"})
    if other:
        return f"its {', '.join(other)} layers have no tree mask"
    return None


def sliding_window_of(cache: DynamicCache) -> int | None:
    """The window of the cache's sliding-window layers (None: it has none)."""
    return next((layer.sliding_window for layer in cache.layers if type(layer) is DynamicSlidingWindowLayer), None)


# ---------------------------------------------------------------------------
# One sequence's attention layers
# ---------------------------------------------------------------------------

def rewind_cache(cache: DynamicCache, past_length: int, width: int, kept_rows: list[int]) -> None:
    """Keep, of the ``width`` entries after ``past_length``, the given ones in order; drop the rest.

    A chain keeps a prefix: the cache is cropped, no copy. A tree's path is compacted into place.
    Linear-attention layers are ``LinearStates``' to rewind.
    """
    chain = kept_rows == list(range(len(kept_rows)))
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer and layer.is_initialized:
            _rewind_sliding(layer, width, kept_rows, chain)
        elif type(layer) is DynamicLayer and layer.is_initialized:
            _rewind_attention(layer, past_length, width, kept_rows, chain)
        elif type(layer) not in ROLLBACK_LAYERS:  # its own crop (only chains reach it: it has no tree mask)
            layer.crop(len(kept_rows) - width)


def _rewind_attention(layer: DynamicLayer, past_length: int, width: int, kept_rows: list[int], chain: bool) -> None:
    if chain:
        layer.crop(len(kept_rows) - width)
        return
    keep = torch.tensor(kept_rows, dtype=torch.long, device=layer.keys.device) + past_length
    layer.keys = torch.cat([layer.keys[:, :, :past_length], layer.keys.index_select(2, keep)], dim=2)
    layer.values = torch.cat([layer.values[:, :, :past_length], layer.values.index_select(2, keep)], dim=2)


def _rewind_sliding(layer: DynamicSlidingWindowLayer, width: int, kept_rows: list[int], chain: bool) -> None:
    """The kept rows stay, then the layer is trimmed back to its window (it recorded the block in full)."""
    if chain:
        layer.crop(len(kept_rows) - width)
        return
    before = layer.keys.shape[2] - width
    keep = torch.tensor(kept_rows, dtype=torch.long, device=layer.keys.device) + before
    layer.keys = torch.cat([layer.keys[:, :, :before], layer.keys.index_select(2, keep)], dim=2)
    layer.values = torch.cat([layer.values[:, :, :before], layer.values.index_select(2, keep)], dim=2)
    layer.cumulative_length -= width - len(kept_rows)
    layer.crop(0)


def trim_to_window(cache: DynamicCache) -> None:
    """After a prefill: sliding-window layers drop what their window no longer needs."""
    for layer in cache.layers:
        if type(layer) is DynamicSlidingWindowLayer and layer.is_initialized:
            layer.crop(0)


# ---------------------------------------------------------------------------
# Linear-attention (recurrent) states
# ---------------------------------------------------------------------------

def linear_mixers(model, cache: DynamicCache) -> dict[int, torch.nn.Module]:
    """The module of each linear-attention layer (by layer index): what updates its state in a forward."""
    wanted = {i for i, layer in enumerate(cache.layers) if type(layer) is LinearAttentionLayer}
    if not wanted:
        return {}
    found = {module.layer_idx: module for module in model.modules()
             if getattr(module, "layer_idx", None) in wanted and hasattr(module, "conv1d")}
    missing = sorted(wanted - found.keys())
    if missing:
        raise BlockspecError(f"{model.config.model_type} targets are not supported: the module that updates the "
                             f"linear-attention state of layer {missing[0]} was not found, so it cannot be rolled back")
    return found


class LinearStates:
    """Rollback of a target's linear-attention layers: a copy of their states before each verify and
    the inputs each such layer saw in it; a row that kept fewer rows than the forward carried gets the
    copy back, and each layer replays the row's kept rows from its recorded input.

    The replay runs the linear-attention modules only (no attention, MLP or LM head), on the kept
    rows: what their state would be had the forward carried those rows alone.
    """

    def __init__(self, model, cache: DynamicCache):
        self.mixers = linear_mixers(model, cache)
        self._saved: dict[int, tuple[dict, dict]] = {}
        self._inputs: dict[int, torch.Tensor] = {}

    @contextmanager
    def recording(self, cache: DynamicCache):
        """Around a verify forward: the states before it are copied, each linear layer's input recorded."""
        if not self.mixers:
            yield
            return
        self._saved = {index: _copy_states(cache.layers[index]) for index in self.mixers}
        hooks = [mixer.register_forward_pre_hook(partial(self._record, index), with_kwargs=True)
                 for index, mixer in self.mixers.items()]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

    def _record(self, index: int, module, args, kwargs) -> None:
        self._inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

    def rewind(self, cache: DynamicCache, kept: list[int], width: int) -> None:
        """Row r of the last verify keeps its first ``kept[r]`` rows of the ``width`` the forward carried."""
        if not self.mixers:
            return
        short = [row for row, count in enumerate(kept) if count < width]
        for count in sorted({kept[row] for row in short}):
            rows = [row for row in short if kept[row] == count]
            for index, mixer in self.mixers.items():
                self._replay(cache.layers[index], index, mixer, rows, count)
        self._saved, self._inputs = {}, {}

    def _replay(self, layer: LinearAttentionLayer, index: int, mixer, rows: list[int], count: int) -> None:
        conv, recurrent = self._saved[index]
        rows_index = torch.tensor(rows, dtype=torch.long, device=layer.device)
        view = _state_view(layer, {s: t.index_select(0, rows_index) for s, t in conv.items()},
                           {s: t.index_select(0, rows_index) for s, t in recurrent.items()})
        if count > 0:
            inputs = self._inputs[index].index_select(0, rows_index)[:, :count]
            mixer(hidden_states=inputs, cache=Cache(layers=[DummyLayer() for _ in range(index)] + [view]),
                  attention_mask=None)
        for s in conv:
            layer.conv_states[s].index_copy_(0, rows_index, view.conv_states[s])
        for s in recurrent:
            layer.recurrent_states[s].index_copy_(0, rows_index, view.recurrent_states[s])


def _copy_states(layer: LinearAttentionLayer) -> tuple[dict, dict]:
    conv = {s: t.clone() for s, t in layer.conv_states.items() if t is not None}
    recurrent = {s: t.clone() for s, t in layer.recurrent_states.items() if t is not None}
    return conv, recurrent


def _state_view(like: LinearAttentionLayer, conv: dict, recurrent: dict) -> LinearAttentionLayer:
    """A stand-alone layer holding some rows' states, as the module reads and updates them."""
    view = LinearAttentionLayer(number_of_states=like.number_of_states)
    view.device, view.dtype = like.device, like.dtype
    view.conv_kernel_size = dict(like.conv_kernel_size)
    view.has_previous_state = dict(like.has_previous_state)
    for s, state in conv.items():
        view.conv_states[s], view.is_conv_states_initialized[s] = state, True
    for s, state in recurrent.items():
        view.recurrent_states[s], view.is_recurrent_states_initialized[s] = state, True
    return view


# ---------------------------------------------------------------------------
# Many rows in one cache
# ---------------------------------------------------------------------------

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
