"""The protocol every drafter implements, so that one step and one verifier serve all.

A drafter holds weights (or nothing, for prompt lookup); what belongs to one sequence lives
in the state ``start`` returns, so many sequences can draft from one drafter at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from blockspec.drafters.tree import Tree, build_tree
from blockspec.sampling import SamplingConfig


@dataclass
class Proposal:
    """Draft tokens [n] and, for drafters that sample, the distribution q [n, V] behind each.

    ``confidence`` [n]: the drafter's confidence at each position, which the adaptive verify width
    calibrates against acceptance. A sampled draft's must not depend on the draws: were the width
    chosen from q(drawn token), whether a draft is verified would depend on which token was drawn,
    and the output would no longer follow the target's distribution (None: the width stays fixed).
    """

    tokens: torch.LongTensor
    probs: torch.Tensor | None = None
    confidence: torch.Tensor | None = None

    @classmethod
    def empty(cls, device) -> "Proposal":
        return cls(torch.zeros(0, dtype=torch.long, device=device))

    def confidences(self) -> list[float] | None:
        """Per draft: the drafter's confidence; 1 for a deterministic draft without one (the calibration
        learns the rest); None for a sampled draft without one (its width must not adapt)."""
        if self.confidence is not None:
            return self.confidence.float().tolist()
        if self.probs is not None:
            return None
        return [1.0] * len(self.tokens)


#: A drafter's per-sequence state: whatever its ``start`` returns (caches, history, pending features).
DraftState = Any


class Drafter(ABC):
    """A source of draft tokens for the target to verify.

    The step calls ``start`` once after the prefill, then alternately ``propose`` (draft tokens
    that would follow ``last_token``) and ``commit`` (the tokens the target kept, which now sit
    in its KV cache, with the target's features at those positions).
    """

    name: str
    #: Target layers whose outputs the drafter reads (``hidden_states[i + 1]``); None for none.
    feature_layers: list[int] | None = None
    #: The most draft tokens one proposal may hold (the trained block size - 1); None for no limit.
    max_draft_tokens: int | None = None
    #: The verify width used when the user does not choose one.
    default_block_size: int

    @abstractmethod
    def start(self, prompt_ids: torch.LongTensor, features: torch.Tensor | None) -> DraftState:
        """A new sequence's state: prompt_ids [1, P], features [1, P, F] of the prompt positions."""

    @abstractmethod
    def propose(self, state: DraftState, last_token: int, num_tokens: int, sampling: SamplingConfig,
                generator: torch.Generator | None) -> Proposal:
        """Draft ``num_tokens`` tokens that follow ``last_token`` (not yet seen by the target)."""

    @abstractmethod
    def commit(self, state: DraftState, tokens: torch.LongTensor, features: torch.Tensor | None) -> None:
        """Tokens [1, m] the target has now processed and kept, with their features [1, m, F]."""

    def finish(self, state: DraftState, output_ids: list[int]) -> None:
        """The sequence has ended (finished or cancelled) with this answer; a drafter that learns from
        earlier answers keeps it. Most keep nothing."""

    def for_namespace(self, namespace: str | None) -> "Drafter":
        """This drafter as one tenant (a server's API key) sees it: one that learns from earlier answers
        reads and keeps only that tenant's. Most are the same for every tenant."""
        return self


class TreeDrafter(Drafter):
    """A drafter that proposes a token tree: many candidate continuations, verified in one target forward."""

    @abstractmethod
    def draft_tree(self, state: DraftState, last_token: int, depth: int, budget: int,
                   top_k: int) -> tuple[Tree, list[float]]:
        """At most ``budget`` nodes, ``depth`` deep, ``top_k`` children each, following ``last_token``; and the
        drafter's confidence in each node (what the adaptive width calibrates)."""

    def draft_trees(self, states: list[DraftState], last_tokens: list[int], depth: int, budget: int,
                    top_k: int) -> list[tuple[Tree, list[float]]]:
        """``draft_tree`` for many sequences (a batch's rows) at once; a drafter that can run them in one pass
        overrides it."""
        return [self.draft_tree(state, token, depth, budget, top_k) for state, token in zip(states, last_tokens)]


class PositionwiseDrafter(TreeDrafter):
    """A drafter whose one pass gives a distribution for every block position (DFlash): its tree holds the
    nodes of highest joint probability, its confidence in a node is that position's probability of it."""

    @abstractmethod
    def draft_logits(self, state: DraftState, last_token: int, num_tokens: int) -> torch.Tensor:
        """Logits [num_tokens, V] for the positions after ``last_token``."""

    def row_logits(self, state: DraftState, last_token: int,
                   num_tokens: int) -> tuple[torch.Tensor, torch.LongTensor | None]:
        """Logits [num_tokens, K] over the rows the drafter scores and the target id of each row (None: the
        rows are the target's vocabulary). A drafter with a reduced vocabulary gives its K rows."""
        return self.draft_logits(state, last_token, num_tokens), None

    def rows_logits(self, states: list[DraftState], last_tokens: list[int],
                    num_tokens: int) -> list[tuple[torch.Tensor, torch.LongTensor | None]]:
        """``row_logits`` for many sequences at once; a drafter that can run them in one pass overrides it."""
        return [self.row_logits(state, token, num_tokens) for state, token in zip(states, last_tokens)]

    def draft_tree(self, state: DraftState, last_token: int, depth: int, budget: int,
                   top_k: int) -> tuple[Tree, list[float]]:
        return _tree_of(*self.row_logits(state, last_token, depth), budget, top_k)

    def draft_trees(self, states: list[DraftState], last_tokens: list[int], depth: int, budget: int,
                    top_k: int) -> list[tuple[Tree, list[float]]]:
        return [_tree_of(logits, row_ids, budget, top_k)
                for logits, row_ids in self.rows_logits(states, last_tokens, depth)]


def _tree_of(logits: torch.Tensor, row_ids: torch.LongTensor | None, budget: int,
             top_k: int) -> tuple[Tree, list[float]]:
    """The tree of the most probable nodes under per-position logits [depth, K] (row ids: their target ids)."""
    probs = torch.softmax(logits.float(), dim=-1)
    tree = build_tree(probs, budget, top_k)
    confidences = [float(probs[d - 1, t]) for t, d in zip(tree.tokens, tree.depths)]
    if row_ids is not None:
        tree.tokens = row_ids[torch.tensor(tree.tokens, dtype=torch.long)].tolist()
    return tree, confidences
