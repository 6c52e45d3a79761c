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
from blockspec.models.checkpoint import load_pretrained_strict, read_config, require_keys, require_sizes, require_weights
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

    def forward(self, embeddings, hidden, rope, past, mask):
        residual = hidden
        joint = torch.cat([self.input_layernorm(embeddings), self.hidden_norm(hidden)], dim=-1)
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


def load_eagle3_model(directory) -> Eagle3DraftModel:
    config = read_config(directory)
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise CheckpointError(f"{directory} is not an EAGLE-3 draft: config.json architectures is {architectures}, "
                              f"expected ['{ARCHITECTURE}']")
    require_keys(config, ["hidden_size", "num_attention_heads", "vocab_size"], directory)
    require_sizes(config, directory)
    require_weights(directory)
    model = load_pretrained_strict(Eagle3DraftModel, directory, dtype=torch.float32)
    model.check_draft_vocabulary(directory)
    return model
