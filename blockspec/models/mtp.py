"""MTP, FastMTP-style: ONE shared-weight multi-token-prediction module applied recursively.

The module is DeepSeek-V3's MTP block: RMSNorm(token embedding) and RMSNorm(previous hidden
state) concatenated, projected 2D -> D by ``eh_proj``, then one transformer block. Its
input at the first step is the target's last hidden state; each later step takes the
module's own output, so the same weights predict t+2, t+3, ... The output goes through
``norm`` and the TARGET's LM head (shared, frozen, never stored), restricted to a compressed
vocabulary of the K most frequent tokens when ``draft_vocab_size`` < V (d2t / t2d maps;
the verifier keeps output lossless whatever the draft vocabulary).

Checkpoint: a llama config.json with ``architectures: ["MTPDraftModel"]``, ``draft_vocab_size``,
``num_target_layers`` and ``mtp_config`` (feature layer, training steps), weights
``mtp_block.{enorm, hnorm, eh_proj, self_attn.*, mlp.*, input_layernorm,
post_attention_layernorm}``, ``norm``, ``d2t``, ``t2d``.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaPreTrainedModel, LlamaRotaryEmbedding

from blockspec.errors import CheckpointError, IncompatibleDraftError
from blockspec.models.checkpoint import (
    load_pretrained_strict,
    read_config,
    require_keys,
    require_sizes,
    require_weights,
)
from blockspec.models.recursive_head import CachedAttention, RecursiveDraftModel, make_llama_layer_config, mlp, rms_norm
from blockspec.models.target import copy_final_norm

ARCHITECTURE = "MTPDraftModel"


def make_mtp_config(target_config, *, draft_vocab_size: int | None = None, intermediate_size: int | None = None,
                    ttt_steps: int = 4) -> LlamaConfig:
    config = make_llama_layer_config(
        target_config, intermediate_size=intermediate_size,
        draft_vocab_size=int(draft_vocab_size or target_config.vocab_size),
        num_target_layers=target_config.num_hidden_layers,
        mtp_config={"feature_layer": target_config.num_hidden_layers - 1, "ttt_steps": int(ttt_steps)},
    )
    config.architectures = [ARCHITECTURE]
    return config


class MTPModule(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.enorm = rms_norm(config)
        self.hnorm = rms_norm(config)
        self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.self_attn = CachedAttention(config, input_size=config.hidden_size)
        self.mlp = mlp(config)
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)

    def forward(self, embeddings, hidden, rope, past, mask):
        hidden = self.eh_proj(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))
        attended, key_values = self.self_attn(self.input_layernorm(hidden), rope, past, mask)
        hidden = hidden + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), key_values


class MTPDraftModel(RecursiveDraftModel, LlamaPreTrainedModel):
    config_class = LlamaConfig
    _no_split_modules = ["MTPModule"]

    def __init__(self, config: LlamaConfig):
        LlamaPreTrainedModel.__init__(self, config)
        settings = getattr(config, "mtp_config", None) or {}
        layers = getattr(config, "num_target_layers", None)
        feature_layer = settings.get("feature_layer", None if layers is None else layers - 1)
        if feature_layer is None:
            raise CheckpointError("the MTP config has neither mtp_config.feature_layer nor num_target_layers")
        self.feature_layers = [int(feature_layer)]
        self.ttt_steps = int(settings.get("ttt_steps") or 4)
        self.mtp_block = MTPModule(config)
        self.norm = rms_norm(config)
        self.register_draft_vocabulary(config)
        # the target's LM head rows of the draft vocabulary: shared, frozen, not saved
        self.register_buffer("head_weight", torch.zeros(0), persistent=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.post_init()

    @property
    def layer(self):
        return self.mtp_block

    def fuse(self, features):
        return features

    def head_logits(self, hidden):
        if self.head_weight.numel() == 0:
            raise IncompatibleDraftError("the MTP draft shares the target's LM head: call attach_target(target) first")
        return self.norm(hidden) @ self.head_weight.T

    def attach_target(self, target_model) -> None:
        """Take the target's LM head rows for the draft vocabulary (and its final norm at the start)."""
        head = target_model.get_output_embeddings().weight.detach()
        if head.shape[0] < self.t2d.shape[0] or head.shape[1] != self.config.hidden_size:
            raise IncompatibleDraftError(
                f"the MTP draft was made for a vocabulary of {self.t2d.shape[0]} x {self.config.hidden_size}, "
                f"the target's LM head is {tuple(head.shape)}: use a draft trained for this target")
        rows = head[self.draft_to_target.to(head.device)]
        self.head_weight = rows.to(self.norm.weight.device, self.norm.weight.dtype)

    def start_from_target(self, target_model) -> None:
        """The final norm starts at the target's, and the target's LM head rows are attached."""
        copy_final_norm(self.norm, target_model)
        self.attach_target(target_model)


def load_mtp_model(directory) -> MTPDraftModel:
    config = read_config(directory)
    architectures = config.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise CheckpointError(f"{directory} is not an MTP draft: config.json architectures is {architectures}, "
                              f"expected ['{ARCHITECTURE}']")
    require_keys(config, ["hidden_size", "num_attention_heads", "vocab_size", "num_target_layers"], directory)
    require_sizes(config, directory)
    require_weights(directory)
    model = load_pretrained_strict(MTPDraftModel, directory, dtype=torch.float32)
    model.check_draft_vocabulary(directory)
    return model
