"""Rollback of linear-attention (recurrent) layers: their states copied before a verify, kept rows replayed."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DummyLayer, LinearAttentionLayer

from blockspec.errors import BlockspecError


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
