"""Which masked positions a diffusion sampler commits at each step.

Every masked-diffusion sampler answers three questions per step, and each answer is one
small rule here:

- how many tokens to commit: ``linear`` (LLaDA: a block's masks spread evenly over its
  steps), ``bernoulli`` (Dream's ``origin``: each mask is revealed with probability 1 - s/t),
  ``threshold`` (Fast-dLLM: every token whose confidence exceeds a threshold, at least one);
- how to score a candidate token: ``confidence`` (its probability: LLaDA low-confidence
  remasking, Dream ``maskgit_plus``), ``margin`` (top-1 minus top-2 probability, Dream
  ``topk_margin``), ``entropy`` (negative entropy, Dream ``entropy``), ``random`` (LLaDA random
  remasking, Dream ``origin``);
- how to select among the scored positions: the best ``top`` ones, or ``sample`` them
  without replacement from softmax(score / alg_temp) (Dream's ``alg_temp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.errors import BlockspecError

COUNT_RULES = ("linear", "bernoulli", "threshold")
SCORES = ("confidence", "margin", "entropy", "random")
SELECTIONS = ("top", "sample")
#: Dream's time grid ends at eps, not 0, so the last step's s/t is not exactly zero.
DREAM_EPS = 1e-3


def linear_counts(num_masked: torch.Tensor, steps: int) -> torch.Tensor:
    """Tokens to commit per step, [B, steps]: each row's masks spread as evenly as possible,
    the first ``num_masked % steps`` steps taking one more (LLaDA's num_transfer_tokens)."""
    base = (num_masked // steps)[:, None].expand(-1, steps)
    extra = torch.arange(steps, device=num_masked.device)[None, :] < (num_masked % steps)[:, None]
    return base + extra.long()


def bernoulli_counts(masked: torch.Tensor, step: int, steps: int, generator: torch.Generator | None) -> torch.Tensor:
    """Dream ``origin``: each mask is revealed with probability 1 - s/t (all of them at the last step)."""
    if step >= steps - 1:
        return masked.sum(dim=1)
    grid = torch.linspace(1.0, DREAM_EPS, steps + 1)
    p_reveal = 1.0 - float(grid[step + 1] / grid[step])
    draws = torch.rand(masked.shape, generator=generator).to(masked.device) < p_reveal
    return (draws & masked).sum(dim=1)


def threshold_counts(scores: torch.Tensor, masked: torch.Tensor, threshold: float) -> torch.Tensor:
    """Fast-dLLM: every masked token whose score exceeds the threshold, at least one per row with masks."""
    above = ((scores > threshold) & masked).sum(dim=1)
    return torch.maximum(above, masked.any(dim=1).long())


def token_scores(probs: torch.Tensor, tokens: torch.Tensor, kind: str,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """Scores [B, N] of the candidate ``tokens`` [B, N] under ``probs`` [B, N, V]; higher commits first."""
    if kind == "confidence":
        return probs.gather(-1, tokens[..., None]).squeeze(-1)
    if kind == "margin":
        top2 = probs.topk(2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if kind == "entropy":
        return (probs * torch.log(probs.clamp_min(1e-10))).sum(dim=-1)
    if kind == "random":
        return torch.rand(tokens.shape, generator=generator).to(probs.device)
    raise BlockspecError(f"unknown score {kind!r}: choose one of {', '.join(SCORES)}")


def select_positions(scores: torch.Tensor, masked: torch.Tensor, counts: torch.Tensor, *, how: str = "top",
                     alg_temp: float = 0.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """A boolean [B, N]: ``counts[b]`` of row b's masked positions, by score.

    ``sample`` draws them without replacement from softmax(score / alg_temp) (Gumbel top-k);
    with alg_temp 0 it is ``top``.
    """
    keys = scores.double().masked_fill(~masked, float("-inf"))
    if how == "sample" and alg_temp > 0:
        uniform = torch.rand(keys.shape, generator=generator, dtype=torch.float64).to(keys.device)
        gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))
        keys = (keys / alg_temp + gumbel).masked_fill(~masked, float("-inf"))
    elif how not in SELECTIONS:
        raise BlockspecError(f"unknown selection {how!r}: choose one of {', '.join(SELECTIONS)}")
    counts = torch.minimum(counts, masked.sum(dim=1))
    order = keys.argsort(dim=1, descending=True)
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(keys.shape[1], device=keys.device).expand_as(order))
    return (ranks < counts[:, None]) & masked


@dataclass(frozen=True)
class Scheduler:
    """How many tokens to commit per step x how to score them x how to select them."""

    count: str = "linear"
    score: str = "confidence"
    select: str = "top"
    threshold: float = 0.9
    alg_temp: float = 0.0

    def __post_init__(self):
        for value, allowed, what in ((self.count, COUNT_RULES, "count rule"), (self.score, SCORES, "score"),
                                     (self.select, SELECTIONS, "selection")):
            if value not in allowed:
                raise BlockspecError(f"unknown {what} {value!r}: choose one of {', '.join(allowed)}")
        if self.count == "threshold" and not 0.0 <= self.threshold <= 1.0:
            raise BlockspecError(f"threshold must lie in [0, 1], got {self.threshold}")
        if self.alg_temp < 0:
            raise BlockspecError(f"alg_temp must be >= 0, got {self.alg_temp}")

    def planned_counts(self, num_masked: torch.Tensor, steps: int) -> torch.Tensor | None:
        """The per-step counts fixed when a block starts (only the linear rule has them)."""
        return linear_counts(num_masked, steps) if self.count == "linear" else None

    def choose(self, probs: torch.Tensor, tokens: torch.Tensor, masked: torch.Tensor, *, step: int, steps: int,
               planned: torch.Tensor | None, generator: torch.Generator | None = None) -> torch.Tensor:
        """The positions [B, N] to commit at ``step`` (0-based) of a block of ``steps`` steps."""
        scores = token_scores(probs, tokens, self.score, generator)
        if self.count == "linear":
            counts = planned[:, min(step, steps - 1)] if step < steps - 1 else masked.sum(dim=1)
        elif self.count == "bernoulli":
            counts = bernoulli_counts(masked, step, steps, generator)
        else:
            counts = threshold_counts(scores, masked, self.threshold)
        return select_positions(scores, masked, counts, how=self.select, alg_temp=self.alg_temp,
                                generator=generator)
