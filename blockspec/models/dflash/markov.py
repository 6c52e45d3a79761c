"""DSpark's heads on the DFlash backbone: a Markov head that chains the block's positions, and a confidence head.

A DFlash block predicts its positions independently. DSpark adds to position k's logits a bias from the token
before it: ``w2 · w1[previous token]`` (vanilla, rank R), gated by the position's hidden state (gated), or from
a small recurrent state carried along the block (rnn). Position 0's previous token is the anchor (the last
verified token); each later one's is the token drafted before it, so the block is drafted left to right
from one backbone pass. The confidence head, ``sigmoid(proj · [h_k ; w1[previous token]])``, estimates
whether position k's draft will be accepted.

Config keys, as DeepSpec, SpecForge and vLLM's speculators name them: ``markov_rank``, ``markov_head_type``,
``enable_confidence_head``, ``confidence_head_with_markov`` (top level, or under ``dspark_config``); weights
``markov_head.markov_w1.weight`` [vocabulary, R], ``markov_head.markov_w2.weight`` [vocabulary, R], the gated
head's ``markov_head.gate_proj``, the rnn head's ``markov_head.joint_proj``, ``confidence_head.proj``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.errors import CheckpointError

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True)
class DSparkSettings:
    markov_rank: int
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = True


def dspark_settings(config) -> DSparkSettings | None:
    """The DSpark heads of a config (or a config.json as read); None: a plain DFlash drafter (``markov_rank`` absent
    or 0)."""
    rank = _setting(config, "markov_rank", 0)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise CheckpointError(f"markov_rank must be a whole number >= 0, got {rank!r}")
    if rank == 0:
        if _setting(config, "enable_confidence_head", False):
            raise CheckpointError("enable_confidence_head needs the Markov head its inputs come from: markov_rank is 0")
        return None
    kind = str(_setting(config, "markov_head_type", "vanilla")).lower()
    if kind not in MARKOV_HEAD_TYPES:
        raise CheckpointError(f"markov_head_type {kind!r} is not one blockspec runs ({', '.join(MARKOV_HEAD_TYPES)})")
    return DSparkSettings(rank, kind, bool(_setting(config, "enable_confidence_head", False)),
                          bool(_setting(config, "confidence_head_with_markov", True)))


def _setting(config, name: str, default):
    """A setting from ``dspark_config``, else the top level (of a config, or a config.json as read)."""
    get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)
    nested = get("dspark_config") or {}
    if nested.get(name) is not None:
        return nested[name]
    value = get(name)
    return default if value is None else value


class MarkovHead(nn.Module):
    """The bias each block position's logits get from the token before it (over the head's ``vocabulary``)."""

    def __init__(self, settings: DSparkSettings, vocabulary: int, hidden_size: int):
        super().__init__()
        rank = settings.markov_rank
        self.kind = settings.markov_head_type
        self.markov_w1 = nn.Embedding(vocabulary, rank)
        self.markov_w2 = nn.Linear(rank, vocabulary, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    @property
    def rank(self) -> int:
        return self.markov_w1.embedding_dim

    def initial_state(self, rows: int, like: torch.Tensor) -> torch.Tensor | None:
        """The recurrent state before a block's first position (None: the head keeps none)."""
        return like.new_zeros(rows, self.rank) if self.kind == "rnn" else None

    def step(self, previous: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """For rows whose previous tokens are ``previous`` [N] (head ids; -1: none the head knows) at positions
        of hidden states ``hidden`` [N, D]: the logit bias [N, vocabulary], the next state, and the previous
        tokens' embeddings [N, R] (zero for -1)."""
        latent, state, embedded = self.latent(previous, hidden, state)
        return self.markov_w2(latent), state, embedded

    def latent(self, previous: torch.LongTensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """``step`` before its last projection: the bias is ``markov_w2`` of the first [N, R] (so the bias of a few
        rows is those rows of ``markov_w2.weight`` times it)."""
        known = (previous >= 0).unsqueeze(-1)
        embedded = self.markov_w1(previous.clamp(min=0)) * known
        hidden = hidden.to(embedded.dtype)
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded], dim=-1))) * embedded, state, embedded
        if self.kind == "rnn":
            gate, candidate, output = self.joint_proj(torch.cat([state, embedded, hidden], dim=-1)).chunk(3, dim=-1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            return torch.tanh(output), state, embedded
        return embedded, state, embedded


class ConfidenceHead(nn.Module):
    """The chance that a position's draft is accepted, from its hidden state (and its previous token's Markov
    embedding)."""

    def __init__(self, settings: DSparkSettings, hidden_size: int):
        super().__init__()
        self.with_markov = settings.confidence_with_markov
        self.proj = nn.Linear(hidden_size + (settings.markov_rank if self.with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1) if self.with_markov else hidden
        return torch.sigmoid(self.proj(features.to(self.proj.weight.dtype)).float()).squeeze(-1)
