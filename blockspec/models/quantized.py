"""Fewer bytes a token on a CPU: the target's linear layers on fp16, int8 or int4 weights.

A decoding forward of a small model is bound by memory bandwidth: every token streams every
weight. ``quantize_target(model, mode)`` replaces each linear layer of the decoder and the LM head:

- "fp16": an ``Fp16Linear``, the weight rounded to fp16 and prepacked once for FBGEMM (PyTorch's
  x86 GEMM library), which converts it back to fp32 in registers. Half of fp32's bytes.
- "int8" / "int4": a ``WeightOnlyLinear`` (``models.weight_only``), llama.cpp's Q8_0 / Q4_1 blocks
  (8.5 / 5 bits a weight) on a kernel of this package. A quarter / about a sixth of fp32's bytes.
  Under "int8" a layer whose weights Q4_1 holds exactly keeps them in Q4_1: the same weights in
  fewer bytes. A checkpoint dequantized from a GGUF file has its weights on that file's grid, so its
  int8 target is the file's own blocks: the embedded default (a Q4_1 file with a Q8_0 head) runs
  its 210 Q4_1 layers and its Q8_0 head, the very weights of the fp32 checkpoint.

In every mode activations and sums stay fp32, the product is a continuous function of its input,
and a row's output does not depend on the other rows of the block (bit for bit), so speculative
decoding of the quantized target is lossless exactly as of the fp32 one: equal to that quantized
target's own greedy decoding.

Measured and left out (``benchmarks/quantized_target.py`` times the kernels side by side): PyTorch's
int8 and int4 weight-only products (which torchao's CPU layouts call) ran 5-50x slower than fp32 at
decoding's 1-16 rows on an AVX2 CPU; FBGEMM's int8 product with per-token int8 activations is fast
but rounds activations, a discontinuous step that turned the kernels' ~1e-6 float noise between a
verify forward and single-token forwards into logit differences of 2-4 and parted the speculative
output from the int8 target's own greedy output on 4 of 4 demo prompts.

The fp16 product runs inside one registered op, so eager (prefill) and compiled (verify) forwards
compute it identically and a compiled graph names its weights by key; the int8/int4 one is a
registered C++ op on the layer's buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.models.packed import content_key
from blockspec.models.weight_only import BITS, WeightOnlyLinear, exact_blocks, kernel_build, kernel_unavailable

#: --quantize values: "none" keeps the model's own weights.
QUANTIZE_CHOICES = ("none", "fp16", "int8", "int4")
#: Prepacked weights by content key, like the oneDNN-packed ones: a compiled graph names its weights by key.
_PACKED: dict[str, tuple[torch.ScriptObject, torch.Tensor | None, int]] = {}


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def _fp16_product(x: torch.Tensor, packed, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    out = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, x.shape[-1]), packed)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)


@torch.library.custom_op("blockspec::fp16_linear", mutates_args=())
def fp16_linear(x: torch.Tensor, key: str) -> torch.Tensor:
    return _fp16_product(x, *_PACKED[key])


@fp16_linear.register_fake
def _fp16_linear_shape(x: torch.Tensor, key: str) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _PACKED[key][2])


class Fp16Linear(nn.Module):
    """``nn.Linear`` with fp16 weights in FBGEMM's packed layout; activations and sums stay fp32 (inference only).

    ``weight`` gives the weight the packed copy stands for, for code that reads a layer's rows (a drafter
    copying rows of the target's LM head).
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        self.key = "fp16:" + content_key(linear)
        if self.key not in _PACKED:
            packed = torch.ops.quantized.linear_prepack_fp16(linear.weight.detach().float(), None)
            _PACKED[self.key] = (packed, self.bias, self.out_features)

    @property
    def weight(self) -> torch.Tensor:
        return torch.ops.quantized.linear_unpack_fp16(_PACKED[self.key][0])[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return fp16_linear(x, self.key)
        return _fp16_product(x, *_PACKED[self.key])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def check_quantize(mode: str | None, model=None) -> str:
    """``mode`` checked ("none" for None), and that ``model`` (when given) can run it."""
    mode = mode or "none"
    if mode not in QUANTIZE_CHOICES:
        raise BlockspecError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {mode!r}")
    if mode == "none" or model is None:
        return mode
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        raise BlockspecError(f"--quantize {mode} runs on the CPU; the target is on "
                             f"{parameter.device}: use --device cpu, or a checkpoint quantized for the GPU")
    if parameter.dtype != torch.float32:
        raise BlockspecError(f"--quantize {mode} quantizes an fp32 target; this one is {parameter.dtype}: "
                             "leave --dtype at float32")
    if mode == "fp16" and not fbgemm_available():
        raise BlockspecError(f"--quantize {mode} needs PyTorch's FBGEMM engine, which this build lacks")
    if mode in BITS and (reason := kernel_unavailable()):
        raise BlockspecError(f"--quantize {mode}: {reason}; use fp16")
    return mode


def quantize_target(model: nn.Module, mode: str | None) -> nn.Module:
    """Quantize ``model``'s linear layers in place (every decoder layer's and the LM head); the embedding
    and the norms keep their weights. "none" leaves the model as it is."""
    if check_quantize(mode, model) == "none":
        return model
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Fp16Linear(child) if mode == "fp16" else _weight_only(child, mode))
                replaced += 1
    if replaced == 0:
        raise BlockspecError(f"--quantize {mode}: the target has no linear layers to quantize")
    model.blockspec_quantization = mode
    return model


def _weight_only(linear: nn.Linear, mode: str) -> WeightOnlyLinear:
    """int8 keeps a layer Q4_1 holds exactly in those blocks: the same weights in fewer bytes."""
    raw = exact_blocks(linear, 4) if mode == "int8" else None
    return WeightOnlyLinear(linear, 4, raw) if raw is not None else WeightOnlyLinear(linear, BITS[mode])


def quantization_tag(model) -> str:
    """The mode and, for int8/int4, the kernel build it runs on: what a forward's cost depends on."""
    mode = quantization_of(model)
    return f"{mode}/{kernel_build()}" if mode in BITS else mode


def quantization_of(model) -> str:
    """The model's --quantize mode ("none" for a model left as loaded)."""
    return getattr(model, "blockspec_quantization", "none")


def parameter_count(model) -> int:
    """The model's weights, counted as loaded: its parameters and the packed layers' weights."""
    packed = sum(module.in_features * module.out_features for module in model.modules()
                 if isinstance(module, (Fp16Linear, WeightOnlyLinear)))
    return sum(p.numel() for p in model.parameters()) + packed
