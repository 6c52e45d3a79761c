"""Constrained decoding: the output follows a grammar (a JSON schema, a regex, a Lark grammar, a choice).

The grammar is compiled by llguidance against the target's tokenizer. Each sequence keeps a matcher
that has consumed its output so far. At a verified block every row is masked to the tokens the grammar
allows after that row's own path (the matcher consumes the path, gives its mask, and rolls back), so
the verifier compares the drafts against the distribution constrained plain decoding samples from:
greedy output equals constrained plain decoding token for token, and sampling keeps its distribution.
A row after a draft the grammar refuses is left as it is: the verifier cannot reach it, since that
draft has probability 0 under its own row's mask.
"""

from __future__ import annotations

import json
import re
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from blockspec.errors import BlockspecError

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(tokenizer) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: it reads the whole vocabulary)."""
    if tokenizer not in _TOKENIZERS:
        try:
            _TOKENIZERS[tokenizer] = llguidance.hf.from_tokenizer(tokenizer)
        except Exception as error:  # noqa: BLE001 - llguidance refuses tokenizers it cannot map to bytes
            raise BlockspecError(f"constrained decoding needs a fast byte-level tokenizer: {error}") from None
    return _TOKENIZERS[tokenizer]


@dataclass(frozen=True)
class Grammar:
    """What the output must match, compiled for one tokenizer (``Grammar.json_schema(tokenizer, schema)``...)."""

    #: llguidance's grammar text.
    source: str
    #: What it was made from, for messages ("JSON schema", "regex"...).
    kind: str
    tokenizer: llguidance.LLTokenizer = field(compare=False, repr=False)

    def __post_init__(self):
        error = llguidance.LLMatcher.validate_grammar(self.source, self.tokenizer)
        if error:
            raise BlockspecError(f"the {self.kind} cannot be used to constrain the output: {error}")

    @classmethod
    def json_schema(cls, tokenizer, schema: dict | str) -> Grammar:
        """Output that is one JSON value valid under ``schema`` (``{"type": "object"}``: any JSON object)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise BlockspecError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise BlockspecError(f"the JSON schema must be a JSON object, got {type(schema).__name__}")
        source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
        return cls(source, "JSON schema", grammar_tokenizer(tokenizer))

    @classmethod
    def regex(cls, tokenizer, pattern: str) -> Grammar:
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), "regex", grammar_tokenizer(tokenizer))

    @classmethod
    def choice(cls, tokenizer, choices: list[str]) -> Grammar:
        """Output that is exactly one of ``choices``."""
        if not choices:
            raise BlockspecError("a choice needs at least one option")
        pattern = "|".join(f"({re.escape(choice)})" for choice in choices)
        return cls(llguidance.LLMatcher.grammar_from_regex(pattern), "choice", grammar_tokenizer(tokenizer))

    @classmethod
    def lark(cls, tokenizer, grammar: str) -> Grammar:
        """A Lark grammar (llguidance's dialect); a GBNF one (llama.cpp's, vLLM's EBNF) is converted first."""
        try:
            grammar = any_to_lark(grammar)
        except GbnfToLarkError as error:
            raise BlockspecError(f"the GBNF grammar does not parse: {error}") from None
        return cls(llguidance.LLMatcher.grammar_from_lark(grammar), "grammar", grammar_tokenizer(tokenizer))

    def start(self) -> GrammarState:
        """A new sequence's matcher."""
        return GrammarState(llguidance.LLMatcher(self.tokenizer, self.source), self.tokenizer.vocab_size)


class GrammarState:
    """One sequence's matcher: it has consumed the sequence's output so far."""

    def __init__(self, matcher: llguidance.LLMatcher, tokenizer_vocab: int):
        self.matcher = matcher
        #: The tokenizer's ids the matcher masks (a model's padded embedding may score more).
        self.tokenizer_vocab = tokenizer_vocab
        self._bits = torch.arange(32, dtype=torch.int32)

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> torch.Tensor:
        """``logits`` [W, V] with each row's disallowed tokens at -inf, after the output and that row's path."""
        bitmask = llguidance.torch.allocate_token_bitmask(len(paths), self.tokenizer_vocab)
        reachable = torch.ones(len(paths), dtype=torch.bool)
        for row, path in enumerate(paths):
            with self._after(path) as allowed:
                if allowed:
                    llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)
                else:
                    reachable[row] = False
        allowed = ((bitmask.unsqueeze(-1) >> self._bits) & 1).bool().view(len(paths), -1)
        allowed = _fit(allowed[:, :self.tokenizer_vocab], logits.shape[-1]).to(logits.device)
        allowed[~reachable.to(logits.device)] = True
        return logits.masked_fill(~allowed, float("-inf"))

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next (the only way on from the output so far; none when it has a choice)."""
        return [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())

    def allowed_paths(self, paths: list[list[int]]) -> list[bool]:
        """Per path (after the output so far), whether the grammar allows every token of it."""
        allowed = []
        for path in paths:
            with self._after(path) as ok:
                allowed.append(ok)
        return allowed

    @contextmanager
    def _after(self, path: list[int]):
        """The matcher after the output so far and ``path`` (whether the grammar allows all of it), put back after."""
        consumed = self.matcher.try_consume_tokens(path) if path else 0
        try:
            yield consumed == len(path)
        finally:
            self.matcher.rollback(consumed)

    def advance(self, tokens: list[int]) -> None:
        """The sequence's new output tokens (each one its mask allowed)."""
        if tokens and not self.matcher.is_stopped():
            self.matcher.try_consume_tokens(tokens)


def _fit(allowed: torch.Tensor, vocab: int) -> torch.Tensor:
    """The tokenizer's mask over the model's vocabulary (ids only a padded embedding has are never allowed)."""
    if allowed.shape[-1] >= vocab:
        return allowed[:, :vocab]
    return torch.cat([allowed, allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[-1])], dim=-1)
