"""The DFlash drafter: a few Qwen3-style layers that denoise a whole block in one pass (or a few).

The drafter reads hidden states of several target layers (the context features), projects
them with ``fc`` + ``hidden_norm`` and injects them as extra keys and values into the
attention of EVERY draft layer. Queries come from the block only: the embeddings of
[last accepted token, MASK, ..., MASK]. Attention inside the block is bidirectional. The
target's embedding matrix and LM head are used as they are (passed in, never copied).

Checkpoints use the layout of the public DFlash drafts (``save_pretrained``): a qwen3
``config.json`` with ``architectures: ["DFlashDraftModel"]``, ``num_target_layers`` and a
``dflash_config`` dict, and weights ``layers.N.*``, ``fc.weight``, ``hidden_norm.weight``,
``norm.weight``. Every config key the public drafts use (and vLLM's DFlash loader honours) is
read: per-layer sliding windows and causality, attention sinks, the target's width, the rotary
layout, a separate mask embedding, a logit scale; what cannot be honoured is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
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
from blockspec.models.checkpoint import (
    CONFIG_ERRORS,
    is_whole_number,
    load_pretrained_strict,
    read_config,
    require_keys,
    require_sizes,
    require_weights,
)
from blockspec.models.draft_vocab import DraftVocabulary, check_vocabulary

DEFAULT_BLOCK_SIZE = 16
SLIDING = "sliding_attention"
#: A mask embedding shipped beside the weights (vLLM's name): it replaces the mask token's embedding row.
MASK_EMBEDDING_FILE = "mask_embedding.pt"
#: Weights some drafts ship that blockspec cannot use (it drafts over the target's own embedding, and its
#: head unless the draft has a reduced vocabulary of its own).
_UNUSABLE_WEIGHTS = {"embed_tokens.": "its own token embedding", "mask_hidden": "a mask hidden state"}
_VOCABULARY_WEIGHTS = {"lm_head.": "its own LM head", "d2t": "a draft vocabulary map", "t2d": "a draft vocabulary map"}


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
    target_config = target_config.get_text_config(decoder=True)
    hidden = target_config.hidden_size
    heads = num_attention_heads or first_layer_setting(target_config, "num_attention_heads")
    kv_heads = num_key_value_heads or first_layer_setting(target_config, "num_key_value_heads") or heads
    num_target_layers = target_config.num_hidden_layers
    layer_ids = target_layer_ids or select_target_layers(num_target_layers, num_layers)
    rope = draft_rope(target_config)
    config = Qwen3Config(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate_size or first_layer_setting(target_config, "intermediate_size"),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim or first_layer_setting(target_config, "head_dim") or hidden // heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
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


def first_layer_setting(config, name: str):
    """A target setting that may differ from layer to layer (Gemma 4's head width): its first layer's."""
    try:
        return getattr(config, name, None)
    except RuntimeError:  # read per layer only, on a config whose layers differ
        return getattr(config.per_layer_config[0], name, None)


def draft_rope(target_config) -> dict:
    """The drafter's rotary settings: the target's, as a plain rotary over the whole head (a family's
    per-layer-type, partial or multimodal variants are the target's own business)."""
    rope = getattr(target_config, "rope_parameters", None) or {}
    if "full_attention" in rope:  # one set per layer type
        rope = rope["full_attention"]
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "linear", "dynamic", "yarn", "llama3", "longrope"):
        rope_type = "default"
    plain = {key: value for key, value in rope.items()
             if key not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor", "rope_type")}
    plain.setdefault("rope_theta", 10000.0)
    if rope_type == "default":
        plain = {"rope_theta": plain["rope_theta"]}
    return {"rope_type": rope_type, **plain}


@dataclass(frozen=True)
class LayerAttention:
    """How one draft layer attends: a sliding window (None: all positions) and causally or not."""

    window: int | None = None
    causal: bool = False

    @property
    def masked(self) -> bool:
        return self.window is not None or self.causal


def layer_attention(config, index: int) -> LayerAttention:
    """Draft layer ``index``'s attention, resolved as vLLM's DFlash loader does:

    - sliding: ``layer_types[index]`` is "sliding_attention"; ``dflash_config.use_swa`` makes every
      layer slide when no layer type says so; the window is ``dflash_config.swa_window_size`` or
      ``sliding_window``;
    - causal: ``is_causal`` if set, else ``dflash_config.causal`` if set, else the layers whose
      ``layer_types`` entry is "sliding_attention" are causal and the others see the whole block.
    """
    nested = getattr(config, "dflash_config", None) or {}
    layer_types = getattr(config, "layer_types", None)
    use_swa = bool(nested.get("use_swa", False))
    if layer_types is None or (use_swa and SLIDING not in layer_types):
        sliding = use_swa
    else:
        sliding = layer_types[index] == SLIDING
    window = None
    if sliding:
        window = nested.get("swa_window_size") or getattr(config, "sliding_window", None)
        if not window or window < 1:
            raise CheckpointError("a sliding-window draft layer needs its window: set dflash_config.swa_window_size "
                                  "or sliding_window in config.json")
    causal = getattr(config, "is_causal", None)
    if causal is None:
        causal = nested.get("causal")
    if causal is None:  # by the layer's declared type: use_swa alone leaves layers non-causal
        causal = bool(layer_types) and layer_types[index] == SLIDING
    return LayerAttention(int(window) if window else None, bool(causal))


def attention_sinks(config) -> bool:
    """Whether draft layers carry a learned attention sink per head (``dflash_config.attention_sink_bias``)."""
    nested = getattr(config, "dflash_config", None) or {}
    return bool(nested.get("attention_sink_bias", getattr(config, "add_swa_attention_sink_bias", False)))


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = True) -> torch.Tensor:
    """Rotary embedding on x [B, H, T, hd] from cos/sin [B, T, r]: the first r dims of each head rotate
    (r < hd: a partial rotary), as halves (neox) or as interleaved pairs."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin, neox), x[..., rotary:]], dim=-1)
    if neox:
        return apply_rope(x, cos, sin)
    cos = cos[..., : rotary // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    sin = sin[..., : rotary // 2].repeat_interleave(2, dim=-1).unsqueeze(1)
    pairs = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + pairs * sin


def rows_then_blocks(contexts, block_k, block_v):
    """Keys and values [B, H, L + Q, d] for one attention over many rows: row b's context keys/values (or None)
    left-aligned and padded to the longest L, then its block's; and what each query sees [B, 1, Q, L + Q]."""
    longest = max(0 if keys is None else keys.shape[-2] for keys, _ in contexts)
    batch, heads, width, dim = block_k.shape
    keys = block_k.new_zeros(batch, heads, longest + width, dim)
    values = block_v.new_zeros(batch, heads, longest + width, dim)
    visible = torch.zeros(batch, 1, width, longest + width, dtype=torch.bool, device=block_k.device)
    for row, (context_k, context_v) in enumerate(contexts):
        if context_k is not None:
            length = context_k.shape[-2]
            keys[row, :, :length], values[row, :, :length] = context_k[0], context_v[0]
            visible[row, :, :, :length] = True
    keys[:, :, longest:], values[:, :, longest:] = block_k, block_v
    visible[:, :, :, longest:] = True
    return keys, values, visible


class DFlashAttention(nn.Module):
    """Attention whose keys/values are [context ; block] and whose queries are the block.

    With sinks, each head has a learned logit that competes in the softmax without a value (a key
    of zeros whose score is the sink, put in through the additive mask).
    """

    def __init__(self, config: Qwen3Config, sinks: bool = False):
        super().__init__()
        self.neox = bool(getattr(config, "is_neox_style", True))
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
        self.attention_sink_bias = nn.Parameter(torch.zeros(self.num_heads)) if sinks else None

    def _heads(self, x: torch.Tensor, proj: nn.Linear, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return proj(x).view(batch, length, num_heads, self.head_dim)

    def project_keys_values(self, x, rope):
        keys = apply_rotary(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)).transpose(1, 2), *rope,
                            neox=self.neox)
        values = self._heads(x, self.v_proj, self.num_kv_heads).transpose(1, 2)
        return keys, values

    def forward(self, block, block_rope, context, context_rope, cache=None, layer=0, attention_mask=None):
        queries = self.project_queries(block, block_rope)
        block_k, block_v = self.project_keys_values(block, block_rope)
        if context is not None and context.shape[1] > 0:
            ctx_k, ctx_v = self.project_keys_values(context, context_rope)
        else:
            ctx_k = block_k[..., :0, :]
            ctx_v = block_v[..., :0, :]
        if cache is not None:
            ctx_k, ctx_v = cache.extend(layer, ctx_k, ctx_v)
        out = self.attend(queries, torch.cat([ctx_k, block_k], dim=-2), torch.cat([ctx_v, block_v], dim=-2),
                          attention_mask)
        return self.project_out(out)

    def forward_rows(self, blocks, block_rope, context, context_rope, context_sizes, caches, layer):
        """Many sequences' blocks [B, Q, D] at once, each attending its own cache and its own block. ``context``
        [1, sum(C_b), D]: the rows' new context positions one after another (C_b of row b, maybe 0), appended
        to their caches. The projections run over every row together."""
        queries = self.project_queries(blocks, block_rope)
        block_k, block_v = self.project_keys_values(blocks, block_rope)
        new_k, new_v = (None, None) if context is None else self.project_keys_values(context, context_rope)
        offsets = [0]
        for size in context_sizes:
            offsets.append(offsets[-1] + size)
        contexts = []
        for row, cache in enumerate(caches):
            begin, end = offsets[row], offsets[row + 1]
            if end > begin:
                contexts.append(cache.extend(layer, new_k[..., begin:end, :], new_v[..., begin:end, :]))
            else:
                contexts.append((cache.keys[layer], cache.values[layer]))
        return self.project_out(self.attend(queries, *rows_then_blocks(contexts, block_k, block_v)))

    def project_queries(self, x, rope):
        return apply_rotary(self.q_norm(self._heads(x, self.q_proj, self.num_heads)).transpose(1, 2), *rope,
                            neox=self.neox)

    def attend(self, queries, keys, values, attention_mask):
        if self.attention_sink_bias is not None:
            keys, values, attention_mask = self._with_sink(keys, values, attention_mask, queries.shape[2])
        return F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=attention_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )

    def project_out(self, out):
        batch, _, length, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _with_sink(self, keys, values, visible, num_queries):
        """Keys/values with a zero column appended, and the additive mask [B, H, Q, K + 1] whose last column
        is each head's sink logit (a zero key scores 0, so the mask alone puts the sink in)."""
        zero = keys[..., :1, :] * 0
        keys, values = torch.cat([keys, zero], dim=-2), torch.cat([values, zero], dim=-2)
        batch, length = keys.shape[0], keys.shape[-2] - 1
        mask = torch.zeros(batch, self.num_heads, num_queries, length, dtype=keys.dtype, device=keys.device)
        if visible is not None:
            mask = mask.masked_fill(~visible, torch.finfo(keys.dtype).min)
        sink = self.attention_sink_bias.to(keys.dtype).view(1, -1, 1, 1).expand(batch, -1, num_queries, 1)
        return keys, values, torch.cat([mask, sink], dim=-1)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, sinks: bool = False):
        super().__init__()
        self.self_attn = DFlashAttention(config, sinks)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden, block_rope, context, context_rope, cache, layer, attention_mask):
        attended = self.self_attn(
            self.input_layernorm(hidden), block_rope, context, context_rope, cache, layer, attention_mask
        )
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_rows(self, hidden, block_rope, context, context_rope, context_sizes, caches, layer):
        attended = self.self_attn.forward_rows(self.input_layernorm(hidden), block_rope, context, context_rope,
                                               context_sizes, caches, layer)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(DraftVocabulary, Qwen3PreTrainedModel):
    """The drafter network. It owns no embedding: the target's is used; and no LM head unless it drafts over
    a reduced vocabulary (``draft_vocab_size`` < V): then ``lm_head`` holds those K rows of the target's head
    and ``d2t`` maps them to target ids (the layout vLLM's DFlash loader reads)."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    #: t2d follows from d2t (vLLM ignores it too); a draft that ships it loads the same
    _keys_to_ignore_on_load_unexpected = [r"^(model\.)?t2d$"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        sinks = attention_sinks(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, sinks) for _ in range(config.num_hidden_layers)])
        self.attention = [layer_attention(config, i) for i in range(config.num_hidden_layers)]
        layer_ids = dflash_setting(config, "target_layer_ids")
        if layer_ids is None:
            layer_ids = select_target_layers(config.num_target_layers, config.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in layer_ids]
        self.block_size = int(dflash_setting(config, "block_size", DEFAULT_BLOCK_SIZE))
        self.mask_token_id = dflash_setting(config, "mask_token_id")
        #: Multiplies the drafter's logits (vLLM's ``logit_scale``).
        self.logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        self.fc = nn.Linear(len(self.target_layer_ids) * target_width(config), config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(_rotary_config(config))
        #: The embedding of masked block slots when the draft ships its own (None: the target's row).
        self.register_buffer("mask_embedding", None, persistent=False)
        #: Its own head over a reduced draft vocabulary, else None (the target's head).
        self.lm_head = None
        if draft_vocab_size(config) < config.vocab_size:
            self.lm_head = nn.Linear(config.hidden_size, self.register_draft_vocabulary(config, save_t2d=False),
                                     bias=False)
        self.post_init()

    @property
    def compressed(self) -> bool:
        """Whether it drafts over a reduced vocabulary of its own."""
        return self.lm_head is not None

    def compress_vocabulary(self, target_ids, target_head_weight: torch.Tensor) -> None:
        """Draft over these target ids only: ``lm_head`` becomes their rows of the target's head (frozen
        copies), and ``draft_vocab_size`` / ``d2t`` are set for saving."""
        if self.compressed:
            raise IncompatibleDraftError(f"the draft already drafts over its own {self.lm_head.out_features}-token "
                                         "vocabulary: drop the draft vocabulary option")
        ids = check_vocabulary(target_ids, self.config.vocab_size)
        if ids.numel() >= self.config.vocab_size:
            return  # the whole vocabulary: the target's head as it is
        self.config.draft_vocab_size = int(ids.numel())
        self.register_draft_vocabulary(self.config, save_t2d=False)
        self.set_draft_vocabulary(ids)
        self.lm_head = nn.Linear(self.config.hidden_size, ids.numel(), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(target_head_weight.detach()[ids.to(target_head_weight.device)].float())
        self.lm_head.requires_grad_(False)
        device = next(self.layers.parameters()).device
        self.to(device)

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
            None means every query sees all context and the whole block (causal or sliding-window
            layers see less: by position).
        """
        block_rope = self.rotary_emb(block_embeddings, block_positions)
        context, context_rope = None, None
        if context_features is not None and context_features.shape[1] > 0:
            context = self.hidden_norm(self.fc(context_features))
            context_rope = self.rotary_emb(context, context_positions)
        masks = self._layer_masks(block_positions, context_positions, cache, attention_mask)
        hidden = block_embeddings
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, block_rope, context, context_rope, cache, index, masks[self.attention[index]])
        return self.norm(hidden)

    @property
    def attends_rows_alike(self) -> bool:
        """Whether every query sees its whole context and block (no causal or sliding layer), so that
        ``forward_rows`` can run many sequences' blocks together."""
        return not any(spec.masked for spec in self.attention)

    def forward_rows(self, block_embeddings: torch.Tensor, block_positions: torch.LongTensor,
                     context_features: list[torch.Tensor | None], caches: list[ContextCache]) -> torch.Tensor:
        """``forward`` for many sequences at once: blocks [B, Q, D] at positions [B, Q], row b's new context
        features [1, C_b, k*D] (None: none) appended to its cache ``caches[b]``; the final hidden states
        [B, Q, D]. Only for a drafter whose layers ``attends_rows_alike``."""
        block_rope = self.rotary_emb(block_embeddings, block_positions)
        sizes = [0 if features is None else features.shape[1] for features in context_features]
        context = context_rope = None
        if sum(sizes):  # every row's new positions in one tensor, projected together
            device = block_embeddings.device
            context = self.hidden_norm(self.fc(torch.cat([f for f in context_features if f is not None], dim=1)))
            positions = torch.cat([torch.arange(cache.length, cache.length + size, device=device)
                                   for cache, size in zip(caches, sizes)])
            context_rope = self.rotary_emb(context, positions.unsqueeze(0))
        hidden = block_embeddings
        for index, layer in enumerate(self.layers):
            hidden = layer.forward_rows(hidden, block_rope, context, context_rope, sizes, caches, index)
        return self.norm(hidden)

    def embed_block(self, embed_tokens, block_ids: torch.LongTensor) -> torch.Tensor:
        """The block's embeddings through the target's table; masked slots take the draft's own mask
        embedding where it ships one."""
        embeddings = embed_tokens(block_ids)
        if self.mask_embedding is None:
            return embeddings
        masked = (block_ids == int(self.mask_token_id)).unsqueeze(-1)
        return torch.where(masked, self.mask_embedding.to(embeddings.dtype), embeddings)

    def _layer_masks(self, block_positions, context_positions, cache, attention_mask) -> dict:
        """Per kind of layer attention: ``attention_mask`` narrowed by causality and window (by position)."""
        masks = {spec: attention_mask for spec in set(self.attention)}
        if not any(spec.masked for spec in masks):
            return masks
        keys = torch.cat([self._context_positions(block_positions, context_positions, cache), block_positions], 1)
        distance = block_positions.unsqueeze(-1) - keys.unsqueeze(1)  # [B, Q, K]: query position - key position
        for spec in masks:
            if spec.masked:
                visible = torch.ones_like(distance, dtype=torch.bool)
                if spec.causal:
                    visible &= distance >= 0
                if spec.window is not None:
                    visible &= distance < spec.window
                visible = visible.unsqueeze(1)
                masks[spec] = visible if attention_mask is None else attention_mask & visible
        return masks

    @staticmethod
    def _context_positions(block_positions, context_positions, cache) -> torch.LongTensor:
        """Positions of the context keys: a cache holds positions 0.. in order; without one, the new context's."""
        new = 0 if context_positions is None else context_positions.shape[1]
        if cache is None:
            return block_positions[:, :0] if context_positions is None else context_positions
        total = cache.length + new
        return torch.arange(total, device=block_positions.device).unsqueeze(0).expand(block_positions.shape[0], -1)


