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
