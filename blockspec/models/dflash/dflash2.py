"""DFlash2's parts on the DFlash backbone: a causal grouped convolution inside the block around each layer's
attention and MLP, and a candidate selector that walks one coherent path through each position's top-k tokens.

Convolution: the hidden channels are split into groups of ``conv_group_size``; each block position mixes its own
and the ``conv_kernel_size - 1`` positions before it in the block with per-group coefficients, a learned base
kernel plus a per-position delta from ``kernel_projection`` of the layer's normed input (one delta before the
sublayer, ``prepare``, one after it, ``finish``). Selector: position l's candidates are its top-k tokens
under the head; a candidate c following token p scores ``unary(c) + (pred[p] ⊙ proj(h_l)) · succ[c]``.

Config keys (``dflash_config``, as z-lab's drafts and vLLM's ``qwen3_dflash2`` read them): ``conv_kernel_size``,
``conv_group_size``, ``selector_rank``, ``selector_top_k``, ``input_embedding_scale``, ``output_multiplier``,
``final_logit_softcapping``, ``attention_value_scale``; weights ``layers.N.{attention,mlp}_conv.base_kernel``
[2, taps, hidden], ``layers.N.{attention,mlp}_conv.kernel_projection.weight`` [2 * taps * groups, hidden],
``candidate_selector.{hidden_projection.weight, predecessor_codebook, successor_codebook}``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.errors import CheckpointError


@dataclass(frozen=True)
class DFlash2Settings:
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


def dflash2_settings(config) -> DFlash2Settings | None:
    """DFlash2's convolution and selector in a config (or a config.json as read); None: not a DFlash2 draft. A draft
    must have both: one without the other is not a layout blockspec knows."""
    nested = (config.get("dflash_config") if isinstance(config, dict) else getattr(config, "dflash_config", None)) or {}
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    given = {name: nested.get(name) for name in names if nested.get(name) is not None}
    if not given:
        return None
    missing = [name for name in names if name not in given]
    if missing:
        raise CheckpointError(f"a DFlash2 draft needs dflash_config.{missing[0]} beside {', '.join(given)}")
    wrong = [name for name, value in given.items()
             if isinstance(value, bool) or not isinstance(value, int) or value < 1]
    if wrong:
        raise CheckpointError(f"dflash_config.{wrong[0]} must be a whole number >= 1, got {given[wrong[0]]!r}")
    return DFlash2Settings(**given)


def logit_transform(config) -> tuple[float, float | None]:
    """DFlash2's output multiplier and final logit softcap (None: no cap) of the drafter's head."""
    nested = (config.get("dflash_config") if isinstance(config, dict) else getattr(config, "dflash_config", None)) or {}
    cap = float(nested.get("final_logit_softcapping") or 0.0)
    return float(nested.get("output_multiplier", 1.0) or 1.0), cap if cap > 0 else None


class GroupedConv(nn.Module):
    """The causal grouped convolution around one sublayer."""

    def __init__(self, hidden_size: int, settings: DFlash2Settings):
        super().__init__()
        if hidden_size % settings.conv_group_size:
            raise CheckpointError(f"conv_group_size {settings.conv_group_size} must divide hidden_size {hidden_size}")
        self.taps = settings.conv_kernel_size
        self.group_size = settings.conv_group_size
        self.groups = hidden_size // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.taps * self.groups, bias=False)

    def prepare(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved, and the coefficients its output will be: hidden [B, Q, H] (a block)."""
        deltas = self.kernel_projection(hidden).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(hidden, deltas[..., 0, :, :], 0), deltas[..., 1, :, :]

    def finish(self, hidden: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
        return self._convolve(hidden, deltas, 1)

    def _convolve(self, hidden: torch.Tensor, deltas: torch.Tensor, side: int) -> torch.Tensor:
        """Each position: sum over taps t of (base[t] + delta[t]) * the hidden state t positions before it in the
        block (zero before the block's start)."""
        grouped = hidden.unflatten(-1, (self.groups, self.group_size))
        coefficients = self.base_kernel[side].view(self.taps, self.groups, self.group_size).to(hidden.dtype) + \
            deltas.unsqueeze(-1)
        out = coefficients[..., 0, :, :] * grouped
        for tap in range(1, self.taps):
            shifted = F.pad(grouped[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
            out = out + coefficients[..., tap, :, :] * shifted
        return out.flatten(-2)


class CandidateSelector(nn.Module):
    """Scores of each position's candidate tokens given the token before them."""

    def __init__(self, hidden_size: int, vocabulary: int, settings: DFlash2Settings):
        super().__init__()
        self.top_k = settings.selector_top_k
        self.hidden_projection = nn.Linear(hidden_size, settings.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocabulary, settings.selector_rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocabulary, settings.selector_rank))

    def edges(self, previous: torch.LongTensor, hidden: torch.Tensor, candidates: torch.LongTensor) -> torch.Tensor:
        """[N, k]: the pairwise score of each of ``candidates`` [N, k] after ``previous`` [N] at positions of hidden
        states ``hidden`` [N, H]."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        gated = self.predecessor_codebook[previous] * projected
        return torch.einsum("nr,nkr->nk", gated, self.successor_codebook[candidates])
