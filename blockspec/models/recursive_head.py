"""Drafters that run ONE decoder layer recursively on their own hidden states: EAGLE-3 and MTP.

Both pair the target's feature at a committed position i with the embedding of token i+1
and run one decoder layer (with its own KV cache) whose output predicts token i+2. To draft
further, a step's output hidden state stands in for the target feature of the next position
and the drafted token's embedding is paired with it. Training unrolls the same recursion
("training-time test"): step k at index i sees the real step-0 keys of positions <= i and
the keys of its own chain's earlier steps, exactly what it sees at inference.

The draft vocabulary may be a subset of the target's (vocabulary compression): ``d2t`` holds
for each draft id the offset to its target id (target = draft + d2t[draft]) and ``t2d``
marks the target ids that are in the draft vocabulary, as the public EAGLE-3 checkpoints do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from blockspec.models.dflash.modules import apply_rope
from blockspec.models.draft_vocab import DraftVocabulary

KeyValues = tuple[torch.Tensor, torch.Tensor]


class CachedAttention(nn.Module):
    """Causal self-attention over [cached keys ; new keys], Llama-style (no q/k norms)."""

    def __init__(self, config, input_size: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def _heads(self, x, proj, count):
        batch, length, _ = x.shape
        return proj(x).view(batch, length, count, self.head_dim).transpose(1, 2)

    def forward(self, x, rope, past: KeyValues | None, mask) -> tuple[torch.Tensor, KeyValues]:
        """Output [B, T, D] and this call's own keys/values (the caller keeps the cache)."""
        queries = apply_rope(self._heads(x, self.q_proj, self.num_heads), *rope)
        keys = apply_rope(self._heads(x, self.k_proj, self.num_kv_heads), *rope)
        values = self._heads(x, self.v_proj, self.num_kv_heads)
        all_keys = keys if past is None else torch.cat([past[0], keys], dim=-2)
        all_values = values if past is None else torch.cat([past[1], values], dim=-2)
        out = F.scaled_dot_product_attention(queries, all_keys, all_values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1)), (keys, values)


class RecursiveDraftModel(DraftVocabulary, nn.Module):
    """What EAGLE-3 and MTP share: the recursion, the masks, the draft vocabulary maps.

    A subclass (also a ``PreTrainedModel``) provides ``self.layer`` (the one decoder layer,
    called as layer(embeddings, hidden, rope, past, mask)), ``self.rotary_emb``, ``fuse``
    (target features -> hidden width) and ``head_logits`` (hidden -> draft-vocabulary logits).
    """

    #: Target layers read, in blockspec's ``hidden_states[i + 1]`` convention.
    feature_layers: list[int]

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self, embeddings, hidden, position_ids, past: KeyValues | None = None, mask=None):
        """One pass of the layer: (output hidden [B, T, D], new keys/values)."""
        rope = self.rotary_emb(hidden, position_ids)
        return self.layer(embeddings, hidden, rope, past, mask)

    # --- training: the unrolled recursion -----------------------------------------------

    def forward(self, token_embeddings, features, lengths, num_steps: int) -> list[torch.Tensor]:
        """Draft-vocabulary logits of each unrolled step, [B, T, K] each ("training-time test").

        token_embeddings: [B, T, D] embeddings of the sequence's tokens; features: [B, T, F].
        Step k's row i pairs the hidden state for position i+k with token i+k+1 and predicts
        token i+k+2.
        """
        batch, length, _ = token_embeddings.shape
        device = token_embeddings.device
        index = torch.arange(length, device=device)
        context_visible = (index[None, :] <= index[:, None]) & (index[None, :] < lengths[:, None, None])
        chain_visible = torch.eye(length, dtype=torch.bool, device=device).expand(batch, -1, -1)
        hidden = self.fuse(features)
        past, logits = None, []
        for k in range(num_steps):
            embeddings = F.pad(token_embeddings[:, k + 1:], (0, 0, 0, k + 1))
            mask = torch.cat([context_visible] + [chain_visible] * k, dim=-1).unsqueeze(1)
            hidden, (keys, values) = self.step(embeddings, hidden, (index + k).expand(batch, -1), past, mask)
            if past is not None:
                keys, values = torch.cat([past[0], keys], -2), torch.cat([past[1], values], -2)
            past = (keys, values)
            logits.append(self.head_logits(hidden))
        return logits


def recursion_labels(model: RecursiveDraftModel, input_ids, loss_mask, lengths, num_steps: int):
    """Draft-vocabulary labels and a supervision mask for each unrolled step, [B, T] each."""
    batch, length = input_ids.shape
    index = torch.arange(length)
    to_draft = model.target_to_draft.cpu()
    steps = []
    for k in range(num_steps):
        shift = k + 2
        target = F.pad(input_ids[:, shift:], (0, shift))
        supervised = F.pad(loss_mask[:, shift:], (0, shift)) & (index[None, :] + shift < lengths[:, None])
        labels = to_draft[target]
        steps.append((labels.clamp_min(0), supervised & (labels >= 0)))
    return steps


def make_llama_layer_config(target_config, *, intermediate_size=None, **extra):
    """A one-layer Llama config of the target's width, heads and rotary settings."""
    from transformers import LlamaConfig

    heads = target_config.num_attention_heads
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(target_config, "num_key_value_heads", heads),
        head_dim=getattr(target_config, "head_dim", None) or target_config.hidden_size // heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        **extra,
    )


def mlp(config) -> nn.Module:
    return LlamaMLP(config)


def rms_norm(config) -> nn.Module:
    return LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
