"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass (or a few).

The drafter reads hidden states of several target layers (the context features), projects
them with ``fc`` + ``hidden_norm`` and injects them as extra keys and values into the
attention of EVERY draft layer. Queries come from the block only: the embeddings of
[last accepted token, MASK, ..., MASK]. Attention inside the block is bidirectional. The
target's embedding matrix and LM head are used as they are (passed in, never copied).

Checkpoints use the layout of the public DFlash drafts (``save_pretrained``): a qwen3
``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``num_target_layers`` and a
``dflash_config`` dict, and weights ``layers.N.*``, ``fc.weight``, ``hidden_norm.weight``,
``norm.weight``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)

from blockspec.errors import CheckpointError, IncompatibleDraftError
from blockspec.io import save_atomically
from blockspec.models.checkpoint import load_pretrained_strict, read_config, require_keys, require_weights

DEFAULT_BLOCK_SIZE = 16


def select_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the drafter, spread uniformly over depth."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    first = min(1, num_target_layers - 1)
    last = max(first, num_target_layers - 3)  # shallow targets: stay inside 0..L-1
    span = last - first
    return [round(first + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def dflash_setting(config, name: str, default=None):
    """Read a DFlash setting from ``dflash_config``, falling back to the top level.

    Older public drafts keep ``block_size`` at the top level of config.json.
    """
    nested = getattr(config, "dflash_config", None) or {}
    if name in nested and nested[name] is not None:
        return nested[name]
    value = getattr(config, name, None)
    return default if value is None else value


def make_dflash_config(
    target_config,
    *,
    num_layers: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
) -> Qwen3Config:
    """A drafter config for ``target_config``: same width and vocabulary, its own depth."""
    hidden = target_config.hidden_size
    heads = num_attention_heads or target_config.num_attention_heads
    kv_heads = num_key_value_heads or getattr(target_config, "num_key_value_heads", heads)
    num_target_layers = target_config.num_hidden_layers
    layer_ids = target_layer_ids or select_target_layers(num_target_layers, num_layers)
    rope = getattr(target_config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    config = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or getattr(target_config, "head_dim", None) or hidden // heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=dict(rope),
        tie_word_embeddings=False,
        num_target_layers=num_target_layers,
        dflash_config={
            "target_layer_ids": list(layer_ids),
            "mask_token_id": int(mask_token_id),
            "block_size": int(block_size),
        },
    )
    config.architectures = ["DFlashDraftModel"]
    return config


class ContextCache:
    """Projected context keys/values of committed positions, one entry per draft layer.

    Block keys/values are never stored, so nothing has to be cropped after a draft.
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[-2]

    def extend(self, layer: int, keys: torch.Tensor, values: torch.Tensor):
        if self.keys[layer] is not None and keys.shape[-2] == 0:
            return self.keys[layer], self.values[layer]  # nothing new: no copy of the whole cache
        if self.keys[layer] is not None:
            keys = torch.cat([self.keys[layer], keys], dim=-2)
            values = torch.cat([self.values[layer], values], dim=-2)
        self.keys[layer], self.values[layer] = keys, values
        return keys, values


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; x is [B, H, T, hd], cos/sin are [B, T, hd]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class DFlashAttention(nn.Module):
    """Attention whose keys/values are [context ; block] and whose queries are the block."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return proj(x).view(batch, length, num_heads, self.head_dim)

    def project_keys_values(self, x, rope):
        keys = apply_rope(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)).transpose(1, 2), *rope)
        values = self._heads(x, self.v_proj, self.num_kv_heads).transpose(1, 2)
        return keys, values

    def forward(self, block, block_rope, context, context_rope, cache=None, layer=0, attention_mask=None):
        queries = apply_rope(self.q_norm(self._heads(block, self.q_proj, self.num_heads)).transpose(1, 2), *block_rope)
        block_k, block_v = self.project_keys_values(block, block_rope)
        if context is not None and context.shape[1] > 0:
            ctx_k, ctx_v = self.project_keys_values(context, context_rope)
        else:
            ctx_k = block_k[..., :0, :]
            ctx_v = block_v[..., :0, :]
        if cache is not None:
            ctx_k, ctx_v = cache.extend(layer, ctx_k, ctx_v)
        keys = torch.cat([ctx_k, block_k], dim=-2)
        values = torch.cat([ctx_v, block_v], dim=-2)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, block_rope, context, context_rope, cache, layer, attention_mask):
        attended = self.self_attn(
            self.input_layernorm(hidden), block_rope, context, context_rope, cache, layer, attention_mask
        )
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """The drafter network. It owns no embedding and no LM head: the target's are used."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.target_layer_ids = [int(i) for i in dflash_setting(
            config, "target_layer_ids", select_target_layers(config.num_target_layers, config.num_hidden_layers)
        )]
        self.block_size = int(dflash_setting(config, "block_size", DEFAULT_BLOCK_SIZE))
        self.mask_token_id = dflash_setting(config, "mask_token_id")
        feature_width = len(self.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(feature_width, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def new_cache(self) -> ContextCache:
        return ContextCache(len(self.layers))

    def forward(
        self,
        block_embeddings: torch.Tensor,
        block_positions: torch.LongTensor,
        context_features: torch.Tensor | None = None,
        context_positions: torch.LongTensor | None = None,
        cache: ContextCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states of the block, [B, Q, D].

        block_embeddings: [B, Q, D], target embeddings of [anchor, MASK, ...] (one or many blocks).
        context_features: [B, C, k*D], concatenated target hidden states of new context positions;
            with a cache they are appended to it, so pass only positions not seen before.
        attention_mask: optional [B or 1, 1, Q, C_total + Q] (bool: True = visible) for training;
            None means every query sees all context and the whole block.
        """
        block_rope = self.rotary_emb(block_embeddings, block_positions)
        context, context_rope = None, None
        if context_features is not None and context_features.shape[1] > 0:
            context = self.hidden_norm(self.fc(context_features))
            context_rope = self.rotary_emb(context, context_positions)
        hidden = block_embeddings
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, block_rope, context, context_rope, cache, index, attention_mask)
        return self.norm(hidden)


