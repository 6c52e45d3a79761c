"""Linear layers on the kernel that measures fastest on this machine, per weight shape and row count.

A decoding forward multiplies a few rows (1 for a token, 2..64 for a verify block) by every weight,
and which kernel does that fastest depends on the CPU. On a 2-core AMD EPYC (AVX2), MKL's fp32 GEMM
ran far below the machine at 2..32 rows and oneDNN, on a weight reordered once for it, about twice
as fast; on a 2-core Xeon with AVX-512 and a 480 MB L3, MKL was the faster at most shapes and
oneDNN only for the LM head at 4..8 rows. So nothing is assumed: ``plan_kernels`` times both
kernels on the model's own weights of each shape at each row bucket, once per machine (cached under
``$BLOCKSPEC_HOME/kernels``), and ``module_twin`` gives a model whose linear layers follow that plan,
sharing every other parameter with the original, which stays as it was. ``BLOCKSPEC_LINEAR_KERNEL``
(``aten`` or ``onednn``) overrides the measurement.

The oneDNN product is a registered custom op, so a ``torch.compile``d forward keeps it as one opaque
call (the packed weight is not a graph constant: compiled graphs of every width share it); the
op's dispatch is part of what is timed.
"""

from __future__ import annotations

import copy
import ctypes
import hashlib
import json
import mmap
import os
import statistics
import time
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.io import write_text_atomically
from blockspec.machine import machine_description

#: Row counts a kernel is chosen for; a product is run with the choice of the bucket its rows round up to.
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
#: "aten": ``F.linear`` on the dense weight (MKL on a CPU); "onednn": a oneDNN-packed copy of the weight.
KERNELS = ("aten", "onednn")
KERNEL_ENV = "BLOCKSPEC_LINEAR_KERNEL"
#: A cached choice older than this is measured again (drivers, BIOS and power settings change what its key cannot see).
PLAN_CACHE_MAX_AGE_S = 7 * 24 * 3600
#: The most weight bytes of one shape timed (its first layers): enough to leave the caches as a forward does.
MEASURED_BYTES = 256 * 2**20
#: oneDNN is chosen where it takes at most this fraction of MKL's time (a tie keeps the dense weight).
ONEDNN_MARGIN = 0.95
_REPEATS = 5

#: Packed weights by content key (shape and checksum): a graph compiled in one process refers to its
#: weights by a key that the next process gives the same weights, so inductor's disk cache serves both.
_PACKED: dict[str, tuple[torch.Tensor, torch.Tensor | None, int]] = {}
_USERS: dict[str, int] = {}
#: One planned copy per weight and plan (by the weight's id, dropped with it), however many twins and drafters read it.
_BY_WEIGHT: dict[tuple[int, tuple[str, ...]], "PlannedLinear"] = {}


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
    return f"{shape_key(linear)}:{checksum:08x}"


def shape_key(linear: nn.Linear) -> str:
    """``out x in`` and whether it has a bias: what a kernel's speed depends on."""
    return f"{linear.out_features}x{linear.in_features}{'+b' if linear.bias is not None else ''}"


def row_bucket(rows: int) -> int:
    """The index in ``ROW_BUCKETS`` of the bucket ``rows`` rows run with."""
    return next((i for i, bucket in enumerate(ROW_BUCKETS) if rows <= bucket), len(ROW_BUCKETS) - 1)


@dataclass(frozen=True)
class KernelPlan:
    """The kernel of each weight shape at each row bucket (``ROW_BUCKETS``), and what was timed (ms a pass)."""

    choices: dict[str, tuple[str, ...]]
    timings: dict[str, dict[str, list[float]]] | None = None

    @classmethod
    def uniform(cls, kernel: str, linears: Iterable[nn.Linear]) -> "KernelPlan":
        return cls({shape_key(linear): (kernel,) * len(ROW_BUCKETS) for linear in linears})

    def kernels(self, linear: nn.Linear) -> tuple[str, ...]:
        return self.choices.get(shape_key(linear), ("aten",) * len(ROW_BUCKETS))

    @property
    def packs_any(self) -> bool:
        return any("onednn" in kernels for kernels in self.choices.values())

    @property
    def tag(self) -> str:
        """A short name of the plan, for the names of what depends on it (the cost model's cache)."""
        used = {kernel for kernels in self.choices.values() for kernel in kernels}
        if len(used) <= 1:
            return next(iter(used), "aten")
        digest = hashlib.sha256(json.dumps(self.choices, sort_keys=True).encode()).hexdigest()[:8]
        return f"mixed-{digest}"

    def describe(self) -> str:
        """Where oneDNN runs, in words (MKL elsewhere)."""
        parts = []
        for shape, kernels in sorted(self.choices.items()):
            rows = [bucket for bucket, kernel in zip(ROW_BUCKETS, kernels) if kernel == "onednn"]
            if rows:
                parts.append(f"{shape} at {_row_ranges(rows)} rows")
        return ("oneDNN-packed for " + ", ".join(parts) + "; MKL elsewhere") if parts else "MKL (aten) throughout"


