"""Suffix drafting: the suffix index against brute force on random strings; the drafter, its store, and
hybrid trees lossless."""

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


def random_sequences(seed: int, count: int = 5, vocab: int = 4) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 40))] for _ in range(count)]


def built_in_pieces(sequences: list[list[int]], seed: int, **options) -> SuffixIndex:
    """An index of ``sequences`` appended a piece at a time, interleaved, as generation appends them
    (so sequences grow after others were added and must move), with two removed on the way."""
    index = SuffixIndex(**options)
    rng = random.Random(seed)
    cuts = [rng.randrange(len(sequence) + 1) for sequence in sequences]
    for key, sequence in enumerate(sequences):
        index.extend(key, sequence[:cuts[key]])
    index.extend("gone", [1, 2, 3] * 30)
    for key, sequence in enumerate(sequences):
        index.extend(key, sequence[cuts[key]:])
    index.extend("also gone", [3, 2, 1] * 30)
    index.remove("gone")
    index.remove("also gone")  # now over half the array is holes: compacted
    return index


def brute_force_match(sequences, context, max_match):
    """The longest suffix of ``context`` (<= max_match tokens) followed by something somewhere, and what
    follows it how often."""
    counts = substring_counts(sequences, max_match + 1)
    for length in range(min(max_match, len(context)), 0, -1):
        suffix = tuple(context[-length:])
        following = {t: counts[suffix + (t,)] for t in range(4) if counts[suffix + (t,)]}
        if following:
            return length, following
    return 0, {}


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_match", [1, 3, 8])
def test_the_match_is_the_longest_known_suffix_with_a_continuation(seed, max_match):
    sequences = random_sequences(seed, vocab=3)
    index = built_in_pieces(sequences, seed, max_match=max_match)
    assert index.tokens == sum(map(len, sequences))
    assert [index.sequence(key) for key in range(len(sequences))] == sequences
    rng = random.Random(seed + 100)
    for _ in range(20):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        match, length = index.match(context)
        expected_length, following = brute_force_match(sequences, context, max_match)
        assert length == expected_length
        if length:
            paths = index.continuations(match, budget=10, max_depth=1)
            total = sum(following.values())
            assert {p.tokens[0]: p.probability for p in paths} == pytest.approx(
                {t: c / total for t, c in following.items()})


@pytest.mark.parametrize("seed", range(6))
def test_every_continuation_is_scored_by_its_counts_as_brute_force_finds_them(seed):
    sequences = random_sequences(seed, vocab=3)
    index = built_in_pieces(sequences, seed, max_match=4)
    counts = substring_counts(sequences, 12)
    context = sequences[0][:3]
    match, length = index.match(context)
    suffix = tuple(context[-length:])
    for path in index.continuations(match, budget=50, max_depth=5):
        probability = 1.0
        for step in range(1, len(path.tokens) + 1):
            here = suffix + tuple(path.tokens[:step - 1])
            probability *= counts[here + (path.tokens[step - 1],)] / sum(counts[here + (t,)] for t in range(3))
        assert path.probability == pytest.approx(probability)


def test_continuations_are_the_most_frequent_paths_parents_first():
    index = SuffixIndex(max_match=8)
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


def test_a_long_match_drafts_as_deep_as_asked_and_counts_the_latest_occurrences():
    index = SuffixIndex(max_match=32, max_occurrences=2)
    text = list(range(100, 160))
    index.extend("old", [5, 6, 1] * 3)
    index.extend("new", [5, 6, 2] * 2)
    index.extend("text", text)
    match, length = index.match(text[:40])
    assert length == 32
    paths = index.continuations(match, budget=20, max_depth=16)
    assert [p.tokens for p in paths] == [text[40:40 + n] for n in range(1, 17)]
    assert {p.probability for p in paths} == {1.0}
    match, _ = index.match([5, 6])
    assert [p.tokens for p in index.continuations(match, budget=4, max_depth=1)] == [[2]]  # the 2 latest


# --- the drafter, its store, and hybrid trees --------------------------------------------------------------

import torch  # noqa: E402

from blockspec.decoding.sequence import GenerationConfig  # noqa: E402
from blockspec.drafters.dflash import DFlashDrafter  # noqa: E402
from blockspec.drafters.hybrid import HybridDrafter  # noqa: E402
from blockspec.drafters.suffix import SuffixDrafter, SuffixStore  # noqa: E402
from blockspec.sampling import SamplingConfig  # noqa: E402
from helpers import (  # noqa: E402
    MAX_NEW,
    PASS,
    PROMPT,
    SAMPLES,
    TWO_FAMILIES,
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


@pytest.fixture(scope="module", params=TWO_FAMILIES)
def world(request):
    target = make_causal_lm(request.param, vocab_size=320).double()
    return target, [(ids, hf_greedy(target, ids, MAX_NEW)) for ids in repetitive_prompts(320, 12, seed=8)]


def drafters(target):
    dflash = DFlashDrafter(make_dflash(target, block_size=8), target)
    return {"suffix": SuffixDrafter(SuffixStore()),
            "dflash+suffix": HybridDrafter(dflash, SuffixDrafter(SuffixStore())),
            "dflash+lookup": HybridDrafter(dflash, SuffixDrafter(None), name="dflash+lookup")}


@pytest.mark.parametrize("method", ["suffix", "dflash+suffix", "dflash+lookup"])
@pytest.mark.parametrize("tree_budget", [None, 12])
def test_suffix_and_hybrid_drafting_are_lossless(world, method, tree_budget):
    target, references = world
    drafter = drafters(target)[method]
    accepted = 0
    for ids, expected in references:
        config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8, tree_budget=tree_budget)
        stream = decode(target, ids, drafter, config)
        assert stream.token_ids == expected
        accepted += sum(stream.stats.accepted)  # each answer joins the store: later prompts may copy it
    assert accepted > 0


def test_a_finished_answer_is_kept_so_the_same_request_drafts_it_whole(world):
    target, references = world
    ids, expected = references[0]
    drafter = SuffixDrafter(SuffixStore())
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8)
    first = decode(target, ids, drafter, config)
    again = decode(target, ids, drafter, config)
    assert first.token_ids == again.token_ids == expected
    assert again.stats.accepted == [7] * (len(again.stats.accepted) - 1) + again.stats.accepted[-1:]
    assert len(again.stats.accepted) < len(first.stats.accepted)


def test_a_server_engine_keeps_each_namespace_to_its_own_answers(world):
    from blockspec.decoding.sequential import SequentialEngine

    target, references = world
    ids, expected = references[1]
    engine = SequentialEngine(target, SuffixDrafter(SuffixStore()))
    config = GenerationConfig(max_new_tokens=MAX_NEW, block_size=8)
    rows = [engine.add(ids, config, namespace=space) for space in ("alice", "alice", "bob")]
    list(engine.run())
    first, again, other = (row.stats for row in rows)
    assert all(row.sequence.token_ids == expected for row in rows)
    assert len(again.accepted) < len(first.accepted)
    assert other.accepted == first.accepted  # bob drafts from his own prompt only, as alice did at first


def test_the_store_keeps_to_its_size_and_evicts_the_oldest():
    store = SuffixStore(max_tokens=50, max_match=4)
    for key in range(6):
        store.add("k", [key] * 20)
    assert store.tokens <= 50
    held = {token for index in store.indexes.values() for key in range(6) if key in index
            for token in index.sequence(key)}
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
