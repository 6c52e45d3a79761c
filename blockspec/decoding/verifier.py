"""The one verifier every drafter goes through, for a chain of drafts and for a token tree.

Chain, greedy: accept draft token i while it equals the target's argmax at i. Chain,
sampling: accept draft token x with probability min(1, p(x) / q(x)); at the first rejection,
sample from norm(max(0, p - q)); when all drafts pass, sample the bonus token from p. A
drafter that gives no q is deterministic, and q is one-hot on its token (sample-and-match).

Tree: acceptance walks down from the root. Greedy: follow the child whose token is the
target's argmax. Sampling: the children of a node are fixed candidates c1, c2, ... tried in
turn; c_i is accepted with probability p_i(c_i), where p_1 = p and p_{i+1} is p_i with c_i
removed and renormalised; if none is accepted the token is drawn from the last p_i. The token
emitted is then distributed exactly as p (the first candidate with probability p(c1); the
next, (1 - p(c1)) * p(c2) / (1 - p(c1)); and so on), so the output follows the target's
distribution.

The target's side is a ``TargetScores``: its logits at every verified row, or, where only
greedy decisions are needed (replaying a recorded greedy answer), just its argmax tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.drafters.tree import Tree
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig, sample_from, sampling_probs


@dataclass
class TargetScores:
    """The target's verdict material for one verified block: logits [W, V] or greedy tokens [W]."""

    logits: torch.Tensor | None = None
    greedy_tokens: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return (self.logits if self.logits is not None else self.greedy_tokens).device

    def argmax(self) -> torch.Tensor:
        """The target's argmax token at each row."""
        return self.greedy_tokens if self.greedy_tokens is not None else self.logits.argmax(dim=-1)

    def probs(self, sampling: SamplingConfig) -> torch.Tensor:
        return sampling_probs(self.logits_for("sampled verification"), sampling)

    def logits_for(self, purpose: str) -> torch.Tensor:
        """The logits, which ``purpose`` needs (a replayed target gives only its greedy tokens)."""
        if self.logits is None:
            raise BlockspecError(f"{purpose} needs the target's logits, not only its greedy tokens")
        return self.logits


@dataclass(frozen=True)
class Verdict:
    """The accepted drafts (their indices, in order along the accepted path) and the target's next token."""

    path: tuple[int, ...]
    next_token: int
    #: In vLLM's terms: the next token was recovered (drawn where a draft on offer was rejected: from the
    #: residual, or greedily the target's own token there), not a bonus (after the path's last draft, with
    #: no draft left to try).
    recovered: bool = False

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    @property
    def kept_rows(self) -> list[int]:
        """Rows of the verified block that stay: the root (the last token) and the accepted drafts."""
        return [0] + [1 + node for node in self.path]


def verify_block(block: VerifyBlock, scores: TargetScores, sampling: SamplingConfig,
                 draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """The verdict on one block: a chain's drafts in order (``draft_probs``: as for ``verify_chain``), a
    tree's nodes walked down from the root."""
    drafts = block.tokens[1:]
    if block.is_chain:
        tokens = torch.tensor(drafts, dtype=torch.long, device=scores.device)
        return verify_chain(tokens, scores, sampling, draft_probs, generator)
    return verify_tree(Tree(drafts, block.parents, block.depths[1:]), scores, sampling, generator)


def verify_chain(draft_tokens: torch.Tensor, scores: TargetScores, sampling: SamplingConfig,
                 draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """How many of ``draft_tokens`` [n] to keep and the token that follows them.

    ``scores``: the target's at the rows [last token, drafts...]; ``draft_probs`` [n, V] is the distribution
    each draft was sampled from (processed with the same sampling settings), None for a
    deterministic drafter.
    """
    if sampling.greedy:
        choices = scores.argmax()
        accepted = _greedy_prefix(draft_tokens, choices)
        return Verdict(tuple(range(accepted)), int(choices[accepted]), accepted < draft_tokens.shape[0])
    target_probs = scores.probs(sampling)
    n = draft_tokens.shape[0]
    if n == 0:
        return Verdict((), int(sample_from(target_probs[0], generator)))
    positions = torch.arange(n, device=draft_tokens.device)
    p = target_probs[positions, draft_tokens]
    q = torch.ones_like(p) if draft_probs is None else draft_probs[positions, draft_tokens].float()
    uniform = torch.rand(n, generator=generator, device=p.device)
    accepted = int((uniform * q < p).int().cumprod(dim=0).sum())
    if accepted == n:
        return Verdict(tuple(range(n)), int(sample_from(target_probs[n], generator)))
    residual = _residual(target_probs, draft_probs, draft_tokens, accepted)
    return Verdict(tuple(range(accepted)), int(sample_from(residual, generator)), recovered=True)


def verify_tree(tree: Tree, scores: TargetScores, sampling: SamplingConfig,
                generator: torch.Generator | None = None) -> Verdict:
    """Walk down the tree: row 0 of ``scores`` is the root's, row 1 + i node i."""
    path, row, node = [], 0, -1
    choices = scores.argmax() if sampling.greedy else None
    probs = None if sampling.greedy else scores.probs(sampling)
    while True:
        children = tree.children(node)
        if sampling.greedy:
            best = int(choices[row])
            match = next((c for c in children if tree.tokens[c] == best), None)
            token = best
        else:
            match, token = _accept_among(children, tree, probs[row], generator)
        if match is None:
            return Verdict(tuple(path), token, recovered=bool(children))
        path.append(match)
        node, row = match, 1 + match


def _greedy_prefix(draft_tokens: torch.Tensor, choices: torch.Tensor) -> int:
    n = draft_tokens.shape[0]
    if n == 0:
        return 0
    return int((draft_tokens == choices[:n].to(draft_tokens.device)).int().cumprod(dim=0).sum())


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


def _accept_among(children, tree: Tree, probs: torch.Tensor, generator):
    """Try each candidate child in turn (exact multi-candidate rejection); (child, None) or (None, token)."""
    p = probs.clone()
    for child in children:
        token = tree.tokens[child]
        mass = float(p[token])
        if mass > 0 and float(torch.rand((), generator=generator, device=p.device)) < mass:
            return child, None
        p[token] = 0.0
        total = float(p.sum())
        if total <= 0:  # only reachable through rounding: every token with mass was a candidate
            break
        p = p / total
    return None, int(sample_from(p, generator))
