"""What differs between drafters in training: the model, its loss, its drafter, its files.

The trainer owns everything else (data, loop, optimizer, DDP, checkpoints, evaluation) and
calls one ``TrainingMethod``:

- dflash: random anchors, block-sparse mask, decayed cross-entropy over the block;
- eagle3 / mtp: the recursion unrolled ``ttt_steps`` times (training-time test), each step
  on its own previous hidden states, loss decayed by step; draft vocabulary = the most
  frequent response tokens;
- draft: a small causal LM made of a few of the target's own layers, trained on the
  target's responses (sequence-level distillation), embeddings and LM head frozen.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from blockspec.errors import BlockspecError
from blockspec.training.vocab_loss import head_cross_entropy, linear_soft_cross_entropy

TRAINABLE_METHODS = ("dflash", "dspark", "eagle3", "mtp", "draft")
#: Loss weight of unrolled step k is decay**k (EAGLE-3 uses 0.8; FastMTP decays faster).
DEFAULT_STEP_DECAY = {"eagle3": 0.8, "mtp": 0.6}
#: EAGLE-3 / MTP draft vocabulary when none is given (the most frequent response tokens); DFlash's is the
#: target's whole vocabulary unless one is given.
DEFAULT_RECURSIVE_VOCABULARY = 4096


@dataclass
class Batch:
    indices: list[int]
    input_ids: torch.LongTensor  # [B, T], right-padded
    loss_mask: torch.BoolTensor  # [B, T], True on response tokens
    lengths: torch.LongTensor  # [B]
    features: torch.Tensor | None  # [B, T, F] when the method reads target features


class TrainingMethod(Protocol):
    name: str

    def build(self, config, target, samples) -> torch.nn.Module:
        """A fresh trainable model on the target's device (seeded by the trainer)."""

    def load(self, directory) -> torch.nn.Module:
        """The model of a checkpoint this method wrote (for --resume)."""

    def feature_layers(self, model) -> list[int] | None:
        """Target layers whose outputs the model reads; None for none."""

    def loss(self, forward, model, batch: Batch, target, config, generator) -> tuple[torch.Tensor, float]:
        """(loss, accuracy) of one micro-batch; ``forward`` is the (maybe DDP-wrapped) model."""

    def drafter(self, model, target):
        """A drafter around a copy of the model, for held-out tau."""

    def write(self, model, directory, target) -> None:
        """Save the model in its public layout into ``directory`` (the trainer makes it atomic)."""

    def summary(self) -> str | None:
        """A line about the run the method alone can tell (None: nothing to add)."""


def training_method(name: str) -> TrainingMethod:
    methods = {"dflash": DFlashTraining, "dspark": DSparkTraining, "eagle3": RecursiveTraining,
               "mtp": RecursiveTraining, "draft": DraftModelTraining}
    if name not in methods:
        raise BlockspecError(f"cannot train method {name!r}: choose one of {', '.join(TRAINABLE_METHODS)} "
                             "(ngram needs no training)")
    return methods[name](name)


# ---------------------------------------------------------------------------
# DFlash
# ---------------------------------------------------------------------------