def draft_vocab_size(config) -> int:
    """The tokens the draft scores: ``draft_vocab_size`` when set, else the target's whole vocabulary."""
    return int(getattr(config, "draft_vocab_size", None) or config.vocab_size)


def has_reduced_vocabulary(raw: dict) -> bool:
    """Whether a draft's config.json (as read) gives it a draft vocabulary smaller than the target's."""
    return (raw.get("draft_vocab_size") or raw["vocab_size"]) < raw["vocab_size"]


def target_width(config) -> int:
    """The width of each target layer's features (``target_hidden_size``, else the draft's own)."""
    return int(getattr(config, "target_hidden_size", None) or config.hidden_size)


def _rotary_config(config: Qwen3Config) -> Qwen3Config:
    """The config the rotary embedding is built from: with a partial rotary, a head of the rotated dims only."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if not factor or factor >= 1:
        return config
    rotary = Qwen3Config(**{**config.to_dict(), "head_dim": int(config.head_dim * factor)})
    return rotary


# ---------------------------------------------------------------------------
# Loading, saving and fitting a drafter to its target
# ---------------------------------------------------------------------------

#: speculators' DFlash settings blockspec cannot run, refused by name rather than ignored (the next drafter
#: generation: DFlash2's convolutions and candidate selector, DSpark's anchor sampling, the extra residuals).
SPECULATORS_UNSUPPORTED = ("sample_from_anchor", "dflash_context_residual", "dflash_block_position_embedding",
                           "dflash_gated_layer_fusion", "dflash2_dynamic_conv", "dflash2_candidate_selector")


def from_speculators_layout(raw: dict, directory) -> dict:
    """A config.json of vLLM's ``speculators`` DFlash layout (``speculators_model_type: dflash``: the layer config
    under ``transformer_layer_config``, hidden-state indices in ``aux_hidden_state_layer_ids``) in the public
    DFlash layout; any other config as it is. Its weights carry the same names."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    if kind != "dflash":
        raise CheckpointError(f"{directory}: speculators_model_type {kind!r} is not supported: blockspec runs "
                              "speculators' 'dflash' drafts (and its own 'eagle3' layout through --method eagle3)")
    on = [name for name in SPECULATORS_UNSUPPORTED if raw.get(name)]
    if on:
        raise CheckpointError(f"{directory}: {', '.join(on)} set in config.json, which blockspec does not run")
    layer = raw.get("transformer_layer_config")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not aux or raw.get("mask_token_id") is None:
        raise CheckpointError(f"{directory}/config.json: a speculators DFlash draft needs transformer_layer_config, "
                              "aux_hidden_state_layer_ids and mask_token_id")
    converted = {**layer, "architectures": ["DFlashDraftModel"], "draft_vocab_size": raw.get("draft_vocab_size"),
                 # hidden-state indices (0: the embeddings) to the outputs of layers, as dflash_config counts them
                 "dflash_config": {"mask_token_id": raw["mask_token_id"], "block_size": raw.get("block_size", 8),
                                   "target_layer_ids": [int(i) - 1 for i in aux]}}
    if raw.get("target_hidden_size") is not None:
        converted["target_hidden_size"] = raw["target_hidden_size"]
    return converted


