"""A verify block, and every attention mask made from it.

A block is what one sequence sends through a verify forward: its last token (the root), then
its drafts, each with its parent among the drafts (-1: the root). A chain is the tree whose
draft i hangs under draft i - 1. Each row sees the context, the root and its own ancestors,
at the position of its depth after the root; in a sliding-window layer, only keys less than
``window`` positions behind it.

The target's caches lay the block out in three ways, each with its mask here: one sequence
over a dynamic cache (its context, then the block), a batch over one dynamic cache (each row's
valid columns, then the blocks), and the rows of a static cache (each block at its own row's
length).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


def chain_parents(count: int) -> list[int]:
    """The parents of ``count`` drafts that follow one another: each hangs under the one before."""
    return list(range(-1, count - 1))


@dataclass
class VerifyBlock:
    tokens: list[int]
    #: Position of the root.
    start: int
    #: Per draft, the index of its parent among the drafts (-1: the root); None: a chain.
    parents: list[int] | None = None

    def __post_init__(self):
        if self.parents is None:
            self.parents = chain_parents(len(self.tokens) - 1)
        if len(self.parents) != len(self.tokens) - 1:
            raise ValueError(f"a block of {len(self.tokens)} tokens has {len(self.tokens) - 1} drafts, "
                             f"not {len(self.parents)} parents")

    @property
    def width(self) -> int:
        return len(self.tokens)

    @cached_property
    def is_chain(self) -> bool:
        return self.parents == chain_parents(self.width - 1)

    @cached_property
    def depths(self) -> list[int]:
        """Per row (the root first), its depth after the root."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[1 + parent] + 1)
        return depths

    @cached_property
    def paths(self) -> list[list[int]]:
        """Per row (the root first), the drafted tokens from the root down to it (the root's: none)."""
        paths = [[]]
        for node, parent in enumerate(self.parents):
            paths.append(paths[1 + parent] + [self.tokens[1 + node]])
        return paths

    @cached_property
    def visibility(self) -> torch.Tensor:
        """[W, W] bool: which rows of the block each row sees (itself, the root and its ancestors)."""
        if self.is_chain:
            return torch.ones(self.width, self.width, dtype=torch.bool).tril()
        visible = torch.eye(self.width, dtype=torch.bool)
        visible[:, 0] = True
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                visible[1 + node] |= visible[1 + parent]
        return visible

    def position_ids(self, device) -> torch.LongTensor:
        """[1, W]: the root's position, then each draft's (the start plus its depth)."""
        return torch.tensor([[self.start + depth for depth in self.depths]], device=device)


def sequence_mask(block: VerifyBlock, layer_types: list[str] | None, window: int | None, dtype, device):
    """One sequence over a dynamic cache: None for a chain (the model's own causal mask); for a tree an
    additive mask [1, 1, W, context + W], or one per layer type where sliding layers hold less context
    (at most ``window - 1`` positions before the root)."""
    if block.is_chain:
        return None
    full = _context_then_block(block, block.start, None, dtype, device)
    if window is None:
        return full
    sliding = _context_then_block(block, min(block.start, window - 1), window, dtype, device)
    if layer_types is None:  # every layer slides (a window set for the whole model)
        return sliding
    return {kind: sliding if kind == "sliding_attention" else full for kind in set(layer_types)}


def _context_then_block(block: VerifyBlock, context: int, window: int | None, dtype, device) -> torch.Tensor:
    visible = torch.cat([torch.ones(block.width, context, dtype=torch.bool), block.visibility], dim=1)
    if window is not None:
        query_positions = torch.tensor(block.depths)
        key_positions = torch.cat([torch.arange(-context, 0), query_positions])
        visible &= query_positions.unsqueeze(1) - key_positions.unsqueeze(0) < window
    return additive(visible.unsqueeze(0), dtype).to(device)


def batch_masks(blocks: list[VerifyBlock], context_valid: torch.Tensor, context_positions: torch.Tensor,
                block_valid: torch.Tensor, block_positions: torch.Tensor, layer_types: list[str] | None,
                window: int | None, dtype):
    """A batch over one dynamic cache (``context_valid`` [B, L]: each row's real columns, at
    ``context_positions``), the blocks right-padded to W columns after it (``block_valid`` [B, W]).

    Chains without sliding layers: the 2D key mask [B, L + W] (the model adds the causal part). Else
    additive 4D masks [B, 1, W, L + W], one per layer type where sliding layers see less."""
    keys = torch.cat([context_valid, block_valid], dim=1)
    if window is None and all(block.is_chain for block in blocks):
        return keys
    width, length = block_valid.shape[1], context_valid.shape[1]
    seen = keys.unsqueeze(1).expand(-1, width, -1).clone()
    seen[:, :, length:] &= block_visibilities(blocks, width).to(seen.device)
    if window is None:
        return additive(seen, dtype)
    key_positions = torch.cat([context_positions, block_positions], dim=1)
    sliding = additive(seen & (block_positions.unsqueeze(2) - key_positions.unsqueeze(1) < window), dtype)
    if layer_types is None:
        return sliding
    full = additive(seen, dtype)
    return {kind: sliding if kind == "sliding_attention" else full for kind in set(layer_types)}


def block_visibilities(blocks: list[VerifyBlock], width: int) -> torch.Tensor:
    """[B, W, W]: what each row of each block sees of its block, padded to ``width`` (a padding row sees
    the rows before it: finite, and never seen by a real row)."""
    visible = torch.ones(len(blocks), width, width, dtype=torch.bool).tril()
    for r, block in enumerate(blocks):
        if not block.is_chain:
            visible[r, :block.width, :block.width] = block.visibility
    return visible


def static_mask(lengths: list[int], blocks: list[VerifyBlock], width: int, columns: int, device) -> torch.Tensor:
    """Rows of a static cache: [B, 1, width, columns] bool. Row b's queries see its kept columns and its
    block (written at columns ``lengths[b]``...) as the block's structure allows; padding queries (past a
    row's block) see their own column only, so they stay finite. The attention reads the cache's first
    ``columns`` columns (at least every row's length plus ``width``)."""
    mask = torch.zeros(len(lengths), 1, width, columns, dtype=torch.bool)
    for row, (length, block) in enumerate(zip(lengths, blocks)):
        used = block.width
        mask[row, 0, :used, :length] = True
        mask[row, 0, :used, length:length + used] = block.visibility
        padding = torch.arange(used, width)
        mask[row, 0, padding, length + padding] = True
    return mask.to(device)


def additive(visible: torch.Tensor, dtype) -> torch.Tensor:
    """A boolean mask [B, W, K] as an additive one [B, 1, W, K] (the smallest value, not -inf, where
    hidden: a padding query that sees nothing stays finite)."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return mask.masked_fill_(~visible, torch.finfo(dtype).min).unsqueeze(1)