def _row_ranges(rows: list[int]) -> str:
    spans, first, last = [], rows[0], rows[0]
    for bucket in rows[1:]:
        if ROW_BUCKETS.index(bucket) == ROW_BUCKETS.index(last) + 1:
            last = bucket
        else:
            spans.append((first, last))
            first = last = bucket
    spans.append((first, last))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def kernel_override() -> str | None:
    """The kernel ``BLOCKSPEC_LINEAR_KERNEL`` forces (None: measure)."""
    value = os.environ.get(KERNEL_ENV, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in KERNELS:
        raise BlockspecError(f"{KERNEL_ENV} must be auto, {' or '.join(KERNELS)}, got {value!r}")
    return value


def plan_kernels(linears: Iterable[nn.Linear], *, cache_dir: Path | None = None,
                 progress: Callable[[str], None] | None = None) -> KernelPlan:
    """The faster kernel for each shape of ``linears`` at each row bucket: read from the cache, or timed on
    their own weights (once per machine, thread count and torch version)."""
    groups: dict[str, list[nn.Linear]] = {}
    seen: set[int] = set()
    for linear in linears:
        if id(linear.weight) not in seen:
            seen.add(id(linear.weight))
            groups.setdefault(shape_key(linear), []).append(linear)
    forced = kernel_override()
    if forced is not None:
        return KernelPlan({shape: (forced,) * len(ROW_BUCKETS) for shape in groups})
    directory = Path(cache_dir) if cache_dir is not None else _kernel_cache_dir()
    choices, timings, missing = {}, {}, []
    for shape, group in groups.items():
        saved = _read_choice(directory, shape)
        if saved is None:
            missing.append(shape)
        else:
            choices[shape], timings[shape] = saved
    if missing and progress is not None:
        progress(f"timing MKL against oneDNN for {len(missing)} weight shapes at 1..{ROW_BUCKETS[-1]} rows "
                 "(once on this machine)")
    for shape in missing:
        choices[shape], timings[shape] = _measure(groups[shape])
        _write_choice(directory, shape, choices[shape], timings[shape])
    return KernelPlan(choices, timings)


def _kernel_cache_dir() -> Path:
    from blockspec import hub

    return hub.home_dir() / "kernels"


def _choice_file(directory: Path, shape: str) -> Path:
    what = {**machine_description("cpu"), "shape": shape, "rows": ROW_BUCKETS, "kernels": KERNELS}
    return directory / f"{hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]}.json"


def _read_choice(directory: Path, shape: str, allowed: tuple[str, ...] = KERNELS, count: int = len(ROW_BUCKETS)):
    """A cached (choices, timings) of ``count`` choices among ``allowed``, None when absent, stale or broken."""
    try:
        saved = json.loads(_choice_file(directory, shape).read_text())
        choices = tuple(saved["kernels"])
        fresh = time.time() - float(saved["measured_at"]) < PLAN_CACHE_MAX_AGE_S
        if fresh and len(choices) == count and set(choices) <= set(allowed):
            return choices, saved["ms"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write_choice(directory: Path, shape: str, kernels: tuple[str, ...], timings: dict) -> None:
    record = {"kernels": list(kernels), "ms": timings, "rows": list(ROW_BUCKETS), "shape": shape,
              "measured_at": time.time(), "what": machine_description("cpu")}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        write_text_atomically(_choice_file(directory, shape), json.dumps(record))
    except OSError:  # a read-only cache only costs timing again next time
        pass


def _measure(group: list[nn.Linear]) -> tuple[tuple[str, ...], dict[str, list[float]]]:
    """Both kernels over the shape's first layers at each row bucket, interleaved: the faster one per bucket and
    the median ms of a pass."""
    layer_bytes = group[0].weight.numel() * group[0].weight.element_size()
    layers = group[:max(1, MEASURED_BYTES // layer_bytes)]
    keys = [f"timing:{index}:{shape_key(linear)}" for index, linear in enumerate(layers)]
    for key, linear in zip(keys, layers):
        bias = None if linear.bias is None else linear.bias.detach()
        _PACKED[key] = (linear.weight.detach().to_mkldnn(), bias, linear.out_features)
    kernels, timings = [], {kernel: [] for kernel in KERNELS}
    try:
        with torch.inference_mode():
            for rows in ROW_BUCKETS:
                x = torch.randn(rows, layers[0].in_features)
                runs = {"aten": lambda: [F.linear(x, linear.weight, linear.bias) for linear in layers],
                        "onednn": lambda: [packed_linear(x, key) for key in keys]}
                seconds = {kernel: [] for kernel in KERNELS}
                for repeat in range(_REPEATS + 1):  # the first pass warms up
                    for kernel in KERNELS:
                        began = time.perf_counter()
                        runs[kernel]()
                        if repeat:
                            seconds[kernel].append(time.perf_counter() - began)
                median = {kernel: statistics.median(seconds[kernel]) * 1e3 for kernel in KERNELS}
                kernels.append("onednn" if median["onednn"] <= ONEDNN_MARGIN * median["aten"] else "aten")
                for kernel in KERNELS:
                    timings[kernel].append(round(median[kernel], 4))
    finally:
        for key in keys:
            _PACKED.pop(key, None)
    return tuple(kernels), timings


#: bf16 is chosen for a drafter where its products take at most this fraction of fp32's time.
BF16_MARGIN = 0.8


def bf16_faster(linears: Iterable[nn.Linear], rows: int, *, cache_dir: Path | None = None) -> bool:
    """Whether these layers' products at ``rows`` rows run faster in bf16 than in fp32 on this machine (timed on
    their own weights, once per machine; False where oneDNN has no bf16 path). For a drafter only: its numerics
    shape its proposals, never what the target accepts."""
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    layers = list({shape_key(linear): linear for linear in linears}.values())
    if not layers:
        return False
    key = f"bf16@{rows}:" + ",".join(sorted(shape_key(linear) for linear in layers))
    directory = Path(cache_dir) if cache_dir is not None else _kernel_cache_dir()
    saved = _read_choice(directory, key, allowed=("fp32", "bf16"), count=1)
    if saved is None:
        saved = _measure_bf16(layers, rows)
        _write_choice(directory, key, *saved)
    return saved[0] == ("bf16",)


def _measure_bf16(layers: list[nn.Linear], rows: int) -> tuple[tuple[str, ...], dict[str, list[float]]]:
    halves = [(linear.weight.detach().bfloat16(), None if linear.bias is None else linear.bias.detach().bfloat16())
              for linear in layers]
    inputs = {linear.in_features: torch.randn(rows, linear.in_features) for linear in layers}
    seconds = {"fp32": [], "bf16": []}
    with torch.inference_mode():
        for repeat in range(_REPEATS + 1):
            began = time.perf_counter()
            for linear in layers:
                F.linear(inputs[linear.in_features], linear.weight, linear.bias)
            middle = time.perf_counter()
            for linear, (weight, bias) in zip(layers, halves):
                F.linear(inputs[linear.in_features].bfloat16(), weight, bias).float()
            if repeat:
                seconds["fp32"].append(middle - began)
                seconds["bf16"].append(time.perf_counter() - middle)
    median = {kind: statistics.median(times) * 1e3 for kind, times in seconds.items()}
    kind = "bf16" if median["bf16"] <= BF16_MARGIN * median["fp32"] else "fp32"
    return (kind,), {name: [round(value, 4)] for name, value in median.items()}


class PlannedLinear(nn.Module):
    """``nn.Linear`` (inference only) whose product runs on the planned kernel for its row count: the dense
    weight (aten) or a oneDNN-packed copy."""

    def __init__(self, linear: nn.Linear, kernels: tuple[str, ...]):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        if "aten" in kernels:
            self.weight, self.bias = linear.weight, linear.bias
        self.key = None
        if "onednn" in kernels:
            self.key = content_key(linear)
            if self.key not in _PACKED:
                bias = None if linear.bias is None else linear.bias.detach()
                _PACKED[self.key] = (linear.weight.detach().to_mkldnn(), bias, linear.out_features)
            _USERS[self.key] = _USERS.get(self.key, 0) + 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self.kernels[row_bucket(x.numel() // x.shape[-1])]  # a constant in a compiled graph
        if kernel == "aten":
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return packed_linear(x, self.key)
        return _packed_product(x, *_PACKED[self.key])  # eagerly: the same product without the op's dispatch

    def __del__(self):
        if self.key is None:
            return
        _USERS[self.key] = _USERS.get(self.key, 1) - 1
        if _USERS[self.key] <= 0:
            _PACKED.pop(self.key, None)
            _USERS.pop(self.key, None)


def planned(linear: nn.Linear, plan: KernelPlan) -> nn.Module:
    """``linear`` on its planned kernels (one planned copy per weight tensor and plan, shared); the layer itself
    where the plan keeps it on the dense weight throughout."""
    kernels = plan.kernels(linear)
    if "onednn" not in kernels:
        return linear
    key = (id(linear.weight), kernels)
    if key not in _BY_WEIGHT:
        _BY_WEIGHT[key] = PlannedLinear(linear, kernels)
        weakref.finalize(linear.weight, _BY_WEIGHT.pop, key, None)
        if "aten" not in kernels:
            drop_resident_copy(linear.weight)  # held once: the packed copy does the work now
    return _BY_WEIGHT[key]


def linear_layers(module: nn.Module) -> list[nn.Linear]:
    return [child for child in module.modules() if isinstance(child, nn.Linear)]


_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
               "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


def module_twin(module: nn.Module, *, plan: KernelPlan | None = None) -> nn.Module:
    """A copy of ``module``'s tree sharing every parameter, without the hooks libraries attach to the original
    (Hugging Face's output capture: they would only slow a loop that takes the outputs it needs itself, and
    break a compiled graph); with a ``plan``, its ``nn.Linear`` layers run on the planned kernels."""
    if plan is not None and isinstance(module, nn.Linear):
        twin = planned(module, plan)
        if twin is not module:
            return twin
    twin = copy.copy(module)
    for name in _HOOK_DICTS:
        if hasattr(module, name):
            setattr(twin, name, type(getattr(module, name))())
    twin._modules = {name: None if child is None else module_twin(child, plan=plan)
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
