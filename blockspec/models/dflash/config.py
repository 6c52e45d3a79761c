"""A DFlash drafter's settings: where the public layouts keep each one, and what a new drafter is given."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import Qwen3Config

from blockspec.errors import CheckpointError

DEFAULT_BLOCK_SIZE = 16

SLIDING = "sliding_attention"


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


def draft_vocab_size(config) -> int:
    """The tokens the draft scores: ``draft_vocab_size`` when set, else the target's whole vocabulary."""
    return int(getattr(config, "draft_vocab_size", None) or config.vocab_size)


def has_reduced_vocabulary(raw: dict) -> bool:
    """Whether a draft's config.json (as read) gives it a draft vocabulary smaller than the target's."""
    return (raw.get("draft_vocab_size") or raw["vocab_size"]) < raw["vocab_size"]


def target_width(config) -> int:
    """The width of each target layer's features (``target_hidden_size``, else the draft's own)."""
    return int(getattr(config, "target_hidden_size", None) or config.hidden_size)
