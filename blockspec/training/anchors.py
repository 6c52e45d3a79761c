"""Training blocks for DFlash: anchors, block inputs, labels, loss weights, attention masks.

A training sequence is the prompt plus the target's own response. An anchor is a position
``a`` inside the response: the block is [token a, MASK x (B-1)] at positions a..a+B-1, and
block position k (k >= 1) is labelled with token a+k. The block sees the target's context
features of every position before ``a`` and its own block (bidirectionally), nothing else:
exactly what the drafter sees at inference, where the features of ``a`` are not known yet.
Many anchors of one sequence train in one forward through a block-sparse attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def loss_weights(block_size: int, gamma: float | None) -> torch.Tensor:
    """w_k for block positions k = 0..B-1: 0 at the anchor, exp(-(k-1)/gamma) after it.

    gamma None means uniform weights (the ablation without decay).
    """
    k = torch.arange(block_size, dtype=torch.float32)
    weights = torch.ones(block_size) if gamma is None else torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for block 16, 5 for block 10, 4 for block 8."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 7.0 * block_size / 16))


def candidate_anchors(loss_mask: torch.BoolTensor, length: int) -> torch.LongTensor:
    """Positions a whose next token a+1 is supervised (a response token)."""
    supervised_next = loss_mask[1:length]
    return torch.nonzero(supervised_next, as_tuple=False).flatten()


def choose_anchors(loss_mask, length, num_anchors, block_size, generator, random_anchors=True):
    """Up to ``num_anchors`` sorted anchor positions.

    Random anchors: a uniform sample of the candidates. Fixed blocks (the ablation): the
    response cut into consecutive blocks, starting at its first anchor.
    """
    candidates = candidate_anchors(loss_mask, length)
    if candidates.numel() == 0:
        return candidates
    if random_anchors:
        order = torch.randperm(candidates.numel(), generator=generator)[:num_anchors]
        return candidates[order].sort().values
    first = int(candidates[0])
    fixed = torch.arange(first, length - 1, block_size)
    fixed = fixed[torch.isin(fixed, candidates)]
    if fixed.numel() > num_anchors:
        start = int(torch.randint(0, fixed.numel() - num_anchors + 1, (1,), generator=generator))
        fixed = fixed[start:start + num_anchors]
    return fixed


@dataclass
class BlockBatch:
    """Everything the drafter's training forward needs, for B sequences of N anchors each."""

    block_ids: torch.LongTensor       # [B, N*S] anchor token then masks, per block
    block_positions: torch.LongTensor  # [B, N*S]
    labels: torch.LongTensor          # [B, N*S] (ignored where weights are 0)
    weights: torch.Tensor             # [B, N*S] loss weight of each block position
    attention_mask: torch.BoolTensor  # [B, 1, N*S, T + N*S] True = visible
    context_positions: torch.LongTensor  # [B, T]


def build_blocks(input_ids, loss_mask, lengths, *, block_size, num_anchors, mask_token_id,
                 gamma, generator, random_anchors=True) -> BlockBatch:
    """Blocks for a padded batch: input_ids/loss_mask [B, T], lengths [B]."""
    batch, context_length = input_ids.shape
    size = num_anchors * block_size
    block_ids = torch.full((batch, size), mask_token_id, dtype=torch.long)
    positions = torch.zeros((batch, size), dtype=torch.long)
    labels = torch.zeros((batch, size), dtype=torch.long)
    weights = torch.zeros((batch, size))
    visible = torch.zeros((batch, size, context_length + size), dtype=torch.bool)
    per_position = loss_weights(block_size, gamma)
    offsets = torch.arange(block_size)
    for row in range(batch):
        length = int(lengths[row])
        anchors = choose_anchors(loss_mask[row], length, num_anchors, block_size, generator, random_anchors)
        for slot, anchor in enumerate(anchors.tolist()):
            span = slice(slot * block_size, (slot + 1) * block_size)
            targets = anchor + offsets
            inside = targets < length
            clipped = targets.clamp(max=length - 1)
            block_ids[row, span.start] = input_ids[row, anchor]
            positions[row, span] = targets
            labels[row, span] = input_ids[row, clipped]
            supervised = inside & loss_mask[row, clipped]
            weights[row, span] = per_position * supervised
            visible[row, span, :anchor] = True  # the context before the anchor
            visible[row, span, context_length + span.start:context_length + span.stop] = True
        # unused slots see their own block only, so attention never meets an empty row
        for slot in range(len(anchors), num_anchors):
            span = slice(slot * block_size, (slot + 1) * block_size)
            visible[row, span, context_length + span.start:context_length + span.stop] = True
    return BlockBatch(block_ids, positions, labels, weights, visible.unsqueeze(1),
                      torch.arange(context_length).expand(batch, -1))
