"""Domino's head on the DFlash backbone: a GRU over the block's previous tokens corrects each position's logits.

A GRU reads the target's embeddings of the tokens before each block position (the anchor, then the drafts) and
its state, beside that position's hidden state, goes through a low-rank MLP to a logit correction over the
whole vocabulary. The first ``pure_draft_prefix_len`` predicted positions keep the backbone's logits (the GRU
still reads their tokens). The layout SpecForge and the public Domino drafts use: ``dflash_config`` keys
``projector_type: "domino"``, ``gru_hidden_dim``, ``emb_dim``, ``pure_draft_prefix_len``, ``shift_label``
(the anchor's slot predicts: ``sample_from_anchor``); weights ``prefix_gru.weight_ih_l0`` / ``weight_hh_l0``
(no biases), ``embed_proj.0.weight`` [emb, hidden + gru], ``embed_proj.2.weight`` [vocabulary, emb].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import CheckpointError


@dataclass(frozen=True)
class DominoSettings:
    gru_hidden_dim: int
    emb_dim: int
    #: Predicted positions (from the first) whose logits stay the backbone's.
    pure_draft_prefix_len: int = 0
    #: Whether the anchor's slot predicts (slot k predicts anchor + k + 1).
    shift_label: bool = False


def domino_settings(config) -> DominoSettings | None:
    """The Domino head of a config (or a config.json as read), None when ``dflash_config.projector_type`` is not
    "domino"."""
    nested = (config.get("dflash_config") if isinstance(config, dict) else getattr(config, "dflash_config", None)) or {}
    kind = nested.get("projector_type")
    if kind is None:
        return None
    if kind != "domino":
        raise CheckpointError(f"dflash_config.projector_type {kind!r} is not one blockspec runs (domino)")
    sizes = {name: nested.get(name) for name in ("gru_hidden_dim", "emb_dim")}
    wrong = [name for name, size in sizes.items() if isinstance(size, bool) or not isinstance(size, int) or size < 1]
    if wrong:
        raise CheckpointError(f"a Domino draft needs dflash_config.{wrong[0]}, a whole number >= 1, got "
                              f"{sizes[wrong[0]]!r}")
    prefix = nested.get("pure_draft_prefix_len", 0)
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise CheckpointError(f"dflash_config.pure_draft_prefix_len must be a whole number >= 0, got {prefix!r}")
    return DominoSettings(sizes["gru_hidden_dim"], sizes["emb_dim"], prefix, bool(nested.get("shift_label", False)))


class DominoHead(nn.Module):
    """The GRU over previous tokens and the correction MLP (over ``vocabulary`` logits: the target's)."""

    def __init__(self, settings: DominoSettings, hidden_size: int, vocabulary: int):
        super().__init__()
        self.prefix_len = settings.pure_draft_prefix_len
        self.prefix_gru = nn.GRU(input_size=hidden_size, hidden_size=settings.gru_hidden_dim, num_layers=1,
                                 batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(hidden_size + settings.gru_hidden_dim, settings.emb_dim, bias=False),
                                        nn.SiLU(), nn.Linear(settings.emb_dim, vocabulary, bias=False))

    def initial_state(self, rows: int, like: torch.Tensor) -> torch.Tensor:
        return like.new_zeros(1, rows, self.prefix_gru.hidden_size)

    def step(self, previous_embeddings: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor, position: int):
        """The GRU reads the previous tokens' embeddings [N, D]; the correction [N, vocabulary] of the position
        ``position`` (0: the first predicted) from its hidden states [N, D] (None before ``prefix_len``), and the
        GRU's next state."""
        dtype = self.prefix_gru.weight_ih_l0.dtype
        output, state = self.prefix_gru(previous_embeddings.to(dtype).unsqueeze(1), state.to(dtype))
        if position < self.prefix_len:
            return None, state
        return self.embed_proj(torch.cat([hidden.to(dtype), output[:, 0]], dim=-1)), state
