"""Weight-only int8 and int4 linear layers on the CPU: a quarter and about a sixth of fp32's bytes a token.

The weights are quantized in blocks of 32 input features with an fp16 scale each, by the ``gguf``
package's reference quantizers, so the numbers are llama.cpp's: int8 is GGUF's Q8_0 (w = q * d),
int4 its Q4_1 (w = q * d + m, q in 0..15). The product runs in ``kernels/weight_only.cpp``
(AVX2 + FMA + F16C, built once per machine with ``torch.utils.cpp_extension`` and cached under
``$BLOCKSPEC_HOME/kernels``): activations and sums stay fp32, every output accumulates its inputs
in order in one FMA chain, so a row's result does not depend on the other rows of the block, bit
for bit. A verify forward of many tokens and single-token forwards compute the same products, and
speculative decoding of the quantized target equals that target's own greedy decoding.

PyTorch's own int8 / int4 weight-only products (what torchao's CPU layouts call) ran 5-50x slower
than fp32 at decoding's 1-16 rows on an AVX2 CPU (benchmarks/README.md), hence a kernel of our own.
"""

from __future__ import annotations

import hashlib
import os
import platform
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

from blockspec import hub
from blockspec.errors import BlockspecError

#: Output features a panel and a group, input features a block (the kernel's constants).
PANEL = 16
GROUP = 64
BLOCK = 32
#: --quantize mode -> weight bits.
BITS = {"int8": 8, "int4": 4}
_SOURCE = Path(__file__).with_name("kernels") / "weight_only.cpp"
_FLAGS = ["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "--param=sra-max-scalarization-size-Ospeed=4096"]


def kernel_unavailable() -> str | None:
    """Why the weight-only kernel cannot run here (None when it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"its kernel is written for x86-64 CPUs with AVX2; this machine is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512", "AVX512_BF16", "AMX"):
        return "its kernel needs a CPU with AVX2, FMA and F16C"
    return None


@contextmanager
def _ninja_on_path():
    import ninja  # the pip package: torch's extension builder runs the `ninja` program

    previous = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + previous
    try:
        yield
    finally:
        os.environ["PATH"] = previous


def kernel_isa() -> str:
    """The vector extension the kernel is built for here: "avx512" where the CPU has it, else "avx2"
    (``BLOCKSPEC_WEIGHT_ONLY_ISA=avx2`` forces AVX2). Both give the same bits."""
    forced = os.environ.get("BLOCKSPEC_WEIGHT_ONLY_ISA")
    if forced is not None:
        if forced not in ("avx2", "avx512"):
            raise BlockspecError(f"BLOCKSPEC_WEIGHT_ONLY_ISA must be avx2 or avx512, got {forced!r}")
        return forced
    return "avx512" if torch.backends.cpu.get_cpu_capability() in ("AVX512", "AVX512_BF16", "AMX") else "avx2"


def _flags() -> list[str]:
    return _FLAGS + (["-mavx512f", "-DBLOCKSPEC_AVX512"] if kernel_isa() == "avx512" else [])


def kernel_build() -> str:
    """The kernel build's name: its source, flags and torch version (a new one is built, and its costs measured
    again, when any of them changes)."""
    text = _SOURCE.read_bytes() + " ".join(_flags()).encode() + torch.__version__.encode()
    return f"weight_only-{hashlib.sha256(text).hexdigest()[:16]}"


@cache
def load_kernel() -> None:
    """Build (once per machine, source and vector extension) and load the ``blockspec_kernels`` op library, with
    its output shape for compiled graphs."""
    reason = kernel_unavailable()
    if reason:
        raise BlockspecError(f"weight-only int8/int4: {reason}")
    from torch.utils import cpp_extension

    flags = _flags()
    build = hub.home_dir() / "kernels" / kernel_build()
    build.mkdir(parents=True, exist_ok=True)
    try:
        with _ninja_on_path():
            cpp_extension.load(name="blockspec_kernels", sources=[str(_SOURCE)], extra_cflags=flags,
                               build_directory=str(build), is_python_module=False, verbose=False)
    except (RuntimeError, OSError, ImportError) as error:
        raise BlockspecError(f"weight-only int8/int4: could not build its CPU kernel ({error}); it needs g++ "
                             "and the Python headers") from error

    @torch.library.register_fake("blockspec_kernels::weight_only_linear")
    def _shape(x, q, scale, low, bits, out_features):
        return x.new_empty(*x.shape[:-1], out_features)


def _quantize(weight: np.ndarray, bits: int) -> np.ndarray:
    """llama.cpp's Q8_0 / Q4_1 rows of ``weight`` [N, K], as a GGUF file stores them (uint8 [N, bytes])."""
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(weight, GGMLQuantizationType.Q8_0 if bits == 8 else GGMLQuantizationType.Q4_1)


