"""Training samples: prompt + response token ids, with a loss mask on the response."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from blockspec.errors import BlockspecError
from blockspec.training.response_cache import read_cache


@dataclass
class TrainingSample:
    """Prompt + response token ids; `loss_mask` is True on the response tokens only
    (including a final stop token that the target generated)."""

    input_ids: torch.LongTensor
    loss_mask: torch.BoolTensor
    id: str = ""

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


def make_sample(prompt_ids: list[int], response_ids: list[int], id: str = "", *,
                max_length: int | None = None) -> TrainingSample | None:
    """The sample of one prompt and response, cut to `max_length` tokens (the response's end
    goes first); None when no response token is left."""
    ids = prompt_ids + response_ids
    if max_length is not None:
        ids = ids[:max_length]
    if len(ids) <= len(prompt_ids):
        return None
    mask = torch.zeros(len(ids), dtype=torch.bool)
    mask[len(prompt_ids):] = True
    return TrainingSample(input_ids=torch.tensor(ids, dtype=torch.long), loss_mask=mask, id=id)


def load_samples(
    cache_path: str | os.PathLike,
    *,
    max_length: int | None = None,
    only_finished: bool = False,
) -> list[TrainingSample]:
    """Training samples from a response cache.

    `max_length` cuts each sequence to that many tokens (the response's end goes first);
    a sample left without response tokens is dropped. `only_finished` keeps only responses
    that ended on a stop token.
    """
    if max_length is not None and max_length < 2:
        raise BlockspecError(f"max_length must be >= 2 tokens, got {max_length}")
    rows = [row for row in read_cache(cache_path) if row.get("finished", False) or not only_finished]
    samples = [make_sample(row["prompt_ids"], row["response_ids"], row["id"], max_length=max_length) for row in rows]
    return [sample for sample in samples if sample is not None]


def pad_batch(samples, pad_id: int = 0) -> tuple[torch.LongTensor, torch.BoolTensor, torch.LongTensor]:
    """Right-pad a list of TrainingSamples with ``pad_id``: (input_ids, loss_mask, lengths)."""
    lengths = torch.tensor([s.input_ids.numel() for s in samples])
    width = int(lengths.max())
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for row, sample in enumerate(samples):
        ids[row, : lengths[row]] = sample.input_ids
        mask[row, : lengths[row]] = sample.loss_mask
    return ids, mask, lengths
