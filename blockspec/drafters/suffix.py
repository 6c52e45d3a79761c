"""Suffix drafting: candidates copied from what followed the current context before, scored by frequency.

Each sequence indexes its own prompt and output (a ``SuffixIndex``); a ``SuffixStore`` shared by a
process (a server's requests) adds the outputs of earlier requests, one index per namespace (an
API key: no text crosses from one key to another), bounded in tokens with the oldest outputs
evicted first. A draft starts at the longest suffix of the context either index has seen; the paths
below it are scored by their empirical probability (each step's share of its parent's count), the
two indexes' paths merged by their better score, and the best of them form a token tree (or, for a
chain, its most probable path). How deep it goes follows the match: ``depth_per_match`` tokens per
matched token (SuffixDecoding's adaptive speculation length), so a long verbatim match drafts far
and a one-token coincidence drafts little.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from blockspec.drafters.base import Proposal, TreeDrafter
from blockspec.drafters.suffix_index import Continuation, SuffixIndex
from blockspec.drafters.tree import Tree
from blockspec.errors import BlockspecError

#: The longest suffix of a context that is looked for (tokens).
DEFAULT_MAX_MATCH = 32

DEFAULT_BLOCK_SIZE = 16


class SuffixStore:
    """Earlier requests' outputs, per namespace, at most ``max_tokens`` in all (the oldest evicted first).

    Shared by a server's requests (thread-safe: the engine thread reads while handlers finish requests).
    """

    def __init__(self, max_tokens: int = 1_000_000, max_match: int = DEFAULT_MAX_MATCH):
        if max_tokens < 1:
            raise BlockspecError(f"the suffix store's size must be >= 1 token, got {max_tokens}")
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.indexes: dict[str | None, SuffixIndex] = {}
        self._order: OrderedDict[int, str | None] = OrderedDict()  # sequence id -> namespace, oldest first
        self._next_id = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return sum(index.tokens for index in self.indexes.values())

    def add(self, namespace: str | None, tokens: list[int]) -> None:
        """Remember one output; evict the oldest outputs while over the size."""
        tokens = list(tokens)[-self.max_tokens:]
        if not tokens:
            return
        with self._lock:
            index = self.indexes.setdefault(namespace, SuffixIndex(self.max_match))
            index.extend(self._next_id, tokens)
            self._order[self._next_id] = namespace
            self._next_id += 1
            while self.tokens > self.max_tokens:
                oldest, space = self._order.popitem(last=False)
                self.indexes[space].remove(oldest)
                if not self.indexes[space].tokens:
                    del self.indexes[space]

    def continuations(self, namespace: str | None, context: list[int], budget: int, max_depth: int,
                      min_probability: float) -> tuple[list[Continuation], int]:
        with self._lock:
            index = self.indexes.get(namespace)
            return _continuations(index, context, budget, max_depth, min_probability) if index else ([], 0)


@dataclass
class SuffixState:
    """One sequence: its own index over prompt and output, and the tokens so far."""

    index: SuffixIndex
    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    device: torch.device = torch.device("cpu")


class SuffixDrafter(TreeDrafter):
    """Drafts what followed the longest matching suffix, in this sequence and in the shared store's outputs."""

    name = "suffix"

    def __init__(self, store: SuffixStore | None = None, namespace: str | None = None, *,
                 block_size: int = DEFAULT_BLOCK_SIZE, depth_per_match: float = 4.0, min_probability: float = 0.1,
                 max_match: int = DEFAULT_MAX_MATCH):
        if block_size < 1 or depth_per_match <= 0 or not 0 <= min_probability <= 1:
            raise BlockspecError("suffix drafting needs block_size >= 1, depth_per_match > 0 and "
                                 f"0 <= min_probability <= 1, got {block_size}, {depth_per_match}, {min_probability}")
        self.store = store
        self.namespace = namespace
        self.default_block_size = block_size
        self.depth_per_match = depth_per_match
        self.min_probability = min_probability
        self.max_match = max_match

    def for_namespace(self, namespace: str | None) -> "SuffixDrafter":
        """The same drafter over the same store, reading and remembering under ``namespace``."""
        return SuffixDrafter(self.store, namespace, block_size=self.default_block_size,
                             depth_per_match=self.depth_per_match, min_probability=self.min_probability,
                             max_match=self.max_match)

    def remember(self, tokens: list[int]) -> None:
        """Add a text (token ids) to the shared store (nothing without one)."""
        if self.store is not None:
            self.store.add(self.namespace, tokens)

    def finish(self, state: SuffixState, output_ids: list[int]) -> None:
        """Keep the answer, after the end of its prompt (so a request asked again matches from its first token)."""
        prompt_tail = state.tokens[max(0, state.prompt_length - self.max_match):state.prompt_length]
        self.remember(prompt_tail + list(output_ids))

    def start(self, prompt_ids, features) -> SuffixState:
        state = SuffixState(SuffixIndex(self.max_match), prompt_ids.shape[1], device=prompt_ids.device)
        self._append(state, prompt_ids[0].tolist())
        return state

    def commit(self, state: SuffixState, tokens, features) -> None:
        self._append(state, tokens[0].tolist())

    def propose(self, state: SuffixState, last_token, num_tokens, sampling, generator) -> Proposal:
        paths = self.candidates(state, last_token, budget=num_tokens, max_depth=num_tokens)
        return paths_to_chain(paths, state.device)

    def draft_tree(self, state: SuffixState, last_token: int, depth: int, budget: int,
                   top_k: int) -> tuple[Tree, list[float]]:
        return paths_to_tree(self.candidates(state, last_token, budget=budget, max_depth=depth), top_k)

    def candidates(self, state: SuffixState, last_token: int, *, budget: int, max_depth: int) -> list[Continuation]:
        """The most probable continuations of the context and ``last_token``, from both indexes, merged."""
        context = state.tokens[-self.max_match:] + [last_token]
        own, matched = _continuations(state.index, context, budget, max_depth, self.min_probability)
        shared, shared_match = ([], 0) if self.store is None else \
            self.store.continuations(self.namespace, context, budget, max_depth, self.min_probability)
        reach = math.ceil(self.depth_per_match * max(matched, shared_match))
        return merge_paths([own, shared], budget, min(max_depth, reach))

    def _append(self, state: SuffixState, tokens: list[int]) -> None:
        state.tokens.extend(tokens)
        state.index.extend(0, tokens)