class DFlashTraining:
    def __init__(self, name="dflash"):
        self.name = name
        #: supervised block positions seen, and those whose label is outside a reduced draft vocabulary
        self.positions = 0
        self.outside = 0

    def build(self, config, target, samples):
        from blockspec.models.dflash.checkpoint import check_fits_target
        from blockspec.models.dflash.config import make_dflash_config
        from blockspec.models.dflash.modules import DFlashDraftModel
        from blockspec.models.target import copy_final_norm
        from blockspec.tokens import pick_mask_token

        target_model = target.model
        vocab = target_model.get_input_embeddings().weight.shape[0]
        mask_id = config.mask_token_id
        if mask_id is None:
            mask_id = pick_mask_token(target.tokenizer, vocab)
        draft_config = make_dflash_config(
            target_model.config, num_layers=config.num_layers, block_size=config.block_size,
            mask_token_id=mask_id, target_layer_ids=config.target_layer_ids,
            intermediate_size=config.intermediate_size)
        model = DFlashDraftModel(draft_config)
        check_fits_target(model, target_model.config, draft_name="the drafter to train")
        if config.soft_labels:
            check_soft_labels(model, target)
        copy_final_norm(model.norm, target_model)
        if config.draft_vocab_size and config.draft_vocab_size < vocab:
            if config.soft_labels:
                raise BlockspecError("--soft-labels learns the target's whole next-token distribution; it does not "
                                     "combine with a reduced --draft-vocab-size")
            vocabulary = frequent_tokens(samples, config.draft_vocab_size, target.stop_token_ids())
            model.compress_vocabulary(vocabulary, target_model.get_output_embeddings().weight)
        return model

    def load(self, directory):
        from blockspec.models.dflash.checkpoint import load_dflash_model

        return load_dflash_model(directory)

    def feature_layers(self, model):
        return list(model.target_layer_ids)

    def blocks_and_hidden(self, forward, model, batch, target, config, generator, frozen: bool = False):
        """The micro-batch's random anchored blocks and the drafter's final hidden states over them (without
        gradients when the backbone is ``frozen``)."""
        from blockspec.training.anchors import build_blocks

        blocks = build_blocks(batch.input_ids, batch.loss_mask, batch.lengths, block_size=config.block_size,
                              num_anchors=config.anchors_per_sequence, mask_token_id=model.mask_token_id,
                              gamma=config.loss_gamma, generator=generator, random_anchors=config.random_anchors)
        device = target.model.device
        with torch.no_grad():
            block_embeddings = target.model.get_input_embeddings()(blocks.block_ids.to(device))
        with torch.no_grad() if frozen else nullcontext():
            hidden = forward(block_embeddings, blocks.block_positions.to(device), batch.features.to(device),
                             blocks.context_positions.to(device), attention_mask=blocks.attention_mask.to(device))
        return blocks, hidden

    def loss(self, forward, model, batch, target, config, generator):
        blocks, hidden = self.blocks_and_hidden(forward, model, batch, target, config, generator)
        device = target.model.device
        # Only supervised positions go through the LM head: the anchors, unused slots and positions
        # past the sequence's end carry weight 0, and the vocabulary-wide head is the costliest step.
        supervised = blocks.weights > 0
        labels, weights = blocks.labels[supervised].to(device), blocks.weights[supervised].to(device)
        if model.compressed:
            return self._compressed_loss(model, hidden[supervised.to(device)], labels, weights)
        head = target.model.get_output_embeddings()
        if config.soft_labels:
            teacher = teacher_states(model, target, batch.features, blocks.block_positions, supervised)
            losses, hits = linear_soft_cross_entropy(hidden[supervised.to(device)], head.weight, teacher.to(device),
                                                     labels)
        else:
            losses, hits = head_cross_entropy(head, hidden[supervised.to(device)], labels)
        return block_loss(losses, hits, weights)

    def _compressed_loss(self, model, hidden, labels, weights):
        """The loss over the draft vocabulary's rows: a position whose label is outside them cannot be drafted,
        so it is masked (weight 0), counted, and scored as a miss."""
        rows = model.target_to_draft.to(labels.device)[labels]
        inside = rows >= 0
        self.positions += int(labels.numel())
        self.outside += int((~inside).sum())
        losses, hits = head_cross_entropy(model.lm_head, hidden, rows.clamp_min(0))
        loss, _ = block_loss(losses, hits, weights * inside)
        return loss, (hits & inside).float().mean().item() if hits.numel() else math.nan

    def summary(self) -> str | None:
        """The share of supervised positions a reduced draft vocabulary could not draft (None: full head)."""
        if not self.positions:
            return None
        return (f"labels outside the draft vocabulary: {self.outside} of {self.positions} supervised positions "
                f"({100 * self.outside / self.positions:.2f}%), masked from the loss")

    def drafter(self, model, target):
        from blockspec.drafters.dflash import DFlashDrafter

        return DFlashDrafter(copy.deepcopy(model), target.model)

    def write(self, model, directory, target):
        from blockspec.models.dflash.checkpoint import write_dflash_model

        write_dflash_model(model, directory)


#: Markov head rank when --markov-rank is not given.
DEFAULT_MARKOV_RANK = 64
#: Weight of the confidence head's loss (binary cross-entropy on whether each position's argmax is its label).
CONFIDENCE_LOSS_WEIGHT = 0.1


