"""EAGLE-3: one draft decoder layer fed by three fused target layers (low, mid, high).

The target's hidden states at the INPUTS of layers 2, L//2 and L-3 are concatenated and
fused by ``fc`` (3D -> D). The single decoder layer's attention input is
[RMSNorm(token embedding) ; RMSNorm(fused feature)] (2D wide); its output goes through
``norm`` and the draft's own LM head over a reduced vocabulary (d2t / t2d maps).

Checkpoints use the keys of the public EAGLE-3 drafts, so they serve elsewhere (vLLM,
SGLang): a llama config.json with ``architectures: ["LlamaForCausalLMEagle3"]``,
``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``
(input-of-layer indices), and weights ``midlayer.*``, ``fc.weight``, ``norm.weight``,
``lm_head.weight``, ``d2t``, ``t2d``. The token embedding is the target's (not stored).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRotaryEmbedding

from blockspec.errors import CheckpointError
from blockspec.models.checkpoint import (
    load_pretrained_strict,
    read_config,
    require_keys,
    require_sizes,
    require_weights,
)
from blockspec.models.recursive_head import CachedAttention, RecursiveDraftModel, make_llama_layer_config, mlp, rms_norm
from blockspec.models.target import copy_final_norm

ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_target_layers: int) -> list[int]:
    """Low, mid and high layers (input-of-layer indices), as the EAGLE-3 reference picks them."""
    last = max(1, num_target_layers - 1)
    return sorted(min(max(1, i), last) for i in (2, num_target_layers // 2, num_target_layers - 3))


def make_eagle3_config(target_config, *, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                       aux_layer_ids: list[int] | None = None, ttt_steps: int = 4) -> LlamaConfig:
    layers = list(aux_layer_ids or default_aux_layers(target_config.num_hidden_layers))
    config = make_llama_layer_config(
        target_config, intermediate_size=intermediate_size,
        draft_vocab_size=int(draft_vocab_size or target_config.vocab_size),
        target_hidden_size=target_config.hidden_size,
        num_target_layers=target_config.num_hidden_layers,
        eagle_config={"eagle_aux_hidden_state_layer_ids": layers, "use_aux_hidden_state": True,
                      "ttt_steps": int(ttt_steps)},
    )
    config.architectures = [ARCHITECTURE]
    return config


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = CachedAttention(config, input_size=2 * config.hidden_size)
        self.mlp = mlp(config)
        self.hidden_norm = rms_norm(config)
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)
        #: The residual is the normed feature rather than the feature (``norm_before_residual``, speculators' default).
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeddings, hidden, rope, past, mask):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        joint = torch.cat([self.input_layernorm(embeddings), normed], dim=-1)
        attended, key_values = self.self_attn(joint, rope, past, mask)
        hidden = residual + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), key_values


class LlamaForCausalLMEagle3(RecursiveDraftModel, LlamaPreTrainedModel):
    """The EAGLE-3 draft, named as its public checkpoints' ``architectures`` name it."""

    config_class = LlamaConfig
    _no_split_modules = ["Eagle3DecoderLayer"]

    def __init__(self, config: LlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        hidden = config.hidden_size
        target_hidden = getattr(config, "target_hidden_size", None) or hidden
        self.aux_layer_ids = [int(i) for i in aux_layer_ids(config)]
        self.feature_layers = [i - 1 for i in self.aux_layer_ids]
        self.ttt_steps = int(((getattr(config, "eagle_config", None) or {}).get("ttt_steps")) or 4)
        self.midlayer = Eagle3DecoderLayer(config)
        self.fc = nn.Linear(len(self.aux_layer_ids) * target_hidden, hidden, bias=False)
        self.norm = rms_norm(config)
        self.lm_head = nn.Linear(hidden, self.register_draft_vocabulary(config), bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.post_init()

    @property
    def layer(self):
        return self.midlayer

    def fuse(self, features):
        return self.fc(features)

    def head_logits(self, hidden):
        return self.lm_head(self.norm(hidden))

    def start_head_from_target(self, target_model) -> None:
        """Draft LM head rows and final norm copied from the target's, for the draft vocabulary."""
        head = target_model.get_output_embeddings().weight.detach()
        with torch.no_grad():
            self.lm_head.weight.copy_(head[self.draft_to_target.to(head.device)].float())
        copy_final_norm(self.norm, target_model)


Eagle3DraftModel = LlamaForCausalLMEagle3


def aux_layer_ids(config) -> list[int]:
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return list(ids)
    layers = getattr(config, "num_target_layers", None)
    if layers is None:
        raise CheckpointError("the EAGLE-3 config has neither eagle_config.eagle_aux_hidden_state_layer_ids "
                              "nor num_target_layers: cannot tell which target layers it reads")
    return default_aux_layers(layers)


#: speculators' EAGLE-3 layout: its one decoder layer is ``layers.0``, the public layout's ``midlayer``.
SPECULATORS_KEYS = {r"^layers\.0\.": "midlayer."}


def from_speculators_layout(raw: dict, directory) -> dict:
    """A config.json of vLLM's ``speculators`` EAGLE-3 layout (``speculators_model_type: eagle3``, the layer config
    under ``transformer_layer_config``) in the public layout; any other config as it is."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return raw
    layer = raw.get("transformer_layer_config")
    if kind != "eagle3" or not isinstance(layer, dict):
        raise CheckpointError(f"{directory}: a speculators draft of type {kind!r} is not an EAGLE-3 draft blockspec "
                              "runs (speculators_model_type 'eagle3' with a transformer_layer_config)")
    if layer.get("model_type", "llama") != "llama" or int(layer.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"{directory}: blockspec runs speculators EAGLE-3 drafts of one llama layer, not "
                              f"{layer.get('num_hidden_layers')} {layer.get('model_type')} layers")
    if raw.get("norm_before_fc"):
        raise CheckpointError(f"{directory}: norm_before_fc set in config.json, which blockspec does not run")
    converted = {**layer, "architectures": [ARCHITECTURE], "draft_vocab_size": raw.get("draft_vocab_size"),
                 "norm_before_residual": raw.get("norm_before_residual", True),
                 "eagle_config": {"use_aux_hidden_state": True}}
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        converted["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    if raw.get("target_hidden_size") is not None:
        converted["target_hidden_size"] = raw["target_hidden_size"]
    return converted


def load_eagle3_model(directory) -> Eagle3DraftModel:
    """Load an EAGLE-3 draft: the public layout (EAGLE's, SpecForge's) or vLLM speculators'."""
    raw = read_config(directory)
    config = from_speculators_layout(raw, directory)
    speculators = config is not raw
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise CheckpointError(f"{directory} is not an EAGLE-3 draft: config.json architectures is {architectures}, "
                              f"expected ['{ARCHITECTURE}']")
    require_keys(config, ["hidden_size", "num_attention_heads", "vocab_size"], directory)
    require_sizes(config, directory)
    require_weights(directory)
    if speculators:
        model = load_pretrained_strict(Eagle3DraftModel, directory, dtype=torch.float32,
                                       config=LlamaConfig.from_dict(config), key_mapping=SPECULATORS_KEYS)
    else:
        model = load_pretrained_strict(Eagle3DraftModel, directory, dtype=torch.float32)
    model.check_draft_vocabulary(directory)
    return model