def _continuations(index: SuffixIndex, context, budget, max_depth, min_probability):
    match, length = index.match(context)
    if match is None:
        return [], 0
    return index.continuations(match, budget, max_depth, min_probability), length


def merge_paths(sources: list[list[Continuation]], budget: int, max_depth: int) -> list[Continuation]:
    """One list of paths (parents first, most probable first) from several: each path at its best score.

    A path is never more probable than its parent in any source, so neither is its best score than
    its parent's: sorting by score (shorter first on ties) keeps every parent ahead of its children.
    """
    best: dict[tuple[int, ...], float] = {}
    for paths in sources:
        for path in paths:
            key = tuple(path.tokens)
            if len(key) <= max_depth and path.probability > best.get(key, 0.0):
                best[key] = path.probability
    ordered = sorted(best.items(), key=lambda item: (-item[1], len(item[0])))
    chosen, position = [], {}
    for tokens, probability in ordered:
        parent = position.get(tokens[:-1], -1) if len(tokens) > 1 else -1
        if len(tokens) > 1 and parent < 0:
            continue  # its parent did not make the budget
        position[tokens] = len(chosen)
        chosen.append(Continuation(list(tokens), parent, probability))
        if len(chosen) == budget:
            break
    return chosen


def paths_to_tree(paths: list[Continuation], top_k: int) -> tuple[Tree, list[float]]:
    """A token tree from paths listed parents first, at most ``top_k`` children per node, and each kept
    node's confidence: P(node | its parent), its path's probability over its parent's."""
    tokens, parents, depths, children = [], [], [], {}
    kept = {}
    for index, path in enumerate(paths):
        parent = kept.get(path.parent, -1) if path.parent >= 0 else -1
        if path.parent >= 0 and path.parent not in kept:
            continue
        if children.get(parent, 0) >= top_k:
            continue
        children[parent] = children.get(parent, 0) + 1
        kept[index] = len(tokens)
        tokens.append(path.tokens[-1])
        parents.append(parent)
        depths.append(len(path.tokens))
    confidences = [_node_confidence(paths, index) for index in kept]
    return Tree(tokens, parents, depths), confidences


def paths_to_chain(paths: list[Continuation], device) -> Proposal:
    """The most probable path as a chain proposal, each draft's confidence P(token | the path before it)."""
    chain = _best_chain(paths)
    return Proposal(torch.tensor([p.tokens[-1] for p in chain], dtype=torch.long, device=device),
                    confidence=torch.tensor([_step_probability(chain, i) for i in range(len(chain))]))


def _node_confidence(paths: list[Continuation], index: int) -> float:
    """P(node | its parent path): its path's score over its parent's."""
    path = paths[index]
    before = paths[path.parent].probability if path.parent >= 0 else 1.0
    return min(1.0, path.probability / before) if before > 0 else 0.0


def _best_chain(paths: list[Continuation]) -> list[Continuation]:
    """The most probable path, node by node: from the root, the most probable child each time."""
    chain, parent = [], -1
    while True:
        child = next((p for p in paths if p.parent == parent and len(p.tokens) == len(chain) + 1), None)
        if child is None:
            return chain
        chain.append(child)
        parent = paths.index(child)


def _step_probability(chain: list[Continuation], index: int) -> float:
    """P(token i | the path before it): the path probabilities' ratio."""
    before = chain[index - 1].probability if index > 0 else 1.0
    return chain[index].probability / before if before > 0 else 0.0


def build(draft, target, *, block_size: int = DEFAULT_BLOCK_SIZE, depth_per_match: float = 4.0,
          min_probability: float = 0.1) -> SuffixDrafter:
    """Suffix drafting for any target (``draft`` is always None: nothing to load), with a store of its own."""
    return SuffixDrafter(SuffixStore(), block_size=block_size, depth_per_match=depth_per_match,
                         min_probability=min_probability)