class DSparkTraining(DFlashTraining):
    """DSpark: DFlash's blocks and loss, the logits of each position biased by the Markov head given the true token
    before it (teacher forcing), and a confidence head learning whether each position's argmax is its label. The
    backbone trains with the heads, or stays frozen (--init-from a DFlash drafter, --freeze-backbone) as the
    public recipes allow: then it runs without gradients and only the heads learn. Blocks follow DFlash's
    convention (each masked slot predicts its own position: sample_from_anchor false), so a DFlash drafter's
    backbone carries over unchanged."""

    def build(self, config, target, samples):
        from blockspec.models.dflash.markov import DSparkSettings

        if config.soft_labels:
            raise BlockspecError("--soft-labels is a dflash switch: dspark learns the target's tokens")
        if config.markov_head_type == "rnn":
            raise BlockspecError("--markov-head rnn is run but not trained by blockspec: train vanilla or gated")
        if config.freeze_backbone and not config.init_from:
            raise BlockspecError("--freeze-backbone trains the heads on a trained backbone: add --init-from DIR (a "
                                 "DFlash or DSpark drafter)")
        model = super().build(config, target, samples)
        model.add_dspark_heads(DSparkSettings(config.markov_rank or DEFAULT_MARKOV_RANK,
                                              config.markov_head_type or "vanilla", config.confidence_head))
        if config.freeze_backbone:
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(name.startswith(("markov_head.", "confidence_head.")))
        return model

    def complete_weights(self, model, weights: dict) -> dict:
        """--init-from a DFlash drafter: its backbone, and this run's fresh heads."""
        fresh = {key: value for key, value in model.state_dict().items()
                 if key.startswith(("markov_head.", "confidence_head.")) and key not in weights}
        return {**weights, **fresh}

    def loss(self, forward, model, batch, target, config, generator):
        blocks, hidden = self.blocks_and_hidden(forward, model, batch, target, config, generator,
                                                frozen=config.freeze_backbone)
        device = target.model.device
        supervised = (blocks.weights > 0).to(device)
        labels, weights = blocks.labels.to(device)[supervised], blocks.weights.to(device)[supervised]
        # the token before each slot is the label of the slot before it (the anchor's token for the first)
        previous = blocks.labels.to(device).roll(1, dims=1)[supervised]
        hidden = hidden[supervised]
        head = model.lm_head if model.compressed else target.model.get_output_embeddings()
        if model.compressed:  # rows of the draft vocabulary; a label outside them cannot be drafted: weight 0
            to_rows = model.target_to_draft.to(device)
            labels, previous = to_rows[labels], to_rows[previous]
            weights = weights * (labels >= 0)
            labels = labels.clamp_min(0)
        bias, _, embedded = model.markov_head.step(previous, hidden, None)
        logits = head(hidden).float() + bias.float()
        losses = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        hits = (logits.detach().argmax(dim=-1) == labels) & (weights > 0)
        loss, accuracy = block_loss(losses, hits, weights)
        if model.confidence_head is not None:
            confidence = model.confidence_head(hidden.detach(), embedded.detach())
            loss = loss + CONFIDENCE_LOSS_WEIGHT * torch.nn.functional.binary_cross_entropy(confidence, hits.float())
        return loss, accuracy

    def drafter(self, model, target):
        from blockspec.drafters.chained import DSparkDrafter

        return DSparkDrafter(copy.deepcopy(model), target.model)


