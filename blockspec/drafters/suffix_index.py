"""A suffix trie of token sequences: how often each short run of tokens followed each context.

Every substring of up to ``depth`` tokens of every indexed sequence is a path from the root, and a
node counts the positions where its path occurs. So the longest suffix of a context that the
index has seen is found by walking down from the root, and the node reached lists what followed
that suffix and how often: the candidates suffix drafting proposes (SuffixDecoding's suffix tree,
bounded in depth, as Arctic Inference and vLLM build it).

Sequences grow as tokens are generated (``extend``: O(depth) per token, through the nodes of the
sequence's current suffixes), and leave the index whole (``remove``), which is how a bounded store
evicts its oldest entries.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass
class Node:
    count: int = 0
    children: dict[int, "Node"] = field(default_factory=dict)


@dataclass
class Continuation:
    """A path below a matched suffix: its tokens, the index of its parent path (-1: none), and its
    empirical probability given the suffix (the product of each step's share of its parent's count)."""

    tokens: list[int]
    parent: int
    probability: float


class SuffixIndex:
    """Counts of every run of up to ``depth`` tokens over the indexed sequences."""

    def __init__(self, depth: int = 32):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = Node()
        self.sequences: dict[object, list[int]] = {}
        #: Per sequence: the nodes of its suffixes of length 1..depth-1 (the ones a new token extends).
        self._open: dict[object, list[Node]] = {}

    @property
    def tokens(self) -> int:
        """Tokens indexed, over every sequence."""
        return sum(len(tokens) for tokens in self.sequences.values())

    def extend(self, key, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``key`` (a new sequence when the key is new)."""
        sequence = self.sequences.setdefault(key, [])
        open_nodes = self._open.setdefault(key, [])
        for token in tokens:
            sequence.append(token)
            grown = []
            for node in [self.root] + open_nodes:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += 1
                grown.append(child)
            # grown[j] is the suffix of length j + 1; the longest, at the depth limit, extends no further
            open_nodes[:] = grown[: self.depth - 1]

    def remove(self, key) -> None:
        """Take sequence ``key`` out of the index (its counts subtracted, emptied nodes dropped)."""
        sequence = self.sequences.pop(key, None)
        self._open.pop(key, None)
        if not sequence:
            return
        for start in range(len(sequence)):
            self._forget(sequence[start:start + self.depth])

    def _forget(self, run: list[int]) -> None:
        node, path = self.root, []
        for token in run:
            child = node.children[token]
            path.append((node, token, child))
            node = child
        for parent, token, child in path:
            child.count -= 1
        for parent, token, child in reversed(path):
            if child.count == 0:
                del parent.children[token]

    def match(self, context: list[int]) -> tuple[Node | None, int]:
        """The node of the longest suffix of ``context`` (at most depth - 1 tokens, so that something can
        follow it) that the index holds, and its length; (None, 0) when not even the last token is known."""
        for length in range(min(self.depth - 1, len(context)), 0, -1):
            node = self._walk(context[len(context) - length:])
            if node is not None and node.children:
                return node, length
        return None, 0

    def _walk(self, run: list[int]) -> Node | None:
        node = self.root
        for token in run:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def continuations(self, node: Node, budget: int, max_depth: int, min_probability: float = 0.0
                      ) -> list[Continuation]:
        """The ``budget`` most probable paths below ``node`` (parents before children), at most ``max_depth``
        tokens deep, each at least ``min_probability`` likely given the matched suffix."""
        found: list[Continuation] = []
        # heap of (-probability, tie-breaker, node, tokens so far, parent index)
        frontier = [(-1.0, 0, node, [], -1)]
        counter = 1
        while frontier and len(found) < budget:
            negative, _, here, tokens, parent = heapq.heappop(frontier)
            if tokens:
                found.append(Continuation(tokens, parent, -negative))
                parent = len(found) - 1
            if len(tokens) >= max_depth:
                continue
            total = sum(child.count for child in here.children.values())
            for token, child in here.children.items():
                probability = -negative * child.count / total
                if probability >= min_probability:
                    heapq.heappush(frontier, (-probability, counter, child, tokens + [token], parent))
                    counter += 1
        return found
