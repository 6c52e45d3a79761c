"""Fewer bytes a token on a CPU: the target's linear layers on fp16 weights, run by FBGEMM.

A decoding forward of a small model is bound by memory bandwidth: every token streams every
weight. ``quantize_target(model, "fp16")`` replaces each linear layer of the decoder and the LM
head with an ``Fp16Linear``: the weight rounded to fp16 and prepacked once for FBGEMM (PyTorch's
x86 GEMM library), which converts it back to fp32 in registers; activations and sums stay fp32.
Half the bytes of fp32; the product is a continuous function of its input, and a row's output
does not depend on the other rows of the block (bit for bit), so speculative decoding of the fp16
target is lossless exactly as of the fp32 one: equal to that fp16 target's own greedy decoding.

What was measured and is refused (``benchmarks/quantized_target.py`` times every kernel side by
side): PyTorch's int8 and int4 weight-only products (``_weight_int8pack_mm``,
``_weight_int4pack_mm_for_cpu``, which torchao's CPU layouts call) ran 5-50x slower than oneDNN
fp32 at the 1-16 rows of decoding on this AVX2 CPU, and inductor's fused weight-only GEMM only
matches bf16 activations. FBGEMM's int8 product with per-token int8 activations is fast (the
49,152-row head 3.7x faster than fp32 at one row) and row-independent, but rounding activations is
discontinuous: the ~1e-6 differences between a 16-token verify forward and single-token forwards
(attention and norm kernels) flip roundings, which grow to logit differences of 2-4 through 30
layers, and the speculative output parted from the int8 target's own greedy output on 4 of 4 demo
prompts. Lossless int8 needs batch-invariant attention and norm kernels first.

The product runs inside one registered op, so eager (prefill) and compiled (verify) forwards
compute it identically and a compiled graph names its weights by key.
"""

from __future__ import annotations

import torch
from torch import nn

from blockspec.errors import BlockspecError
from blockspec.models.packed import content_key

#: --quantize values: "none" keeps the model's own weights.
QUANTIZE_CHOICES = ("none", "fp16")
#: Asked for and refused, with the reason (measured on this project's 2-core AVX2 CPU, benchmarks/README.md).
UNAVAILABLE = {
    "int4": "int4 has no fast kernel on an AVX2 CPU in PyTorch (its int4 weight-only product ran 12-50x slower "
            "than fp32 at 1-16 rows here): use fp16",
    "int8": "int8 with per-token int8 activations is fast here but not lossless (its activation rounding turns the "
            "kernels' float noise into different verify and single-token logits), and PyTorch's int8 weight-only "
            "product runs 5-20x slower than fp32 on an AVX2 CPU: use fp16",
}
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
    if mode in UNAVAILABLE:
        raise BlockspecError(f"--quantize {mode}: {UNAVAILABLE[mode]}")
    if mode not in QUANTIZE_CHOICES:
        raise BlockspecError(f"--quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {mode!r}")
    if mode == "none" or model is None:
        return mode
    parameter = next(model.parameters())
    if parameter.device.type != "cpu":
        raise BlockspecError(f"--quantize {mode} runs on the CPU (FBGEMM's kernels); the target is on "
                             f"{parameter.device}: use --device cpu, or a checkpoint quantized for the GPU")
    if parameter.dtype != torch.float32:
        raise BlockspecError(f"--quantize {mode} quantizes an fp32 target; this one is {parameter.dtype}: "
                             "leave --dtype at float32")
    if not fbgemm_available():
        raise BlockspecError(f"--quantize {mode} needs PyTorch's FBGEMM engine, which this build lacks")
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
                setattr(parent, name, Fp16Linear(child))
                replaced += 1
    if replaced == 0:
        raise BlockspecError(f"--quantize {mode}: the target has no linear layers to quantize")
    model.blockspec_quantization = mode
    return model


def quantization_of(model) -> str:
    """The model's --quantize mode ("none" for a model left as loaded)."""
    return getattr(model, "blockspec_quantization", "none")


def parameter_count(model) -> int:
    """The model's weights, counted as loaded: its parameters and the packed layers' weights."""
    packed = sum(module.in_features * module.out_features for module in model.modules()
                 if isinstance(module, Fp16Linear))
    return sum(p.numel() for p in model.parameters()) + packed