def exact_blocks(linear: nn.Linear, bits: int) -> np.ndarray | None:
    """``bits``' rows of ``linear``'s weight when they give it back bit for bit (None otherwise): a checkpoint
    dequantized from a GGUF file (the embedded default is its Q4_1 file) has its weights on that file's grid,
    and quantizing them again to the same format finds the file's own blocks."""
    from gguf import GGMLQuantizationType, quants

    if linear.in_features % BLOCK:
        return None
    weight = linear.weight.detach().float().cpu().numpy()
    raw = _quantize(weight, bits)
    kind = GGMLQuantizationType.Q8_0 if bits == 8 else GGMLQuantizationType.Q4_1
    return raw if np.array_equal(quants.dequantize(raw, kind), weight) else None


def split_blocks(raw: np.ndarray, bits: int, in_features: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Raw GGUF Q8_0 / Q4_1 rows (uint8 [N, bytes]) as (q [N, K], d [N, K/32] fp16, m [N, K/32] fp16 or None)."""
    rows, blocks = raw.shape[0], in_features // BLOCK
    if bits == 8:
        cells = raw.reshape(rows, blocks, 2 + BLOCK)
        scale = cells[..., :2].copy().view(np.float16)[..., 0]
        return cells[..., 2:].copy().view(np.int8).reshape(rows, in_features), scale, None
    cells = raw.reshape(rows, blocks, 4 + BLOCK // 2)
    scale = cells[..., :2].copy().view(np.float16)[..., 0]
    low = cells[..., 2:4].copy().view(np.float16)[..., 0]
    nibbles = cells[..., 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # element j low nibble, j + 16 high
    return q.reshape(rows, in_features), scale, low


def to_panels(q: np.ndarray, scale: np.ndarray, low: np.ndarray | None, bits: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks in the kernel's layout: groups of 64 outputs, k-major. q [groups, K, 64] int8 or [groups, K, 32] uint8
    (int4: each panel of 16 outputs packs output c and c + 8 into byte c), scale/low [groups, K/32, 64] fp16."""
    rows = q.shape[0]
    padded = -(-rows // GROUP) * GROUP

    def groups(a: np.ndarray) -> np.ndarray:  # [N, X] -> [N/64, X, 64], zero rows padding N
        if padded > rows:
            a = np.concatenate([a, np.zeros((padded - rows, *a.shape[1:]), a.dtype)])
        return np.ascontiguousarray(a.reshape(padded // GROUP, GROUP, a.shape[1]).transpose(0, 2, 1))

    packed = groups(q)
    if bits == 4:
        panels = packed.reshape(*packed.shape[:2], GROUP // PANEL, PANEL)
        packed = np.ascontiguousarray(panels[..., :8] | (panels[..., 8:] << 4)).astype(np.uint8)
        packed = packed.reshape(*panels.shape[:2], GROUP // 2)
    low_t = torch.from_numpy(groups(low)) if low is not None else torch.empty(0, dtype=torch.float16)
    return torch.from_numpy(packed), torch.from_numpy(groups(scale)), low_t


class WeightOnlyLinear(nn.Module):
    """``nn.Linear`` with int8 or int4 weights (llama.cpp's Q8_0 / Q4_1 blocks); fp32 activations (inference only).

    ``weight`` gives the dequantized weight, for code that reads a layer's rows (a drafter copying rows of the
    target's LM head)."""

    def __init__(self, linear: nn.Linear, bits: int, raw: np.ndarray | None = None):
        """``raw``: the layer's rows already quantized (``exact_blocks``'), else they are quantized here."""
        super().__init__()
        if linear.in_features % BLOCK:
            raise BlockspecError(f"--quantize int{bits}: a linear layer has {linear.in_features} input features, "
                                 f"not a multiple of {BLOCK}; quantize in blocks of {BLOCK} needs one")
        load_kernel()
        self.in_features, self.out_features, self.bits = linear.in_features, linear.out_features, bits
        if raw is None:
            raw = _quantize(linear.weight.detach().float().cpu().numpy(), bits)
        self._set_blocks(*split_blocks(raw, bits, self.in_features))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    @classmethod
    def from_blocks(cls, raw: np.ndarray, bits: int, in_features: int, bias: torch.Tensor | None = None
                    ) -> "WeightOnlyLinear":
        """A layer on raw GGUF Q8_0 / Q4_1 rows as a GGUF file stores them, without requantizing."""
        load_kernel()
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features, layer.bits = in_features, raw.shape[0], bits
        layer._set_blocks(*split_blocks(raw, bits, in_features))
        layer.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)
        return layer

    def _set_blocks(self, q: np.ndarray, scale: np.ndarray, low: np.ndarray | None) -> None:
        packed, scales, lows = to_panels(q, scale, low, self.bits)
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        self.register_buffer("lows", lows, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        q = self.packed
        if self.bits == 4:
            panels = q.reshape(*q.shape[:2], GROUP // PANEL, PANEL // 2)
            q = torch.cat([panels & 0x0F, panels >> 4], dim=-1).reshape(*q.shape[:2], GROUP)
        values = q.float() * self.scales.float().repeat_interleave(BLOCK, dim=1)
        if self.bits == 4:
            values = values + self.lows.float().repeat_interleave(BLOCK, dim=1)
        return values.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.blockspec_kernels.weight_only_linear(x, self.packed, self.scales, self.lows, self.bits,
                                                              self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"bias={self.bias is not None}")
