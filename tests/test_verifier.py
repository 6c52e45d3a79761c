"""The one verifier on hand-built target scores: table-driven chain and tree cases, greedy and sampled.

Greedy rows are logits whose argmax spells the wanted token. Sampled rows are log-probabilities
in which every outcome is certain (probability 1 or 0), so each case has one right answer;
the sampling tests elsewhere check the distributions.
"""

import math

import pytest
import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.verifier import TargetScores, Verdict, verify_block, verify_chain, verify_tree
from blockspec.drafters.tree import Tree
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig

VOCAB = 16
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=1.0)


def argmax_rows(tokens: list[int]) -> TargetScores:
    """Target logits [len(tokens), VOCAB] whose argmax at row i is tokens[i]."""
    logits = torch.randn(len(tokens), VOCAB, generator=torch.Generator().manual_seed(len(tokens)))
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
    return TargetScores(logits)


def probability_rows(rows: list[dict[int, float]]) -> torch.Tensor:
    """Log-probabilities [len(rows), VOCAB]: each row's listed tokens with their mass, the rest none."""
    logits = torch.full((len(rows), VOCAB), -math.inf)
    for i, row in enumerate(rows):
        for token, mass in row.items():
            logits[i, token] = math.log(mass)
    return logits


def one_hot(rows: list[dict[int, float]]) -> torch.Tensor:
    return torch.softmax(probability_rows(rows), dim=-1)


# --- chains, greedy: (drafts, the target's argmax at [last token, drafts...], accepted, next token) ---------

GREEDY_CHAINS = [
    ([], [9], 0, 9),  # nothing drafted: the target's own token
    ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted, then the bonus token
    ([1, 2, 3], [5, 2, 3, 4], 0, 5),  # the first draft rejected
    ([1, 2, 3], [1, 7, 3, 4], 1, 7),  # rejected in the middle: the target's token there
    ([1, 2, 3], [1, 2, 8, 4], 2, 8),  # rejected at the last draft
    ([1, 9, 3], [1, 2, 3, 4], 1, 2),  # a later agreement after a rejection does not count
    ([4, 4, 4, 4], [4, 4, 4, 4, 4], 4, 4),  # repeated tokens
]


def chain_verdict(drafts, accepted, next_token) -> Verdict:
    """A chain's verdict: the next token recovered where a draft was rejected, a bonus after the last."""
    return Verdict(tuple(range(accepted)), next_token, recovered=accepted < len(drafts))


def tree_verdict(path, next_token) -> Verdict:
    """A walk of TREE's: the next token recovered where the node it stopped at had children."""
    return Verdict(path, next_token, recovered=bool(TREE.children(path[-1] if path else -1)))


@pytest.mark.parametrize("drafts,target,accepted,next_token", GREEDY_CHAINS)
def test_greedy_chain(drafts, target, accepted, next_token):
    verdict = verify_chain(torch.tensor(drafts, dtype=torch.long), argmax_rows(target), GREEDY)
    assert verdict == chain_verdict(drafts, accepted, next_token)
    assert verdict.kept_rows == list(range(accepted + 1))


@pytest.mark.parametrize("drafts,target,accepted,next_token", GREEDY_CHAINS)
def test_greedy_chain_from_greedy_tokens_alone(drafts, target, accepted, next_token):
    """Replay gives the target's greedy tokens without logits: the same verdicts."""
    scores = TargetScores(greedy_tokens=torch.tensor(target))
    assert verify_chain(torch.tensor(drafts, dtype=torch.long), scores, GREEDY) == chain_verdict(drafts, accepted,
                                                                                               next_token)


# --- chains, sampled: target p per row, the draft's q per draft (None: a deterministic drafter) ---------------

SAMPLED_CHAINS = [
    # p puts all mass on each draft: every draft passes, the bonus comes from the last row
    ([1, 2], [{1: 1.0}, {2: 1.0}, {6: 1.0}], [{1: 0.5, 3: 0.5}, {2: 0.5, 3: 0.5}], 2, 6),
    # p gives the first draft no mass: rejected; the residual max(0, p - q) is all on token 5
    ([1, 2], [{5: 1.0}, {2: 1.0}, {6: 1.0}], [{1: 1.0}, {2: 1.0}], 0, 5),
    # rejected at the second draft; the residual excludes the rejected token
    ([1, 2], [{1: 1.0}, {3: 1.0}, {6: 1.0}], [{1: 1.0}, {2: 1.0}], 1, 3),
    # a deterministic drafter (no q) is accepted with probability p(draft)
    ([1, 2], [{1: 1.0}, {2: 1.0}, {7: 1.0}], None, 2, 7),
    ([1, 2], [{4: 1.0}, {2: 1.0}, {7: 1.0}], None, 0, 4),
    # q equal to p: a draft p holds is never rejected
    ([3], [{3: 0.25, 4: 0.75}, {8: 1.0}], [{3: 0.25, 4: 0.75}], 1, 8),
]


