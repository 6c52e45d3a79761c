"""Suffix drafting: the suffix index against brute force on random strings."""

import random
from collections import Counter

import pytest

from blockspec.drafters.suffix_index import SuffixIndex


def substring_counts(sequences: list[list[int]], depth: int) -> Counter:
    """Occurrences of every run of 1..depth tokens, by brute force."""
    counts = Counter()
    for sequence in sequences:
        for start in range(len(sequence)):
            for length in range(1, depth + 1):
                if start + length <= len(sequence):
                    counts[tuple(sequence[start:start + length])] += 1
    return counts


def trie_counts(index: SuffixIndex) -> Counter:
    counts = Counter()
    stack = [((), index.root)]
    while stack:
        path, node = stack.pop()
        for token, child in node.children.items():
            counts[path + (token,)] = child.count
            stack.append((path + (token,), child))
    return counts


def random_sequences(seed: int, count: int = 5, vocab: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("depth", [1, 3, 8])
def test_the_index_counts_every_run_as_brute_force_does(seed, depth):
    sequences = random_sequences(seed)
    index = SuffixIndex(depth)
    rng = random.Random(seed)
    for key, sequence in enumerate(sequences):  # in pieces, as generation appends them
        cut = rng.randrange(len(sequence) + 1)
        index.extend(key, sequence[:cut])
        index.extend(key, sequence[cut:])
    assert trie_counts(index) == substring_counts(sequences, depth)
    index.remove(1)
    index.remove(3)
    assert trie_counts(index) == substring_counts([s for k, s in enumerate(sequences) if k not in (1, 3)], depth)
    assert index.tokens == sum(len(s) for k, s in enumerate(sequences) if k not in (1, 3))


@pytest.mark.parametrize("seed", range(10))
def test_the_match_is_the_longest_known_suffix_with_a_continuation(seed):
    depth = 6
    sequences = random_sequences(seed, vocab=3)
    index = SuffixIndex(depth)
    for key, sequence in enumerate(sequences):
        index.extend(key, sequence)
    counts = substring_counts(sequences, depth)
    rng = random.Random(seed + 100)
    for _ in range(20):
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        node, length = index.match(context)
        # brute force: the longest suffix (< depth tokens) followed by something in some sequence
        expected = next((n for n in range(min(depth - 1, len(context)), 0, -1)
                         if any(counts[tuple(context[-n:]) + (t,)] for t in range(3))), 0)
        assert length == expected
        if length:
            following = {t: counts[tuple(context[-length:]) + (t,)] for t in range(3)}
            assert {t: c.count for t, c in node.children.items()} == {t: c for t, c in following.items() if c}


def test_continuations_are_the_most_frequent_paths_parents_first():
    index = SuffixIndex(depth=8)
    index.extend("a", [1, 2, 3, 1, 2, 3, 1, 2, 4, 1, 2, 3])
    node, length = index.match([7, 1, 2])
    assert length == 2  # [1, 2]
    paths = index.continuations(node, budget=4, max_depth=3)
    assert [c.tokens for c in paths][:2] == [[3], [3, 1]]  # after [1, 2]: 3 three times, 4 once
    assert paths[0].probability == pytest.approx(0.75)
    assert all(c.parent < i for i, c in enumerate(paths))
    assert all(c.tokens[:-1] == paths[c.parent].tokens for c in paths if c.parent >= 0)
    assert len(index.continuations(node, budget=10, max_depth=1)) == 2
    assert index.continuations(node, budget=10, max_depth=3, min_probability=0.5)[-1].probability >= 0.5


# --- the drafter, its store, and hybrid trees --------------------------------------------------------------

import torch  # noqa: E402

from blockspec.decoding.sequence import GenerationConfig  # noqa: E402
from blockspec.drafters.dflash import DFlashDrafter  # noqa: E402
from blockspec.drafters.suffix import HybridDrafter, SuffixDrafter, SuffixStore  # noqa: E402
from blockspec.sampling import SamplingConfig  # noqa: E402
from helpers import (  # noqa: E402
    MAX_NEW,
    PASS,
    PROMPT,
    SAMPLES,
    VOCAB,
    chi_square_pvalue,
    decode,
    exact_joint,
    hf_greedy,
    make_causal_lm,
    make_dflash,
    repetitive_prompts,
    sampled_joint,
    small_target,
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in repetitive_prompts(320, 12, seed=8)]


def drafters(target):
    dflash = DFlashDrafter(make_dflash(target, block_size=8), target)
    return {"suffix": SuffixDrafter(SuffixStore()),
            "dflash+suffix": HybridDrafter(dflash, SuffixDrafter(SuffixStore())),
            "dflash+ngram": HybridDrafter(dflash, SuffixDrafter(None), name="dflash+ngram")}


@pytest.mark.parametrize("method", ["suffix", "dflash+suffix", "dflash+ngram"])
@pytest.mark.parametrize("tree_budget", [None, 12])
def test_suffix_and_hybrid_drafting_are_lossless(world, method, tree_budget):
    target, references = world
    drafter = drafters(target)[method]
    accepted = 0
    for ids, expected in references:
        config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, tree_budget=tree_budget)
        stream = decode(target, ids, drafter, config)
        assert stream.token_ids == expected
        accepted += sum(stream.stats.accepted)
        if hasattr(drafter, "remember"):
            drafter.remember(ids[0].tolist() + stream.token_ids)  # later prompts may copy from earlier outputs
    assert accepted > 0


