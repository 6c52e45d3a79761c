"""The DFlash network: attention over the context features and the block, the decoder layer, the draft model."""

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

from blockspec.errors import IncompatibleDraftError
from blockspec.models.dflash.config import (
    DEFAULT_BLOCK_SIZE,
    attention_sinks,
    dflash_setting,
    draft_vocab_size,
    layer_attention,
    select_target_layers,
    target_width,
)
from blockspec.models.dflash.dflash2 import CandidateSelector, GroupedConv, dflash2_settings, logit_transform
from blockspec.models.dflash.domino import DominoHead, domino_settings
from blockspec.models.dflash.markov import ConfidenceHead, DSparkSettings, MarkovHead, dspark_settings
from blockspec.models.draft_vocab import DraftVocabulary, check_vocabulary


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
        #: Multiplies every value before attention (DFlash2's ``attention_value_scale``).
        self.value_scale = float(dflash_setting(config, "attention_value_scale", 1.0))

    def _heads(self, x: torch.Tensor, proj: nn.Linear, num_heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return proj(x).view(batch, length, num_heads, self.head_dim)

    def project_keys_values(self, x, rope):
        keys = apply_rotary(self.k_norm(self._heads(x, self.k_proj, self.num_kv_heads)).transpose(1, 2), *rope,
                            neox=self.neox)
        values = self._heads(x, self.v_proj, self.num_kv_heads).transpose(1, 2)
        return keys, values if self.value_scale == 1.0 else values * self.value_scale

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
    """Attention over [context ; block] and an MLP, each pre-normed with a residual; with DFlash2's settings,
    each sublayer inside a causal grouped convolution over the block."""

    def __init__(self, config: Qwen3Config, sinks: bool = False, convolution=None):
        super().__init__()
        self.self_attn = DFlashAttention(config, sinks)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if convolution is not None:
            self.attention_conv = GroupedConv(config.hidden_size, convolution)
            self.mlp_conv = GroupedConv(config.hidden_size, convolution)

    def forward(self, hidden, block_rope, context, context_rope, cache, layer, attention_mask):
        return self._sublayers(hidden, lambda x: self.self_attn(x, block_rope, context, context_rope, cache, layer,
                                                               attention_mask))

    def forward_rows(self, hidden, block_rope, context, context_rope, context_sizes, caches, layer):
        return self._sublayers(hidden, lambda x: self.self_attn.forward_rows(x, block_rope, context, context_rope,
                                                                            context_sizes, caches, layer))

    def _sublayers(self, hidden, attend):
        hidden = hidden + _convolved(self.attention_conv, attend, self.input_layernorm(hidden))
        return hidden + _convolved(self.mlp_conv, self.mlp, self.post_attention_layernorm(hidden))


def _convolved(convolution: GroupedConv | None, sublayer, hidden: torch.Tensor) -> torch.Tensor:
    """``sublayer(hidden)``, inside the convolution where the layer has one."""
    if convolution is None:
        return sublayer(hidden)
    hidden, deltas = convolution.prepare(hidden)
    return convolution.finish(sublayer(hidden), deltas)


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
        dflash2 = dflash2_settings(config)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, sinks, dflash2)
                                     for _ in range(config.num_hidden_layers)])
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
        #: DSpark's heads (None: a plain DFlash drafter): the Markov head chains the block's positions through
        #: the token before each, over the head's vocabulary; the confidence head scores each position's draft.
        settings = dspark_settings(config)
        self.markov_head = None if settings is None else \
            MarkovHead(settings, draft_vocab_size(config), config.hidden_size)
        self.confidence_head = ConfidenceHead(settings, config.hidden_size) \
            if settings is not None and settings.confidence_head else None
        #: Domino's head (None: none): a GRU over the previous tokens corrects each position's logits.
        domino = domino_settings(config)
        if domino is not None and settings is not None:
            raise IncompatibleDraftError("a draft has a Markov head (DSpark) or a Domino head, not both")
        self.domino_head = None if domino is None else DominoHead(domino, config.hidden_size, config.vocab_size)
        #: Whether the anchor's slot predicts the next token (slot k predicts anchor + k + 1: a block of B slots
        #: drafts B tokens), or each masked slot predicts its own position (slot k predicts anchor + k: B slots
        #: draft B - 1). DSpark's default is the first, DFlash's the second; Domino says which (shift_label).
        default = domino.shift_label if domino is not None else settings is not None
        self.anchor_predicts = bool(dflash_setting(config, "sample_from_anchor", default))
        #: DFlash2's candidate selector (None: none), over the target's vocabulary.
        if dflash2 is not None and (settings is not None or domino is not None):
            raise IncompatibleDraftError("a draft has one of DFlash2's selector, DSpark's or Domino's head, not two")
        self.candidate_selector = None if dflash2 is None else \
            CandidateSelector(config.hidden_size, config.vocab_size, dflash2)
        #: DFlash2's scalars: block embeddings are scaled on the way in, the head's logits on the way out.
        self.input_embedding_scale = float(dflash_setting(config, "input_embedding_scale", 1.0))
        self.output_multiplier, self.logit_softcap = logit_transform(config)
        self.post_init()

    @property
    def compressed(self) -> bool:
        """Whether it drafts over a reduced vocabulary of its own."""
        return self.lm_head is not None

    @property
    def method(self) -> str:
        """The drafting method its heads need: dspark (a Markov head), domino (a GRU head), dflash2 (a candidate
        selector), or dflash."""
        if self.markov_head is not None:
            return "dspark"
        if self.domino_head is not None:
            return "domino"
        return "dflash2" if self.candidate_selector is not None else "dflash"

    @property
    def max_draft_tokens(self) -> int:
        """The tokens one block drafts at most."""
        return self.block_size if self.anchor_predicts else self.block_size - 1

    def compress_vocabulary(self, target_ids, target_head_weight: torch.Tensor) -> None:
        """Draft over these target ids only: ``lm_head`` becomes their rows of the target's head (frozen
        copies), and ``draft_vocab_size`` / ``d2t`` are set for saving."""
        if self.compressed:
            raise IncompatibleDraftError(f"the draft already drafts over its own {self.lm_head.out_features}-token "
                                         "vocabulary: drop the draft vocabulary option")
        if self.markov_head is not None:
            raise IncompatibleDraftError("a DSpark draft's Markov head is trained over its own vocabulary: drop the "
                                         "draft vocabulary option")
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

    def add_dspark_heads(self, settings: DSparkSettings) -> None:
        """Give this drafter DSpark's heads, over the vocabulary its head scores, and write them into its config. The
        Markov head's output starts at zero, so the drafter starts as the DFlash drafter it was."""
        if self.markov_head is not None:
            raise IncompatibleDraftError("the draft already has a Markov head")
        self.config.markov_rank, self.config.markov_head_type = settings.markov_rank, settings.markov_head_type
        self.config.enable_confidence_head = settings.confidence_head
        self.config.confidence_head_with_markov = settings.confidence_with_markov
        self.config.sample_from_anchor = self.anchor_predicts
        parameter = next(self.layers.parameters())
        self.markov_head = MarkovHead(settings, draft_vocab_size(self.config), self.config.hidden_size)
        torch.nn.init.zeros_(self.markov_head.markov_w2.weight)
        self.markov_head.to(parameter.device, parameter.dtype)
        if settings.confidence_head:
            self.confidence_head = ConfidenceHead(settings, self.config.hidden_size).to(parameter.device,
                                                                                       parameter.dtype)

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
        if self.mask_embedding is not None:
            masked = (block_ids == int(self.mask_token_id)).unsqueeze(-1)
            embeddings = torch.where(masked, self.mask_embedding.to(embeddings.dtype), embeddings)
        return embeddings if self.input_embedding_scale == 1.0 else embeddings * self.input_embedding_scale

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


def _rotary_config(config: Qwen3Config) -> Qwen3Config:
    """The config the rotary embedding is built from: with a partial rotary, a head of the rotated dims only."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    if not factor or factor >= 1:
        return config
    rotary = Qwen3Config(**{**config.to_dict(), "head_dim": int(config.head_dim * factor)})
    return rotary