# ---------------------------------------------------------------------------
# Loading, saving and fitting a drafter to its target
# ---------------------------------------------------------------------------

def load_dflash_model(directory) -> DFlashDraftModel:
    """Load a DFlash draft checkpoint (ours or one written by other software)."""
    config = read_config(directory)
    architectures = config.get("architectures") or []
    if "DFlashDraftModel" not in architectures:
        raise CheckpointError(
            f"{directory} is not a DFlash draft: config.json architectures is {architectures}, "
            "expected ['DFlashDraftModel']"
        )
    require_keys(config, ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"], directory)
    nested = config.get("dflash_config") or {}
    if nested.get("mask_token_id", config.get("mask_token_id")) is None:
        raise CheckpointError(f"{directory}/config.json lacks dflash_config.mask_token_id")
    if config.get("num_target_layers") is None and not nested.get("target_layer_ids"):
        raise CheckpointError(f"{directory}/config.json lacks num_target_layers and dflash_config.target_layer_ids")
    require_weights(directory)
    return load_pretrained_strict(DFlashDraftModel, directory, dtype=torch.float32)


def check_fits_target(model: DFlashDraftModel, target_config, *, draft_name: str = "the draft") -> None:
    """Refuse a drafter built for another target, naming the mismatch."""
    config = model.config
    target_layers = target_config.num_hidden_layers
    if config.hidden_size != target_config.hidden_size:
        raise IncompatibleDraftError(
            f"{draft_name} has hidden size {config.hidden_size} but the target has {target_config.hidden_size}: "
            "use a draft trained for this target"
        )
    if config.vocab_size != target_config.vocab_size:
        raise IncompatibleDraftError(
            f"{draft_name} has vocabulary {config.vocab_size} but the target has {target_config.vocab_size}: "
            "use a draft trained for this target"
        )
    declared = getattr(config, "num_target_layers", None)
    if declared is not None and declared != target_layers:
        raise IncompatibleDraftError(
            f"{draft_name} was made for a target of {declared} layers but the target has {target_layers}: "
            "use a draft trained for this target"
        )
    if any(not 0 <= i < target_layers for i in model.target_layer_ids):
        raise IncompatibleDraftError(
            f"{draft_name} reads target layers {model.target_layer_ids}, outside the target's 0..{target_layers - 1}"
        )
    if model.mask_token_id is None or not 0 <= int(model.mask_token_id) < target_config.vocab_size:
        raise IncompatibleDraftError(
            f"{draft_name} has mask_token_id {model.mask_token_id}, not a row of the target's embedding"
        )


def save_dflash_model(model: DFlashDraftModel, directory) -> None:
    """Save in the public layout, atomically."""
    model.config.architectures = ["DFlashDraftModel"]
    save_atomically(lambda tmp: model.save_pretrained(tmp, safe_serialization=True), directory)