def test_the_store_keeps_to_its_size_and_evicts_the_oldest():
    store = SuffixStore(max_tokens=50, depth=4)
    for key in range(6):
        store.add("k", [key] * 20)
    assert store.tokens <= 50
    held = {token for index in store.indexes.values() for token in index.root.children}
    assert held == {4, 5}  # the two newest outputs


def test_no_text_crosses_from_one_namespace_to_another():
    store = SuffixStore()
    secret = [7, 8, 9, 10, 11, 12, 13, 14]
    SuffixDrafter(store, "alice").remember(secret * 3)
    bob, alice = SuffixDrafter(store, "bob"), SuffixDrafter(store, "alice")
    for drafter, expected in ((bob, []), (alice, [9, 10, 11])):
        state = drafter.start(torch.tensor([[1, 2, 7]]), None)
        proposal = drafter.propose(state, 8, 3, SamplingConfig(), None)
        assert proposal.tokens.tolist() == expected


def test_the_speculation_length_follows_the_match():
    drafter = SuffixDrafter(None, depth_per_match=1.0)
    state = drafter.start(torch.tensor([[1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3]]), None)
    short = drafter.propose(drafter.start(torch.tensor([[5, 6, 1, 2, 3, 4, 5, 6, 7, 8]]), None), 5, 8,
                            SamplingConfig(), None)
    long = drafter.propose(state, 4, 8, SamplingConfig(), None)
    assert long.tokens.tolist()[:2] == [5, 6] and len(long.tokens) <= 4
    assert 1 <= len(short.tokens) <= 2


@pytest.mark.slow
def test_sampling_with_mixed_trees_follows_the_target():
    target = small_target()
    dflash = DFlashDrafter(make_dflash(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1, seed=5), target)
    store = SuffixStore()
    generator = torch.Generator().manual_seed(3)
    for _ in range(30):  # earlier outputs for the copy source: the target's own samples
        with torch.no_grad():
            ids = PROMPT.clone()
            for _ in range(4):
                probs = torch.softmax(target(ids).logits[0, -1], dim=-1)
                ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)[None]], dim=1)
        store.add(None, ids[0].tolist())
    drafter = HybridDrafter(dflash, SuffixDrafter(store, depth_per_match=4.0, min_probability=0.0))
    sampling = SamplingConfig(temperature=1.0)
    probs = {k: v for k, v in exact_joint(target, sampling).items() if v > 0}
    counts = sampled_joint(target, drafter, sampling, SAMPLES, tree_budget=6, tree_top_k=3)
    assert chi_square_pvalue(counts, probs, SAMPLES) > PASS
