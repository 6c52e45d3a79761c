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
import ctypes
import mmap
import weakref
import zlib
from pathlib import Path

import torch
from torch import nn

#: Packed weights by content key (shape and checksum): a graph compiled in one process refers to its
#: weights by a key that the next process gives the same weights, so inductor's disk cache serves both.
_PACKED: dict[str, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
_USERS: dict[str, int] = {}
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
def packed_linear(x: torch.Tensor, key: str) -> torch.Tensor:
    return _packed_product(x, *_PACKED[key])


@packed_linear.register_fake
def _packed_linear_shape(x: torch.Tensor, key: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PACKED[key][2])


def content_key(linear: nn.Linear) -> str:
    """Shape and CRC-32 of a linear layer's weight and bias: equal keys hold equal values."""
    checksum = 0
    for tensor in (linear.weight, linear.bias):
        if tensor is not None:
            checksum = zlib.crc32(tensor.detach().contiguous().view(torch.uint8).numpy().data, checksum)
    return f"{linear.out_features}x{linear.in_features}{'+b' if linear.bias is not None else ''}:{checksum:08x}"


class PackedLinear(nn.Module):
    """``nn.Linear`` over a oneDNN-packed copy of its weight (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.key = content_key(linear)
        if self.key not in _PACKED:
            bias = None if linear.bias is None else linear.bias.detach()
            _PACKED[self.key] = (linear.weight.detach().to_mkldnn(), bias, linear.out_features)
        _USERS[self.key] = _USERS.get(self.key, 0) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return packed_linear(x, self.key)
        return _packed_product(x, *_PACKED[self.key])  # eagerly: the same product without the op's dispatch

    def __del__(self):
        _USERS[self.key] = _USERS.get(self.key, 1) - 1
        if _USERS[self.key] <= 0:
            _PACKED.pop(self.key, None)
            _USERS.pop(self.key, None)


def pack(linear: nn.Linear) -> PackedLinear:
    """The packed twin of ``linear`` (one per weight tensor, shared)."""
    key = id(linear.weight)
    if key not in _BY_WEIGHT:
        _BY_WEIGHT[key] = PackedLinear(linear)
        weakref.finalize(linear.weight, _BY_WEIGHT.pop, key, None)
        drop_resident_copy(linear.weight)  # held once: the packed copy does the work now
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


def drop_resident_copy(tensor: torch.Tensor) -> int:
    """Let the system drop the pages of ``tensor`` if they are a file's (a safetensors weight mapped from disk):
    its packed twin does the work now, and a later read of the dense weight only reads the file again, so
    its values never change. Anonymous memory is left alone. Bytes dropped."""
    start, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + size) // page * page
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or last <= first or not _file_backed(first, last):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        dropped = libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) == 0
    except (OSError, AttributeError):
        return 0
    return last - first if dropped else 0


_MADV_DONTNEED = 4


def _file_backed(first: int, last: int) -> bool:
    """Whether [first, last) lies inside one private mapping of a regular file and every resident page of it
    is still the file's (never written: /proc/self/pagemap's file-page bit), so dropping it loses nothing."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return False
    mapping = next((line.split(maxsplit=5) for line in lines
                    if _inside(line.split(maxsplit=1)[0], first, last)), None)
    if mapping is None or len(mapping) < 6 or not mapping[5].startswith("/") or mapping[1][3] != "p":
        return False
    page = mmap.PAGESIZE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first // page * 8)
            entries = pagemap.read((last - first) // page * 8)
    except OSError:
        return False
    for offset in range(0, len(entries), 8):
        entry = int.from_bytes(entries[offset:offset + 8], "little")
        if entry >> 63 & 1 and not entry >> 61 & 1:  # resident but anonymous: written since it was mapped
            return False
    return True


def _inside(bounds: str, first: int, last: int) -> bool:
    low, high = (int(bound, 16) for bound in bounds.split("-"))
    return low <= first and last <= high
