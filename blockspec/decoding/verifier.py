"""The one verifier every drafter goes through.

Greedy: accept draft token i while it equals the target's argmax at i. Sampling: accept
draft token x with probability min(1, p(x) / q(x)); at the first rejection, sample from
norm(max(0, p - q)); when all drafts pass, sample the bonus token from p. A drafter that
gives no q is deterministic, and q is one-hot on its token (sample-and-match).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.sampling import SamplingConfig, sample_from, sampling_probs


@dataclass(frozen=True)
class Verdict:
    num_accepted: int
    next_token: int


def verify(
    draft_tokens: torch.Tensor,
    target_logits: torch.Tensor,
    sampling: SamplingConfig,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Decide how many of ``draft_tokens`` [n] to keep and the token that follows them.

    target_logits: [n + 1, V], the target's logits at [last token, drafts...].
    draft_probs: [n, V], the distribution each draft token was sampled from (already
    processed with the same sampling settings), or None for a deterministic drafter.
    """
    if sampling.greedy:
        return _verify_greedy(draft_tokens, target_logits)
    return _verify_sampled(draft_tokens, target_logits, sampling, draft_probs, generator)


def _verify_greedy(draft_tokens, target_logits) -> Verdict:
    choices = target_logits.argmax(dim=-1)
    n = draft_tokens.shape[0]
    matches = (draft_tokens == choices[:n]).int()
    accepted = int(matches.cumprod(dim=0).sum()) if n else 0
    return Verdict(accepted, int(choices[accepted]))


def _verify_sampled(draft_tokens, target_logits, sampling, draft_probs, generator) -> Verdict:
    target_probs = sampling_probs(target_logits, sampling)
    n = draft_tokens.shape[0]
    if n == 0:
        return Verdict(0, int(sample_from(target_probs[0], generator)))
    positions = torch.arange(n, device=draft_tokens.device)
    p = target_probs[positions, draft_tokens]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[positions, draft_tokens].float()
    uniform = torch.rand(n, generator=generator, device=p.device)
    passed = (uniform * q < p).int()
    accepted = int(passed.cumprod(dim=0).sum())
    if accepted == n:
        return Verdict(n, int(sample_from(target_probs[n], generator)))
    return Verdict(accepted, int(sample_from(_residual(target_probs, draft_probs, draft_tokens, accepted), generator)))


def _residual(target_probs, draft_probs, draft_tokens, index) -> torch.Tensor:
    p = target_probs[index]
    if draft_probs is None:
        q = torch.zeros_like(p)
        q[draft_tokens[index]] = 1.0
    else:
        q = draft_probs[index].float()
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    # total is 0 only when p == q, where a rejection cannot happen; guard against rounding.
    return residual / total if total > 0 else p