@pytest.mark.parametrize("drafts,target,draft_probs,accepted,next_token", SAMPLED_CHAINS)
@pytest.mark.parametrize("seed", range(5))
def test_sampled_chain(drafts, target, draft_probs, accepted, next_token, seed):
    q = None if draft_probs is None else one_hot(draft_probs)
    verdict = verify_chain(torch.tensor(drafts, dtype=torch.long), TargetScores(probability_rows(target)), SAMPLED,
                           q, torch.Generator().manual_seed(seed))
    assert verdict == chain_verdict(drafts, accepted, next_token)


def test_a_rejection_never_emits_what_the_draft_already_covered():
    """p = {1: .5, 5: .5}, q = {1: 1}: the draft passes half the time; when rejected, the residual
    max(0, p - q) holds only token 5 (a verifier resampling from p would give 1 half the time)."""
    target = TargetScores(probability_rows([{1: 0.5, 5: 0.5}, {6: 1.0}]))
    outcomes = set()
    for seed in range(40):
        verdict = verify_chain(torch.tensor([1]), target, SAMPLED, one_hot([{1: 1.0}]),
                               torch.Generator().manual_seed(seed))
        outcomes.add((verdict.num_accepted, verdict.next_token))
    assert outcomes == {(1, 6), (0, 5)}


def test_sampled_verification_needs_logits():
    with pytest.raises(BlockspecError, match="needs the target's logits"):
        verify_chain(torch.tensor([1]), TargetScores(greedy_tokens=torch.tensor([1, 2])), SAMPLED)


# --- trees ----------------------------------------------------------------------------------------------------

#        root
#       /    \
#      0(5)   1(6)
#     /  \      \
#   2(7) 3(8)   4(9)
TREE = Tree(tokens=[5, 6, 7, 8, 9], parents=[-1, -1, 0, 0, 1], depths=[1, 1, 2, 2, 2])

# (the target's argmax at rows [root, node 0, ..., node 4], accepted path, next token)
GREEDY_TREES = [
    ([5, 7, 0, 0, 0, 0], (0, 2), 0),  # root -> 0 -> 2, then the target's token at node 2's row
    ([5, 8, 0, 0, 3, 0], (0, 3), 3),  # the second child of node 0
    ([6, 0, 9, 0, 0, 11], (1, 4), 11),  # the root's second child
    ([6, 0, 12, 0, 0, 0], (1,), 12),  # node 1 has no child 12: the walk stops there
    ([13, 7, 0, 0, 0, 0], (), 13),  # no child of the root
]


@pytest.mark.parametrize("target,path,next_token", GREEDY_TREES)
def test_greedy_tree(target, path, next_token):
    verdict = verify_tree(TREE, argmax_rows(target), GREEDY)
    assert verdict == tree_verdict(path, next_token)
    assert verdict.kept_rows == [0] + [1 + node for node in path]
    assert verify_block(VerifyBlock([0, *TREE.tokens], 5, TREE.parents), argmax_rows(target), GREEDY) == verdict


@pytest.mark.parametrize("drafts,target,accepted,next_token", GREEDY_CHAINS)
def test_a_chain_block_is_verified_as_a_chain(drafts, target, accepted, next_token):
    for parents in (None, list(range(-1, len(drafts) - 1))):  # a chain, whether or not it says so
        verdict = verify_block(VerifyBlock([0, *drafts], 5, parents), argmax_rows(target), GREEDY)
        assert verdict == chain_verdict(drafts, accepted, next_token)


# (p at each row: children are tried in order, each accepted with its share of what is left)
SAMPLED_TREES = [
    # all mass on the first child at each level
    ([{5: 1.0}, {7: 1.0}, {}, {}, {}, {}], (0, 2), None),
    # the first child has no mass: the second is tried and holds it all
    ([{6: 1.0}, {}, {9: 1.0}, {}, {}, {}], (1, 4), None),
    # no child holds mass: the token comes from p with the children removed
    ([{10: 1.0}, {}, {}, {}, {}, {}], (), 10),
    # at node 0 neither child (7, 8) holds mass; p's token there is 2
    ([{5: 1.0}, {2: 1.0}, {}, {}, {}, {}], (0,), 2),
]


@pytest.mark.parametrize("target,path,next_token", SAMPLED_TREES)
@pytest.mark.parametrize("seed", range(5))
def test_sampled_tree(target, path, next_token, seed):
    rows = [row or {0: 1.0} for row in target]  # rows never reached still need a distribution
    verdict = verify_tree(TREE, TargetScores(probability_rows(rows)), SAMPLED, torch.Generator().manual_seed(seed))
    assert verdict.path == path and verdict == tree_verdict(path, verdict.next_token)
    if next_token is not None:
        assert verdict.next_token == next_token
    else:  # after a full path, the token drawn from the last node's row
        assert verdict.next_token == 0


def test_a_tree_without_nodes_verifies_the_last_token_alone():
    empty = Tree(tokens=[], parents=[], depths=[])
    assert verify_tree(empty, argmax_rows([4]), GREEDY) == Verdict((), 4)
    assert verify_tree(empty, TargetScores(probability_rows([{11: 1.0}])), SAMPLED,
                       torch.Generator().manual_seed(0)) == Verdict((), 11)
