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
attention layers; ``linear_states.LinearStates`` its recurrent ones; ``batch_cache.BatchCache``
holds many rows in one cache with a per-row validity mask (rejected columns are masked out per
row, only columns no row keeps are cropped).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    CacheLayerMixin,
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionLayer,
)

from blockspec.errors import BlockspecError

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
