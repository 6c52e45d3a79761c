"""Hybrid drafting: one token tree from a one-pass drafter's distributions and copied continuations.

``dflash+suffix`` copies from this sequence and the process's ``SuffixStore`` (earlier requests' outputs);
``dflash+lookup`` from this sequence's own text only (prompt lookup, scored by frequency).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.drafters.base import PositionwiseDrafter, Proposal, TreeDrafter
from blockspec.drafters.suffix import (
    SuffixDrafter,
    SuffixState,
    SuffixStore,
    merge_paths,
    paths_to_chain,
    paths_to_tree,
)
from blockspec.drafters.suffix_index import Continuation
from blockspec.drafters.tree import Tree, build_tree


@dataclass
class HybridState:
    primary: object
    copies: SuffixState


class HybridDrafter(TreeDrafter):
    """One token tree from a one-pass drafter's distributions and copied continuations, under one node budget.

    Every candidate path is scored by the better of two estimates: the one-pass drafter's joint probability
    of its tokens (the product of each position's probability of them) and the copy source's empirical
    probability. Both are never higher for a path than for its parent, so the best ``budget`` paths form a
    tree. Verified by the one verifier: greedy follows the target, sampling tries each node's children as
    fixed candidates (exact multi-candidate rejection), whichever source proposed them.
    """

    def __init__(self, primary: PositionwiseDrafter, copies: SuffixDrafter, *, name: str = "dflash+suffix"):
        self.primary = primary
        self.copies = copies
        self.name = name
        self.feature_layers = primary.feature_layers
        self.max_draft_tokens = primary.max_draft_tokens
        self.default_block_size = primary.default_block_size

    def for_namespace(self, namespace: str | None) -> "HybridDrafter":
        return HybridDrafter(self.primary, self.copies.for_namespace(namespace), name=self.name)

    def remember(self, tokens: list[int]) -> None:
        self.copies.remember(tokens)

    def finish(self, state: HybridState, output_ids: list[int]) -> None:
        self.primary.finish(state.primary, output_ids)
        self.copies.finish(state.copies, output_ids)

    def start(self, prompt_ids, features) -> HybridState:
        return HybridState(self.primary.start(prompt_ids, features), self.copies.start(prompt_ids, None))

    def commit(self, state: HybridState, tokens, features) -> None:
        self.primary.commit(state.primary, tokens, features)
        self.copies.commit(state.copies, tokens, None)

    def propose(self, state: HybridState, last_token, num_tokens, sampling, generator) -> Proposal:
        paths = self._paths(state, last_token, num_tokens, budget=4 * num_tokens, top_k=4)
        return paths_to_chain(paths, state.copies.device)

    def draft_tree(self, state: HybridState, last_token: int, depth: int, budget: int,
                   top_k: int) -> tuple[Tree, list[float]]:
        return paths_to_tree(self._paths(state, last_token, depth, budget, top_k), top_k)

    def _paths(self, state: HybridState, last_token: int, depth: int, budget: int, top_k: int):
        probs = torch.softmax(self.primary.draft_logits(state.primary, last_token, depth).float(), dim=-1)
        tree = build_tree(probs, budget, top_k)
        drafted = _tree_paths(tree, probs)
        copied = [Continuation(c.tokens, c.parent, max(c.probability, _joint(probs, c.tokens)))
                  for c in self.copies.candidates(state.copies, last_token, budget=budget, max_depth=depth)]
        return merge_paths([drafted, copied], budget, depth)


def _tree_paths(tree: Tree, probs: torch.Tensor) -> list[Continuation]:
    """A one-pass tree's nodes as paths with their joint probabilities."""
    paths = []
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        before = paths[parent] if parent >= 0 else Continuation([], -1, 1.0)
        depth = len(before.tokens)
        paths.append(Continuation(before.tokens + [token], parent, before.probability * float(probs[depth, token])))
    return paths


def _joint(probs: torch.Tensor, tokens: list[int]) -> float:
    """The one-pass drafter's probability of a path (0 beyond the positions it drafted)."""
    if len(tokens) > probs.shape[0]:
        return 0.0
    return float(torch.prod(probs[torch.arange(len(tokens)), torch.tensor(tokens)]))


def build_hybrid(directory, target, *, sample_drafts: bool = True, packed: bool = False, block_size: int | None = None,
                 depth_per_match: float = 4.0, min_probability: float = 0.1) -> HybridDrafter:
    """DFlash (a checkpoint directory) with suffix drafting over this sequence and the process's store."""
    from blockspec.drafters.dflash import build as build_dflash

    primary = build_dflash(directory, target, sample_drafts=sample_drafts, packed=packed)
    copies = SuffixDrafter(SuffixStore(), block_size=block_size or primary.default_block_size,
                           depth_per_match=depth_per_match, min_probability=min_probability)
    return HybridDrafter(primary, copies, name="dflash+suffix")


def build_hybrid_lookup(directory, target, *, sample_drafts: bool = True, packed: bool = False,
                        depth_per_match: float = 4.0, min_probability: float = 0.1) -> HybridDrafter:
    """DFlash with copies from this sequence's own text only (prompt lookup, scored by frequency)."""
    from blockspec.drafters.dflash import build as build_dflash

    primary = build_dflash(directory, target, sample_drafts=sample_drafts, packed=packed)
    copies = SuffixDrafter(None, block_size=primary.default_block_size, depth_per_match=depth_per_match,
                           min_probability=min_probability)
    return HybridDrafter(primary, copies, name="dflash+lookup")
