"""Logit adjustments (penalties, a bias, banned words, a grammar) applied to the target's scores at every
verified row.

Each row of a verified block predicts the token after its own path: the sequence so far, then the
drafts from the root down to that row. An adjustment that depends on the tokens before (a penalty on
repeats, a banned word's prefix) is applied to each row with that row's own context, so the verifier
compares the drafts against exactly the distribution plain decoding with the same adjustments would
sample from, and speculation stays lossless. The drafts themselves are not adjusted: they are only
proposals.

Semantics and order follow vLLM's sampler: banned words (a word's last token is banned where the
tokens generated so far end with the rest of it), then the bias, then the repetition penalty (over the
prompt and the output: a positive logit divided by it, a negative one multiplied), then the frequency
and presence penalties (over the output: subtracted per occurrence, and once).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from blockspec.decoding.block import VerifyBlock
from blockspec.decoding.grammar import GrammarState
from blockspec.decoding.verifier import TargetScores
from blockspec.errors import BlockspecError


@dataclass(frozen=True)
class LogitAdjustments:
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs added to those tokens' logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: Token sequences never generated: each one's last token is banned after the rest of it.
    bad_words_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise BlockspecError(f"repetition_penalty must be > 0 (1 switches it off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise BlockspecError(f"{name} must be a finite number (0 switches it off), got {getattr(self, name)}")
        if any(not math.isfinite(bias) for _, bias in self.logit_bias):
            raise BlockspecError("logit_bias values must be finite numbers")
        if any(len(word) == 0 for word in self.bad_words_ids):
            raise BlockspecError("bad_words_ids must not hold an empty sequence")

    @property
    def active(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias) or bool(self.bad_words_ids))

    def check_vocabulary(self, vocab_size: int) -> None:
        """Refuse token ids the target's vocabulary does not hold."""
        ids = [token for token, _ in self.logit_bias] + [token for word in self.bad_words_ids for token in word]
        outside = [token for token in ids if not 0 <= token < vocab_size]
        if outside:
            raise BlockspecError(f"token id {outside[0]} in logit_bias or bad_words_ids is outside the target's "
                                 f"vocabulary [0, {vocab_size})")


def bad_words_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's tokens as it starts the text and as it follows a space (vLLM's rule: banned either way)."""
    ids = []
    for word in words:
        if not word.strip():
            raise BlockspecError("a banned word must not be empty")
        for text in (word.lstrip(), " " + word.lstrip()):
            tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
            if tokens and tokens not in ids:
                ids.append(tokens)
    return tuple(ids)


def adjust_scores(scores: TargetScores, adjustments: LogitAdjustments, prompt_ids: torch.LongTensor,
                  output_ids: list[int], block: VerifyBlock | None = None) -> TargetScores:
    """The scores of a verified ``block`` (None: the prompt's last row) with each row adjusted in its own
    context: the prompt, the output so far (its last token is the block's root) and the row's path."""
    if not adjustments.active:
        return scores
    logits, paths = _rows(scores, block, "logit adjustment")
    logits = logits.clone()
    vocab = logits.shape[-1]
    _ban_words(logits, adjustments.bad_words_ids, output_ids, paths)
    if adjustments.logit_bias:
        ids = torch.tensor([token for token, _ in adjustments.logit_bias], device=logits.device)
        logits[:, ids] += torch.tensor([bias for _, bias in adjustments.logit_bias], device=logits.device)
    if adjustments.repetition_penalty == 1 and not adjustments.presence_penalty and not adjustments.frequency_penalty:
        return TargetScores(logits)
    counts = _output_counts(output_ids, paths, vocab, logits.device)
    if adjustments.repetition_penalty != 1:
        seen = (counts > 0) | (torch.bincount(prompt_ids.reshape(-1), minlength=vocab)[:vocab] > 0)
        penalised = torch.where(logits > 0, logits / adjustments.repetition_penalty,
                                logits * adjustments.repetition_penalty)
        logits = torch.where(seen, penalised, logits)
    logits -= adjustments.frequency_penalty * counts + adjustments.presence_penalty * (counts > 0).float()
    return TargetScores(logits)


def _output_counts(output_ids: list[int], paths: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[W, V]: how often each token occurs in each row's output (the output so far, then its path)."""
    base = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
    counts = base.to(device).unsqueeze(0).repeat(len(paths), 1)
    for row, path in enumerate(paths):
        if path:
            counts[row].index_add_(0, torch.tensor(path, device=device), torch.ones(len(path), device=device))
    return counts


def _ban_words(logits: torch.Tensor, words: tuple[tuple[int, ...], ...], output_ids: list[int],
               paths: list[list[int]]) -> None:
    """Ban each word's last token in the rows whose output ends with the rest of it."""
    if not words:
        return
    longest = max(len(word) for word in words)
    for row, path in enumerate(paths):
        recent = (output_ids[-longest:] + path)[-longest:] if longest > 1 else []
        for word in words:
            prefix = list(word[:-1])
            if not prefix or recent[-len(prefix):] == prefix:
                logits[row, word[-1]] = float("-inf")


def constrained_scores(scores: TargetScores, grammar: GrammarState, block: VerifyBlock | None = None) -> TargetScores:
    """The scores of a verified ``block`` (None: the prompt's last row) with each row masked to what the grammar
    allows after that row's path."""
    logits, paths = _rows(scores, block, "constrained decoding")
    return TargetScores(grammar.mask(logits, paths))


def _rows(scores: TargetScores, block: VerifyBlock | None, purpose: str) -> tuple[torch.Tensor, list[list[int]]]:
    """The rows to adjust (float32) and each one's path: a block's rows, or a prefill's last row (the one the
    first token is picked from)."""
    paths = block.paths if block is not None else [[]]
    return scores.logits_for(purpose)[-len(paths):].float(), paths
