"""Linear layers with weights prepacked for oneDNN: the CPU's fast path for the few-row products of decoding.

MKL's fp32 GEMM leaves its matrix-vector path at two rows and runs far below the machine for
2..32 rows, exactly the widths a verify forward has; oneDNN with a weight reordered once for
it runs the same products about twice as fast (SmolLM2-135M on 2 cores: a whole forward of
16 tokens 83 -> 47 ms). ``module_twin`` gives a model whose linear layers use such weights,
sharing every other parameter with the original, which stays as it was.

The product is a registered custom op, so a ``torch.compile``d forward keeps it as one opaque
call (the packed weight is not a graph constant: compiled graphs of every width share it).
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch
from torch import nn

_PACKED: dict[int, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
_KEYS = itertools.count()
#: One packed copy per weight (by the weight's id, dropped with it), however many twins and drafters read it.
_BY_WEIGHT: dict[int, "PackedLinear"] = {}


def packing_available(model) -> bool:
    """oneDNN prepacking applies to fp32 models on a CPU with oneDNN."""
    parameter = next(model.parameters())
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _packed_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_features: int):
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("blockspec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, key: int) -> torch.Tensor:
    return _packed_product(x, *_PACKED[key])


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PACKED[key][2])


class PackedLinear(nn.Module):
    """``nn.Linear`` over a oneDNN-packed copy of its weight (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.key = next(_KEYS)
        bias = None if linear.bias is None else linear.bias.detach()
        _PACKED[self.key] = (linear.weight.detach().to_mkldnn(), bias, linear.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.key)
        return _packed_product(x, *_PACKED[self.key])  # eagerly: the same product without the op's dispatch

    def __del__(self):
        _PACKED.pop(self.key, None)


def pack(linear: nn.Linear) -> PackedLinear:
    """The packed twin of ``linear`` (one per weight tensor, shared)."""
    key = id(linear.weight)
    if key not in _BY_WEIGHT:
        _BY_WEIGHT[key] = PackedLinear(linear)
        weakref.finalize(linear.weight, _BY_WEIGHT.pop, key, None)
    return _BY_WEIGHT[key]


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def module_twin(module: nn.Module, *, pack_linears: bool) -> nn.Module:
    """A copy of ``module``'s tree sharing every parameter, without the hooks libraries attach to the original
    (Hugging Face's output capture: they would only slow a loop that takes the outputs it needs itself, and
    break a compiled graph); with ``pack_linears``, its ``nn.Linear`` layers become ``PackedLinear``."""
    if pack_linears and isinstance(module, nn.Linear):
        return pack(module)
    twin = copy.copy(module)
    for name in _HOOK_DICTS:
        if hasattr(module, name):
            setattr(twin, name, type(getattr(module, name))())
    twin._modules = {name: None if child is None else module_twin(child, pack_linears=pack_linears)
                     for name, child in module._modules.items()}
    return twin
