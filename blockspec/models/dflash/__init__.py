"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass (or a few).

The drafter reads hidden states of several target layers (the context features), projects
them with ``fc`` + ``hidden_norm`` and injects them as extra keys and values into the
attention of EVERY draft layer. Queries come from the block only: the embeddings of
[last accepted token, MASK, ..., MASK]. Attention inside the block is bidirectional. The
target's embedding matrix and LM head are used as they are (passed in, never copied).

Checkpoints (``checkpoint.py``) use the layout of the public DFlash drafts (``save_pretrained``): a qwen3
``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``num_target_layers`` and a
``dflash_config`` dict, and weights ``layers.N.*``, ``fc.weight``, ``hidden_norm.weight``,
``norm.weight``. Every config key the public drafts use (and vLLM's DFlash loader honours) is
read: per-layer sliding windows and causality, attention sinks, the target's width, the rotary
layout, a separate mask embedding, a logit scale; what cannot be honoured is refused by name.
"""

