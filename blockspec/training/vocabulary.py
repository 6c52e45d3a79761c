"""A draft vocabulary from data: the tokens a drafter should be able to propose.

The K most frequent tokens of the target's responses cover nearly every position it drafts
(on the shipped SmolLM2 data, 8192 of 49,152 leave 1.1% of held-out response tokens out).
Response caches count their responses; prompt files count the responses they give, and their
prompts fill the vocabulary when the responses hold fewer distinct tokens.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from blockspec.errors import BlockspecError
from blockspec.models.draft_vocab import most_frequent
from blockspec.training.prompts import load_prompts
from blockspec.training.response_cache import read_cache


def vocabulary_from_files(paths, tokenizer, size: int, *, always=(), vocab_size: int | None = None) -> torch.LongTensor:
    """The ``size`` target ids most frequent in the data at ``paths`` (``always`` in), sorted."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise BlockspecError(f"a draft vocabulary size must be a whole number >= 1, got {size!r}")
    if not paths:
        raise BlockspecError("a draft vocabulary needs data to count tokens in: give a response cache or prompt "
                             "files (--draft-vocab-data)")
    responses, prompts = Counter(), Counter()
    for path in map(Path, paths):
        if not path.is_file():
            raise BlockspecError(f"draft vocabulary data {path} does not exist")
        if _is_response_cache(path):
            for row in read_cache(path):
                responses.update(row["response_ids"])
                prompts.update(row["prompt_ids"])
            continue
        records, _ = load_prompts([path], shuffle=False)
        for record in records:
            prompts.update(tokenizer.encode("\n".join(m["content"] for m in record.messages), add_special_tokens=False))
            if record.response:
                responses.update(tokenizer.encode(record.response, add_special_tokens=False))
    vocab_size = vocab_size or len(tokenizer)
    if size >= vocab_size:
        raise BlockspecError(f"a draft vocabulary of {size} tokens is the whole {vocab_size}-token vocabulary: give "
                             "a smaller size, or none to draft over the whole vocabulary")
    counts = responses if responses else prompts
    return most_frequent(counts, size, always, fallback=prompts, vocab_size=vocab_size)


def target_vocabulary(target, paths, size: int) -> torch.LongTensor:
    """``vocabulary_from_files`` for a ``Target``: its tokenizer, its stop ids always in, its LM head's rows."""
    return vocabulary_from_files(paths, target.tokenizer, size, always=target.stop_token_ids(),
                                 vocab_size=head_rows(target))


def head_rows(target) -> int:
    """The rows of the target's LM head (its vocabulary as the drafters score it)."""
    return target.model.get_output_embeddings().weight.shape[0]


def _is_response_cache(path: Path) -> bool:
    """A blockspec response cache: jsonl rows with prompt_ids and response_ids."""
    if not path.name.endswith(".jsonl"):
        return False
    with path.open() as lines:
        first = lines.readline()
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and "response_ids" in row and "prompt_ids" in row
