"""Tree verification: the tree mask, tree building, losslessness, and exact sampling."""

import pytest
import torch

from blockspec.decoding.block import VerifyBlock, sequence_mask
from blockspec.decoding.costs import CostModel
from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.policy import AcceptanceCalibrator, AdaptiveWidth, WidthPolicies, walked_levels
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.verifier import TargetScores, verify_tree
from blockspec.drafters.dflash import DFlashDrafter
from blockspec.drafters.tree import Tree, build_tree
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig
from helpers import (
    MAX_NEW,
    PASS,
    SAMPLES,
    TWO_FAMILIES,
    VOCAB,
    FixedCosts,
    NoisyOracle,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    prompts,
    sampled_joint,
    small_target,
)


def test_each_node_sees_exactly_the_context_the_root_and_its_ancestors():
    #        root
    #       /    \
    #      0      1
    #     / \      \
    #    2   3      4
    tree = Tree(tokens=[10, 11, 12, 13, 14], parents=[-1, -1, 0, 0, 1], depths=[1, 1, 2, 2, 2])
    block = VerifyBlock([9, *tree.tokens], 3, tree.parents)  # 3 cached positions before the root
    mask = sequence_mask(block, None, None, torch.float32, "cpu")[0, 0]
    visible = mask == 0
    assert visible.shape == (6, 9)
    assert visible[:, :4].all()  # the 3 cached positions and the root
    expected_rows = {0: [], 1: [0], 2: [1], 3: [0, 2], 4: [0, 3], 5: [1, 4]}
    for row, ancestors in expected_rows.items():
        assert visible[row, 4:].nonzero().flatten().tolist() == ancestors, row
    assert VerifyBlock([9, *tree.tokens], 7, tree.parents).position_ids("cpu").tolist() == [[7, 8, 8, 9, 9, 9]]
    assert sequence_mask(VerifyBlock([9, 10, 11], 3), None, None, torch.float32, "cpu") is None  # causal


def test_a_sliding_layer_sees_the_window_behind_each_node():
    block = VerifyBlock([9, 10, 11, 13], 20, [-1, -1, 0])  # node 2 (depth 2) under node 0
    masks = sequence_mask(block, ["sliding_attention", "full_attention"], 4, torch.float32, "cpu")
    sliding, full = (masks[kind][0, 0] == 0 for kind in ("sliding_attention", "full_attention"))
    assert full.shape == (4, 24) and sliding.shape == (4, 7)  # a sliding layer holds the 3 positions before
    assert full[:, :20].all()
    # positions 17, 18, 19 before the root at 20; a node at depth d sees keys less than 4 positions behind
    assert sliding[0].tolist() == [True, True, True, True, False, False, False]
    assert sliding[3].tolist() == [False, False, True, True, True, False, True]  # depth 2: 19, root, node 0, itself


def test_the_tree_keeps_the_most_probable_paths():
    probs = torch.tensor([[0.6, 0.3, 0.1, 0.0], [0.5, 0.4, 0.1, 0.0], [0.9, 0.05, 0.05, 0.0]])
    tree = build_tree(probs, budget=5, top_k=2)
    # path probabilities: [0] .6, [1] .3, [0,0] .3, [0,1] .24, [0,0,0] .27, [1,0] .15 ...
    assert len(tree) == 5
    assert tree.tokens[:1] == [0] and tree.depths[0] == 1
    paths = sorted(tuple(tree.tokens[n] for n in tree.ancestors(i)) for i in range(len(tree)))
    assert paths == [(0,), (0, 0), (0, 0, 0), (0, 1), (1,)]
    assert all(parent < child for child, parent in enumerate(tree.parents))
    chain = build_tree(probs, budget=3, top_k=1)
    assert chain.tokens == [0, 0, 0] and chain.parents == [-1, 0, 1]
    with pytest.raises(BlockspecError, match="budget must be >= 1"):
        build_tree(probs, budget=0)


def test_greedy_walk_follows_the_target():
    tree = Tree(tokens=[5, 6, 7, 8], parents=[-1, -1, 1, 1], depths=[1, 1, 2, 2])
    logits = torch.full((5, 10), -5.0)
    logits[0, 6] = 5  # root -> node 1 (token 6)
    logits[2, 8] = 5  # node 1 -> node 3 (token 8)
    logits[4, 2] = 5  # after node 3: the target's own token 2
    verdict = verify_tree(tree, TargetScores(logits), SamplingConfig(), None)
    assert verdict.path == (1, 3) and verdict.next_token == 2


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in prompts(320, count=12, seed=31)]