def block_loss(losses: torch.Tensor, hits: torch.BoolTensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The block loss from the supervised positions' cross-entropies: weighted by w_k and normalised
    by the weights' sum (positions of weight 0 add nothing, so they never go through the head);
    and the share of those positions whose argmax is the label."""
    loss = (losses * weights).sum() / weights.sum().clamp_min(1e-8)
    return loss, hits.float().mean().item() if hits.numel() else math.nan


def check_soft_labels(model, target) -> None:
    """Soft labels are read from the target's last layer (its normed output), which must be a context layer."""
    last = target.model.config.num_hidden_layers - 1
    head = target.model.get_output_embeddings()
    if last not in model.target_layer_ids:
        raise BlockspecError(f"--soft-labels reads the target's next-token distribution from its last layer: "
                             f"add {last} to --target-layers (now {','.join(map(str, model.target_layer_ids))})")
    if type(head) is not torch.nn.Linear or head.bias is not None:
        raise BlockspecError("--soft-labels needs a target whose LM head is a bias-free linear layer")


def teacher_states(model, target, features, block_positions, supervised) -> torch.Tensor:
    """The target's final (normed) hidden state that predicts each supervised block token.

    Block slot k of an anchor a holds token a+k; the target predicted it at position a+k-1, and
    the output of the target's last layer there, through the LM head, is that prediction.
    """
    last = model.target_layer_ids.index(target.model.config.num_hidden_layers - 1)
    width = features.shape[-1] // len(model.target_layer_ids)
    final_states = features[..., last * width:(last + 1) * width]
    rows = torch.arange(features.shape[0])[:, None].expand_as(block_positions)
    sources = (block_positions - 1).clamp_min(0)
    return final_states[rows[supervised], sources[supervised]]


# ---------------------------------------------------------------------------
# EAGLE-3 and MTP
# ---------------------------------------------------------------------------

class RecursiveTraining:
    def __init__(self, name: str):
        self.name = name

    def build(self, config, target, samples):
        target_model = target.model
        target_config = target_model.config
        vocab_size = int(min(config.draft_vocab_size or DEFAULT_RECURSIVE_VOCABULARY, target_config.vocab_size))
        if self.name == "eagle3":
            from blockspec.models.eagle3 import Eagle3DraftModel, make_eagle3_config

            model = Eagle3DraftModel(make_eagle3_config(
                target_config, draft_vocab_size=vocab_size, intermediate_size=config.intermediate_size,
                aux_layer_ids=[i + 1 for i in config.target_layer_ids] if config.target_layer_ids else None,
                ttt_steps=config.ttt_steps))
        else:
            from blockspec.models.mtp import MTPDraftModel, make_mtp_config

            model = MTPDraftModel(make_mtp_config(target_config, draft_vocab_size=vocab_size,
                                                  intermediate_size=config.intermediate_size,
                                                  ttt_steps=config.ttt_steps))
        if vocab_size < target_config.vocab_size:
            model.set_draft_vocabulary(frequent_tokens(samples, vocab_size, target.stop_token_ids()))
        if self.name == "eagle3":
            model.start_head_from_target(target_model)
        else:
            model.start_from_target(target_model)
        return model

    def load(self, directory):
        if self.name == "eagle3":
            from blockspec.models.eagle3 import load_eagle3_model

            return load_eagle3_model(directory)
        from blockspec.models.mtp import load_mtp_model

        return load_mtp_model(directory)

    def feature_layers(self, model):
        return list(model.feature_layers)

    def loss(self, forward, model, batch, target, config, generator):
        from blockspec.models.recursive_head import recursion_labels

        device = target.model.device
        steps = model.ttt_steps
        with torch.no_grad():
            embeddings = target.model.get_input_embeddings()(batch.input_ids.to(device))
        step_logits = forward(embeddings, batch.features.to(device), batch.lengths.to(device), steps)
        labels = recursion_labels(model, batch.input_ids, batch.loss_mask, batch.lengths, steps)
        decay = config.step_decay if config.step_decay is not None else DEFAULT_STEP_DECAY[self.name]
        total, weight_sum, accuracy = 0.0, 0.0, float("nan")
        for k, (logits, (step_labels, supervised)) in enumerate(zip(step_logits, labels)):
            supervised = supervised.to(device)
            if not bool(supervised.any()):
                total = total + 0.0 * logits.sum()
                continue
            chosen, wanted = logits[supervised], step_labels.to(device)[supervised]
            total = total + decay ** k * F.cross_entropy(chosen.float(), wanted)
            weight_sum += decay ** k
            if k == 0:
                accuracy = (chosen.detach().argmax(-1) == wanted).float().mean().item()
        return total / max(weight_sum, 1e-8), accuracy

    def drafter(self, model, target):
        from blockspec.drafters.eagle3_mtp import RecursiveDrafter

        return RecursiveDrafter(copy.deepcopy(model), target.model, name=self.name)

    def summary(self):
        return None

    def write(self, model, directory, target):
        model.save_pretrained(directory, safe_serialization=True)


def frequent_tokens(samples, count: int, always=()) -> torch.LongTensor:
    """The ``count`` target ids most frequent in the responses (stop ids always in), sorted; prompt
    tokens, then the lowest ids, fill a vocabulary larger than the responses' distinct tokens."""
    from blockspec.models.draft_vocab import most_frequent

    responses, prompts = Counter(), Counter()
    for sample in samples:
        responses.update(sample.input_ids[sample.loss_mask].tolist())
        prompts.update(sample.input_ids[~sample.loss_mask].tolist())
    return most_frequent(responses, count, always, fallback=prompts)


# ---------------------------------------------------------------------------
# A draft LM distilled from the target
# ---------------------------------------------------------------------------

class DraftModelTraining:
    def __init__(self, name="draft"):
        self.name = name

    def build(self, config, target, samples):
        return shrink_target(target.model, config.num_layers)

    def load(self, directory):
        from transformers import AutoModelForCausalLM

        from blockspec.models.checkpoint import require_weights

        require_weights(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        freeze_embeddings(model)
        return model

    def feature_layers(self, model):
        return None

    def loss(self, forward, model, batch, target, config, generator):
        device = target.model.device
        ids = batch.input_ids.to(device)
        width = ids.shape[1]
        attention = torch.arange(width, device=device)[None, :] < batch.lengths.to(device)[:, None]
        supervised = batch.loss_mask.to(device)[:, 1:]  # position i predicts token i + 1
        wanted = ids[:, 1:][supervised]
        if getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None):
            logits = forward(input_ids=ids, attention_mask=attention.long()).logits
            chosen = logits[:, :-1][supervised].float()
        else:
            # The frozen head scores only the supervised positions: the prompt and padding rows of a
            # whole-vocabulary head were most of a step's cost.
            out = forward(input_ids=ids, attention_mask=attention.long(), output_hidden_states=True,
                          logits_to_keep=1)
            final = out.hidden_states[-1][:, :-1]  # after the final norm: what the head reads
            chosen = model.get_output_embeddings()(final[supervised]).float()
        if not bool(supervised.any()):
            return 0.0 * chosen.sum(), float("nan")
        return F.cross_entropy(chosen, wanted), (chosen.detach().argmax(-1) == wanted).float().mean().item()

    def drafter(self, model, target):
        from blockspec.drafters.draft_lm import DraftModelDrafter

        return DraftModelDrafter(copy.deepcopy(model), target.model)

    def write(self, model, directory, target):
        model.save_pretrained(directory, safe_serialization=True)
        target.tokenizer.save_pretrained(directory)
        generation = getattr(target.model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(directory)

    def summary(self):
        return None


def shrink_target(target_model, num_layers: int):
    """A causal LM of the target's family built from ``num_layers`` of its layers, evenly spaced.

    The embeddings, final norm and LM head are the target's (frozen in training); the
    copied layers start where the target's are, so the draft starts as a shallow target.
    """
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(target_model.config)
    total = config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise BlockspecError(f"a draft LM needs 1..{total - 1} layers (the target has {total}), got {num_layers}")
    chosen = [round(i * (total - 1) / max(1, num_layers - 1)) for i in range(num_layers)] if num_layers > 1 else [0]
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in chosen]
    if hasattr(config, "max_window_layers"):
        config.max_window_layers = min(config.max_window_layers, num_layers)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target_model.state_dict()
    renamed = {}
    for key, value in source.items():
        parts = key.split(".")
        if "layers" in parts:
            at = parts.index("layers")
            index = int(parts[at + 1])
            if index not in chosen:
                continue
            parts[at + 1] = str(chosen.index(index))
        renamed[".".join(parts)] = value.detach().float()
    missing, unexpected = model.load_state_dict(renamed, strict=False)
    missing = [k for k in missing if "rotary" not in k]
    if missing or unexpected:
        raise BlockspecError(f"could not copy the target's layers into the draft LM (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    freeze_embeddings(model)
    return model


def freeze_embeddings(model) -> None:
    model.get_input_embeddings().weight.requires_grad_(False)
    model.get_output_embeddings().weight.requires_grad_(False)
