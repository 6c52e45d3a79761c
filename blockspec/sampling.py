"""Sampling settings and the one place that turns logits into a sampling distribution.

The target's and the drafter's logits go through the same function, so temperature, min-p,
top-k and top-p act identically on both sides of the verifier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockspec.errors import BlockspecError


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    #: Tokens whose probability is under min_p times the most probable one's are dropped (0 switches it off).
    min_p: float = 0.0

    def __post_init__(self):
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BlockspecError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BlockspecError(f"top_p must be in (0, 1] (1 switches it off), got {self.top_p}")
        if self.top_k < 0:
            raise BlockspecError(f"top_k must be >= 0 (0 switches it off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise BlockspecError(f"min_p must be in [0, 1] (0 switches it off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device) -> torch.Generator:
        """The sequence's own generator: from its seed, else from torch's global one (so an unseeded run
        repeats after ``torch.manual_seed``, as Hugging Face's ``generate`` does)."""
        generator = torch.Generator(device=device)
        seed = self.seed if self.seed is not None else int(torch.randint(2**63 - 1, (), dtype=torch.int64))
        generator.manual_seed(seed)
        return generator


def sampling_probs(logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Probabilities [..., V] after temperature, min-p, top-k and top-p (float32), in vLLM's order."""
    scores = logits.float() / sampling.temperature
    vocab = scores.shape[-1]
    if sampling.min_p > 0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    if 0 < sampling.top_k < vocab:
        kth_best = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [..., V]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def pick_draft(logits: torch.Tensor, sampling: SamplingConfig, generator, sampled: bool):
    """One draft token from logits [V]: (token, q or None, the draft's probability of the token).

    Sampled: drawn from q (returned for the verifier). Else the argmax, q None.
    """
    if not sampled:
        token = int(logits.argmax())
        return token, None, float(torch.softmax(logits.float(), dim=-1)[token])
    q = sampling_probs(logits, sampling)
    token = int(sample_from(q, generator))
    return token, q, float(q[token])


def draft_confidence(logits: torch.Tensor, tokens: torch.LongTensor) -> torch.Tensor:
    """The draft distribution's probability of each chosen token, [n] from logits [n, V]."""
    logits = logits.float()
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return torch.exp(chosen - torch.logsumexp(logits, dim=-1))


def pick_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator=None) -> torch.Tensor:
    """Argmax when greedy, else a sample from the processed distribution."""
    if sampling.greedy:
        return logits.argmax(dim=-1)
    return sample_from(sampling_probs(logits, sampling), generator)
