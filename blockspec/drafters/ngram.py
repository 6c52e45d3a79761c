"""Prompt lookup: draft by copying what followed the last n-gram the context already holds.

No model and no training. The drafter keeps the sequence so far and an index from every
n-gram (min_ngram <= n <= max_ngram) to where its most recent occurrence ended; each
token is indexed once, so a lookup costs O(max_ngram) however long the context is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blockspec.drafters.base import Drafter, Proposal
from blockspec.errors import BlockspecError

# Copied spans are often long (code, quoted text), but on a CPU every extra verify
# position costs time (the target's forward grows with its width): 7 drafts per step is the middle ground.
DEFAULT_BLOCK_SIZE = 8


@dataclass(frozen=True)
class PromptLookupConfig:
    max_ngram: int = 3
    min_ngram: int = 1
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self):
        if self.min_ngram < 1:
            raise BlockspecError(f"min_ngram must be >= 1, got {self.min_ngram}")
        if self.max_ngram < self.min_ngram:
            raise BlockspecError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")
        if self.block_size < 1:
            raise BlockspecError(f"block_size must be >= 1, got {self.block_size}")


@dataclass
class LookupState:
    """One sequence: its tokens so far and where each n-gram's most recent occurrence ended."""

    device: torch.device
    tokens: list[int] = field(default_factory=list)
    #: n-gram -> the position right after its most recent occurrence that has a successor.
    continuations: dict[tuple[int, ...], int] = field(default_factory=dict)
    #: Whether ``propose`` already added the last token (the next commit starts with it).
    holds_last_token: bool = False


class PromptLookupDrafter(Drafter):
    """Proposes the continuation of the most recent earlier match of the longest suffix n-gram."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, block_size: int = DEFAULT_BLOCK_SIZE):
        self.config = PromptLookupConfig(max_ngram, min_ngram, block_size)
        self.default_block_size = block_size

    def start(self, prompt_ids, features) -> LookupState:
        state = LookupState(prompt_ids.device)
        self._extend(state, prompt_ids[0].tolist())
        return state

    def propose(self, state: LookupState, last_token, num_tokens, sampling, generator) -> Proposal:
        if not state.holds_last_token:
            self._extend(state, [last_token])
            state.holds_last_token = True
        draft = self.lookup(state, num_tokens)
        return Proposal(torch.tensor(draft, dtype=torch.long, device=state.device))

    def commit(self, state: LookupState, tokens, features) -> None:
        new = tokens[0].tolist()
        # tokens[0] is the last token, which ``propose`` has already added to the history.
        self._extend(state, new[1:] if state.holds_last_token else new)
        state.holds_last_token = False

    def lookup(self, state: LookupState, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens following the longest suffix n-gram's latest earlier match."""
        tokens = state.tokens
        for n in range(min(self.config.max_ngram, len(tokens)), self.config.min_ngram - 1, -1):
            start = state.continuations.get(tuple(tokens[-n:]))
            if start is not None:
                return _copy_from(tokens, start, num_tokens)
        return []

    def _extend(self, state: LookupState, new_tokens: list[int]) -> None:
        """Append tokens, indexing the n-grams that each new token follows."""
        low, high = self.config.min_ngram, self.config.max_ngram
        tokens = state.tokens
        for token in new_tokens:
            end = len(tokens)  # the n-grams ending just before ``token`` now have a successor
            for n in range(low, min(high, end) + 1):
                state.continuations[tuple(tokens[end - n:end])] = end
            tokens.append(token)


def _copy_from(tokens: list[int], start: int, num_tokens: int) -> list[int]:
    # Copy as LZ77 does: a match close to the end overlaps the draft itself, which
    # continues a repeating pattern instead of stopping at the end of the history.
    history = len(tokens)
    draft: list[int] = []
    for i in range(start, start + num_tokens):
        draft.append(tokens[i] if i < history else draft[i - history])
    return draft


def build(draft, target, *, max_ngram: int = 3, min_ngram: int = 1,
          block_size: int = DEFAULT_BLOCK_SIZE) -> PromptLookupDrafter:
    """Prompt lookup for any target (``draft`` is always None: nothing to load)."""
    return PromptLookupDrafter(max_ngram, min_ngram, block_size)
