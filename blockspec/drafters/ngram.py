"""Prompt lookup: draft by copying what followed the last n-gram the context already holds.

No model and no training. The drafter keeps the sequence so far and an index from every
n-gram (min_ngram <= n <= max_ngram) to where its most recent occurrence ended; each
token is indexed once, so a lookup costs O(max_ngram) however long the context is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockspec.decoding.drafter import Proposal
from blockspec.errors import BlockspecError

# Copied spans are often long (code, quoted text), but on a CPU every extra verify
# position costs time (DESIGN section 6): 7 drafts per step is the middle ground.
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


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier match of the longest suffix n-gram."""

    name = "ngram"
    feature_layers = None
    max_draft_tokens = None

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, block_size: int = DEFAULT_BLOCK_SIZE):
        self.config = PromptLookupConfig(max_ngram, min_ngram, block_size)
        self.default_block_size = block_size
        self.tokens: list[int] = []
        #: n-gram -> the position right after its most recent occurrence that has a successor.
        self.continuations: dict[tuple[int, ...], int] = {}
        self.holds_last_token = False
        self.device = torch.device("cpu")

    def begin(self, prompt_ids, features):
        self.device = prompt_ids.device
        self.tokens, self.continuations = [], {}
        self.holds_last_token = False
        self._extend(prompt_ids[0].tolist())

    def propose(self, last_token, num_tokens, sampling, generator) -> Proposal:
        if not self.holds_last_token:
            self._extend([last_token])
            self.holds_last_token = True
        draft = self.lookup(num_tokens)
        return Proposal(torch.tensor(draft, dtype=torch.long, device=self.device))

    def commit(self, tokens, features):
        new = tokens[0].tolist()
        # tokens[0] is the last token, which ``propose`` has already added to the history.
        self._extend(new[1:] if self.holds_last_token else new)
        self.holds_last_token = False

    def lookup(self, num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` tokens following the longest suffix n-gram's latest earlier match."""
        for n in range(min(self.config.max_ngram, len(self.tokens)), self.config.min_ngram - 1, -1):
            start = self.continuations.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self._copy_from(start, num_tokens)
        return []

    def _copy_from(self, start: int, num_tokens: int) -> list[int]:
        # Copy as LZ77 does: a match close to the end overlaps the draft itself, which
        # continues a repeating pattern instead of stopping at the end of the history.
        history = len(self.tokens)
        draft: list[int] = []
        for i in range(start, start + num_tokens):
            draft.append(self.tokens[i] if i < history else draft[i - history])
        return draft

    def _extend(self, new_tokens: list[int]) -> None:
        """Append tokens, indexing the n-grams that each new token follows."""
        low, high = self.config.min_ngram, self.config.max_ngram
        for token in new_tokens:
            end = len(self.tokens)  # the n-grams ending just before ``token`` now have a successor
            for n in range(low, min(high, end) + 1):
                self.continuations[tuple(self.tokens[end - n:end])] = end
            self.tokens.append(token)