@pytest.mark.parametrize("budget", [1, 4, 16, 32])
def test_tree_greedy_equals_hf_generate_and_beats_the_chain(world, budget):
    target, references = world
    tree_lengths, chain_lengths = [], []
    for ids, expected in references:
        reference = ids[0].tolist() + expected
        for tree_budget, lengths in ((budget, tree_lengths), (None, chain_lengths)):
            drafter = NoisyOracle(reference, 320, seed=len(reference))
            config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, tree_budget=tree_budget)
            stream = speculative_generate(target, ids, drafter, config)
            list(stream)
            assert stream.token_ids == expected
            lengths += stream.stats.acceptance_lengths
            verified, drafted = stream.stats.verified, stream.stats.drafted
            assert len(verified) == len(drafted) and all(v >= d + 1 for v, d in zip(verified, drafted))
            if tree_budget is not None:
                assert max(verified) <= tree_budget + 1
                if tree_budget >= 16:  # a tree's verify carries its branches, not only its depth
                    assert any(v > d + 1 for v, d in zip(verified, drafted))
            else:
                assert verified == [d + 1 for d in drafted]
    tau_tree, tau_chain = sum(tree_lengths) / len(tree_lengths), sum(chain_lengths) / len(chain_lengths)
    if budget >= 16:
        assert tau_tree > 1.2 * tau_chain, (tau_tree, tau_chain)


def test_tree_with_the_dflash_drafter_is_lossless(world):
    target, references = world
    drafter = DFlashDrafter(make_dflash(target, block_size=8), target)
    for ids, expected in references[:6]:
        stream = speculative_generate(target, ids, drafter, GenerationConfig(max_new_tokens=MAX_NEW, tree_budget=16))
        list(stream)
        assert stream.token_ids == expected


def test_trees_need_a_one_pass_drafter():
    from blockspec.drafters.ngram import PromptLookupDrafter

    target = make_causal_lm("llama", vocab_size=320)
    with pytest.raises(BlockspecError, match="a token tree needs a drafter that proposes one .*, not ngram"):
        speculative_generate(target, torch.tensor([[5, 6]]), PromptLookupDrafter(), GenerationConfig(tree_budget=8))
    with pytest.raises(BlockspecError, match="tree_budget must be >= 1"):
        GenerationConfig(tree_budget=0)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=5)])
def test_sampling_with_trees_follows_the_target(sampling):
    target = small_target()
    model = make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5)
    with torch.no_grad():
        model.norm.weight.mul_(5.0)  # peaked drafts, so that candidates are accepted and rejected
    drafter = DFlashDrafter(model, target)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES, tree_budget=5, tree_top_k=3)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS


def test_auto_chooses_how_much_of_the_tree_to_verify(world):
    target, references = world
    policies = WidthPolicies(lambda model, width: FixedCosts([1.0 + 0.02 * w for w in range(width)]))
    sizes = set()
    for ids, expected in references[:6]:
        drafter = NoisyOracle(ids[0].tolist() + expected, 320, seed=3)
        config = GenerationConfig(max_new_tokens=MAX_NEW, block_size="auto", tree_budget=32)
        stream = decode(target, ids, drafter, config, width_policies=policies)
        assert stream.token_ids == expected
        sizes.update(stream.widths)
    assert len(sizes) > 1 and max(sizes) <= 33


def test_the_tree_size_policy_weighs_reach_against_cost():
    flat = AdaptiveWidth(CostModel([1.0] * 8))
    assert flat.choose([0.9, 0.5, 0.9, 0.2], [-1, -1, 0, 2]) == 5  # free nodes: take them all
    steep = AdaptiveWidth(CostModel([1.0, 1.1, 5.0, 5.0, 5.0]))
    assert steep.choose([0.9, 0.5, 0.9, 0.2], [-1, -1, 0, 2]) == 2
    tree = Tree(tokens=[5, 6, 7], parents=[-1, -1, 0], depths=[1, 1, 2])
    assert tree.first(2).tokens == [5, 6]
    assert walked_levels(tree.parents, [0], [0.9, 0.5, 0.8]) == [([0.9, 0.5], 0), ([0.8], None)]


@pytest.mark.parametrize("path, learnt", [([], [(0.9, 0)]), ([0], [(0.9, 1), (0.8, 0)]),
                                          ([0, 1], [(0.9, 1), (0.8, 1)])])
def test_a_chain_is_learnt_from_as_the_tree_it_is(path, learnt):
    """A chain's verdict counts as a one-child-per-level tree's: each draft reached is tried, those on the path
    accepted, the next (if any) rejected, the rest unseen."""
    policy = AdaptiveWidth(CostModel([1.0] * 4))
    policy.observe([0.9, 0.8], None, path)
    expected = AcceptanceCalibrator()
    for confidence, accepted in learnt:
        expected.observe_candidates([confidence], 0 if accepted else None)
    assert (policy.calibrator.tried, policy.calibrator.accepted) == (expected.tried, expected.accepted)
    assert policy.expected_tokens([0.9, 0.8]) == policy.expected_tokens([0.9, 0.8], [-1, 0])


def test_cli_generate_with_a_tree(tiny_target_dir, tiny_draft_dir, capsys):
    import json

    from blockspec.cli import main

    assert main(["generate", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir), "--tree-budget", "8",
                 "--json", "--max-new-tokens", "8", "hello"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--target", str(tiny_target_dir), "--method", "ar", "--json", "--max-new-tokens", "8",
                 "hello"]) == 0
    assert json.loads(plain)["token_ids"] == json.loads(capsys.readouterr().out)["token_ids"]
