"""Tree verification: a drafter's token tree (``blockspec.drafters.tree``) checked in ONE target forward.

A 4D attention mask lets each node see the cached context, the root and its own ancestors only,
and each node's position id is its depth after the root. Acceptance
(``blockspec.decoding.verifier.verify_tree``) walks down from the root; only the accepted path's
KV entries and features are kept.
"""

from __future__ import annotations

import torch

from blockspec.drafters.tree import Tree


def tree_attention_mask(tree: Tree, past_length: int, dtype, device) -> torch.Tensor:
    """Additive mask [1, 1, 1 + n, past + 1 + n]: the root and each node see the context and their own path."""
    size = 1 + len(tree)
    visible = torch.zeros(size, past_length + size, dtype=torch.bool)
    visible[:, :past_length + 1] = True  # the context and the root
    for node in range(len(tree)):
        for ancestor in tree.ancestors(node):
            visible[1 + node, past_length + 1 + ancestor] = True
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


def tree_position_ids(tree: Tree, start: int, device) -> torch.LongTensor:
    """Position of the root (``start``) and of each node (start + depth), [1, 1 + n]."""
    return torch.tensor([[start] + [start + d for d in tree.depths]], device=device)
