"""Where a context's suffix occurred before in some token sequences, and what followed it, how often.

The sequences lie end to end in one array, each closed by a separator, so the occurrences of a
context's last token are one vectorised scan, and each earlier token of the context narrows them
down: the survivors after ``n`` tokens are the places where the context's last ``n`` tokens occur.
The longest suffix that still occurs (followed by at least one token) is the match, and the tokens
after its occurrences, counted as a small trie, are the candidates suffix drafting proposes, each
scored by its empirical probability given the match (SuffixDecoding's frequency-scored suffix tree,
as Arctic Inference and vLLM build it, without its memory: 4 bytes per token, not a trie node per
token and depth).

Sequences grow as tokens are generated (``extend``) and leave whole (``remove``), which is how a
bounded store evicts its oldest entries; the holes they leave are compacted away when they fill half
the array.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

SEPARATOR = -1


@dataclass
class Continuation:
    """A path below a matched suffix: its tokens, the index of its parent path (-1: none), and its
    empirical probability given the suffix (the product of each step's share of its parent's count)."""

    tokens: list[int]
    parent: int
    probability: float


@dataclass
class Match:
    """The positions just after each occurrence of the matched suffix (most recent last)."""

    after: np.ndarray
    length: int


@dataclass
class _Node:
    count: int = 0
    children: dict[int, "_Node"] = field(default_factory=dict)


class SuffixIndex:
    """Token sequences, searchable for the occurrences of a context's longest suffix.

    ``max_match``: the longest suffix tried (tokens); ``max_occurrences``: the most recent occurrences
    whose continuations are counted (a common short suffix can occur thousands of times).
    """

    def __init__(self, max_match: int = 32, max_occurrences: int = 256):
        if max_match < 1 or max_occurrences < 1:
            raise ValueError(f"max_match and max_occurrences must be >= 1, got {max_match}, {max_occurrences}")
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self._buffer = np.full(1024, SEPARATOR, dtype=np.int32)
        self._used = 0
        self._spans: dict[object, tuple[int, int]] = {}  # key -> [start, end) in the buffer, separator at end
        self._holes = 0
        #: Tokens indexed, over every sequence.
        self.tokens = 0

    def __contains__(self, key) -> bool:
        return key in self._spans

    def sequence(self, key) -> list[int]:
        start, end = self._spans[key]
        return self._buffer[start:end].tolist()

    def extend(self, key, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new sequence when the key is new)."""
        if not len(tokens):
            return
        if key in self._spans and self._spans[key][1] + 1 != self._used:
            self._move_to_end(key)  # only the last sequence can grow in place
        start, end = self._spans.get(key, (self._used, self._used))
        self._reserve(end + len(tokens) + 1)
        self._buffer[end:end + len(tokens)] = tokens
        self._buffer[end + len(tokens)] = SEPARATOR
        self._spans[key] = (start, end + len(tokens))
        self.tokens += len(tokens)
        self._used = end + len(tokens) + 1

    def remove(self, key) -> None:
        """Take sequence ``key`` out of the index."""
        span = self._spans.pop(key, None)
        if span is None:
            return
        start, end = span
        self.tokens -= end - start
        self._buffer[start:end] = SEPARATOR
        self._holes += end - start + 1
        if self._holes * 2 > self._used:
            self._compact()

    def match(self, context: list[int]) -> tuple[Match | None, int]:
        """The occurrences of the longest suffix of ``context`` (at most ``max_match`` tokens) that the
        index holds followed by a token, and its length; (None, 0) when not even the last token is."""
        if not context:
            return None, 0
        tokens = self._buffer[:self._used]
        after = np.flatnonzero(tokens == context[-1]) + 1
        after = after[tokens[after] != SEPARATOR]  # the separator closing every sequence keeps this in range
        if not after.size:
            return None, 0
        length = 1
        while length < min(self.max_match, len(context)):
            before = after - length - 1
            narrowed = after[(before >= 0) & (tokens[np.maximum(before, 0)] == context[-length - 1])]
            if not narrowed.size:
                break
            after, length = narrowed, length + 1
        return Match(after, length), length

    def continuations(self, match: Match, budget: int, max_depth: int, min_probability: float = 0.0
                      ) -> list[Continuation]:
        """The ``budget`` most probable paths after ``match`` (parents before children), at most ``max_depth``
        tokens deep, each at least ``min_probability`` likely given the matched suffix."""
        root = self._count_following(match.after[-self.max_occurrences:], max_depth)
        found: list[Continuation] = []
        frontier = [(-1.0, 0, root, [], -1)]  # (-probability, tie-breaker, node, tokens, parent index)
        counter = 1
        while frontier and len(found) < budget:
            negative, _, here, tokens, parent = heapq.heappop(frontier)
            if tokens:
                found.append(Continuation(tokens, parent, -negative))
                parent = len(found) - 1
            total = sum(child.count for child in here.children.values())
            for token, child in here.children.items():
                probability = -negative * child.count / total
                if probability >= min_probability:
                    heapq.heappush(frontier, (-probability, counter, child, tokens + [token], parent))
                    counter += 1
        return found

    def _count_following(self, after: np.ndarray, max_depth: int) -> _Node:
        """A trie of the (up to ``max_depth``) tokens after each position, each node counting its paths."""
        columns = np.minimum(after[:, None] + np.arange(max_depth), self._used - 1)
        windows = self._buffer[columns].tolist()
        root = _Node()
        for window in windows:
            node = root
            for token in window:
                if token == SEPARATOR:
                    break
                node = node.children.setdefault(token, _Node())
                node.count += 1
        return root

    def _reserve(self, size: int) -> None:
        if size > len(self._buffer):
            grown = np.full(max(size, 2 * len(self._buffer)), SEPARATOR, dtype=np.int32)
            grown[:self._used] = self._buffer[:self._used]
            self._buffer = grown

    def _move_to_end(self, key) -> None:
        tokens = self.sequence(key)
        self.remove(key)
        self.extend(key, tokens)

    def _compact(self) -> None:
        kept = {key: self.sequence(key) for key in sorted(self._spans, key=lambda k: self._spans[k][0])}
        self._buffer[:self._used] = SEPARATOR
        self._used, self._holes, self._spans, self.tokens = 0, 0, {}, 0
        for key, tokens in kept.items():
            self.extend(key, tokens)