def load_dflash_model(directory) -> DFlashDraftModel:
    """Load a DFlash draft checkpoint (ours, z-lab's, SpecForge's, or vLLM speculators' layout)."""
    read = read_config(directory)
    raw = from_speculators_layout(read, directory)
    architectures = raw.get("architectures") or []
    if "DFlashDraftModel" not in architectures:
        raise CheckpointError(
            f"{directory} is not a DFlash draft: config.json architectures is {architectures}, "
            "expected ['DFlashDraftModel']"
        )
    require_keys(raw, ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"], directory)
    require_sizes(raw, directory)
    nested = raw.get("dflash_config") or {}
    _check_block_size(nested.get("block_size", raw.get("block_size")), directory)
    if nested.get("mask_token_id", raw.get("mask_token_id")) is None:
        raise CheckpointError(f"{directory}/config.json lacks dflash_config.mask_token_id")
    _check_target_layers(raw, nested, directory)
    _refuse_unsupported(raw, nested, directory)
    require_weights(directory)
    _refuse_unusable_weights(directory, compressed=has_reduced_vocabulary(raw))
    model = load_pretrained_strict(DFlashDraftModel, directory, dtype=torch.float32,
                                   config=_draft_config(directory, raw, nested, from_file=raw is read))
    if model.compressed:
        model.derive_t2d(directory)
        model.check_draft_vocabulary(directory)
    model.mask_embedding = read_mask_embedding(directory, model.mask_token_id, model.config.hidden_size)
    return model


def _check_block_size(block_size, directory) -> None:
    """A block holds the last token and at least one masked position: a smaller one would never draft."""
    if block_size is not None and not is_whole_number(block_size, 2):
        raise CheckpointError(f"{directory}/config.json: dflash_config.block_size must be a whole number >= 2 (the "
                              f"last token and the positions drafted after it), got {block_size!r}")


def _check_target_layers(raw: dict, nested: dict, directory) -> None:
    """The target layers a draft reads are its own: guessing them from depth would mostly be wrong."""
    layer_ids = nested.get("target_layer_ids", raw.get("target_layer_ids"))
    if not layer_ids:
        raise CheckpointError(f"{directory}/config.json lacks dflash_config.target_layer_ids (the target layers the "
                              "draft reads): add the list the draft was trained with")
    declared = raw.get("num_target_layers")
    if declared is not None and any(not 0 <= int(i) < int(declared) for i in layer_ids):
        raise CheckpointError(f"{directory}/config.json: dflash_config.target_layer_ids {list(layer_ids)} are not all "
                              f"layers of a {declared}-layer target (num_target_layers)")


def _refuse_unsupported(raw: dict, nested: dict, directory) -> None:
    """Settings of some drafts that blockspec cannot honour, refused by name rather than ignored."""
    if nested.get("use_aux_hidden_state", raw.get("use_aux_hidden_state", True)) is False:
        raise CheckpointError(f"{directory}: use_aux_hidden_state false (a draft that does not read the target's "
                              "layers) is not supported")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and not (is_whole_number(draft_vocab) and draft_vocab <= raw["vocab_size"]):
        raise CheckpointError(f"{directory}: draft_vocab_size {draft_vocab!r} must be a whole number from 1 to "
                              f"vocab_size ({raw['vocab_size']})")
    other = sorted(set(raw.get("layer_types") or []) - {"full_attention", SLIDING})
    if other:
        raise CheckpointError(f"{directory}: layer_types {', '.join(other)} are not supported "
                              f"(draft layers are full_attention or {SLIDING})")


def _refuse_unusable_weights(directory, *, compressed: bool) -> None:
    """Weights blockspec would silently ignore are refused by name; a reduced vocabulary's head and map are the
    draft's own (with the whole vocabulary, the target's head is used)."""
    unusable = _UNUSABLE_WEIGHTS if compressed else {**_UNUSABLE_WEIGHTS, **_VOCABULARY_WEIGHTS}
    for name in weight_names(directory):
        bare = name.removeprefix("model.")
        for prefix, what in unusable.items():
            if bare.startswith(prefix):
                raise CheckpointError(f"{directory} ships {what} ({name}), which blockspec does not use: it drafts "
                                      "through the target's own embedding and LM head (a draft of its own head "
                                      "sets draft_vocab_size below vocab_size, with d2t)")


def weight_names(directory) -> list[str]:
    """The tensor names of a checkpoint's safetensors weights (none for other formats)."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text()).get("weight_map", {}))
    single = directory / "model.safetensors"
    if not single.is_file():
        return []
    try:
        with safe_open(str(single), framework="pt") as weights:
            return list(weights.keys())
    except Exception:  # unreadable: the weight loader reports it by name
        return []


def _draft_config(directory, raw: dict, nested: dict, *, from_file: bool = True) -> Qwen3Config:
    """The config the model is built from (config.json, or ``raw`` where it was converted from another layout), with
    what Qwen3Config would otherwise lose or default differently."""
    try:
        config = Qwen3Config.from_pretrained(str(directory)) if from_file else Qwen3Config.from_dict(dict(raw))
    except CONFIG_ERRORS as error:
        raise CheckpointError(f"{directory}/config.json is not a valid config: {error}") from error
    sliding = SLIDING in (raw.get("layer_types") or []) or nested.get("use_swa") or raw.get("use_sliding_window")
    if sliding and not nested.get("swa_window_size") and raw.get("sliding_window"):
        # Qwen3Config drops sliding_window unless use_sliding_window is set; the draft's layer types still slide
        config.dflash_config = {**nested, "swa_window_size": int(raw["sliding_window"])}
    if not any(key in raw for key in ("rope_theta", "rope_parameters", "rope_scaling")):
        config.rope_parameters = {"rope_type": "default", "rope_theta": 1000000.0}  # the drafts' (and vLLM's) default
    return config


def read_mask_embedding(directory, mask_token_id, hidden_size: int) -> torch.Tensor | None:
    """The draft's own mask embedding (``mask_embedding.pt``: a tensor, or a dict with ``embedding`` and
    ``mask_token_id``), None when it ships none."""
    path = Path(directory) / MASK_EMBEDDING_FILE
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"could not read {path}: {error}") from error
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise CheckpointError(f"{path} is for mask_token_id {state.get('mask_token_id')} but "
                                  f"dflash_config.mask_token_id is {mask_token_id}")
        state = state.get("embedding")
    if not isinstance(state, torch.Tensor) or state.numel() != hidden_size:
        raise CheckpointError(f"{path} must hold one embedding of {hidden_size} values")
    return state.reshape(-1).float()


def check_fits_target(model: DFlashDraftModel, target_config, *, draft_name: str = "the draft") -> None:
    """Refuse a drafter built for another target, naming the mismatch."""
    config = model.config
    target_config = target_config.get_text_config(decoder=True)
    target_layers = target_config.num_hidden_layers
    if config.hidden_size != target_config.hidden_size:
        raise IncompatibleDraftError(
            f"{draft_name} has hidden size {config.hidden_size} but the target has {target_config.hidden_size}: "
            "use a draft trained for this target"
        )
    if target_width(config) != target_config.hidden_size:
        raise IncompatibleDraftError(
            f"{draft_name} reads target features of width {target_width(config)} (target_hidden_size) but the "
            f"target's layers are {target_config.hidden_size} wide: use a draft trained for this target"
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
    """Save in the public layout, atomically (a mask embedding of its own beside the weights)."""
    model.config.architectures = ["DFlashDraftModel"]

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        if model.mask_embedding is not None:
            torch.save({"embedding": model.mask_embedding.detach().cpu(), "mask_token_id": int(model.mask_token_id)},
                       Path(tmp) / MASK_EMBEDDING_FILE)

    save_atomically(write, directory)
