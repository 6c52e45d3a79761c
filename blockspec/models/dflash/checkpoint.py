"""Loading, saving and fitting a DFlash drafter: ours, z-lab's, SpecForge's and vLLM speculators' layouts."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import Qwen3Config

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
from blockspec.models.dflash.config import SLIDING, has_reduced_vocabulary, target_width
from blockspec.models.dflash.markov import dspark_settings
from blockspec.models.dflash.modules import DFlashDraftModel

#: A mask embedding shipped beside the weights (vLLM's name): it replaces the mask token's embedding row.
MASK_EMBEDDING_FILE = "mask_embedding.pt"

#: Weights some drafts ship that blockspec cannot use (it drafts over the target's own embedding, and its
#: head unless the draft has a reduced vocabulary of its own).
_UNUSABLE_WEIGHTS = {"embed_tokens.": "its own token embedding", "mask_hidden": "a mask hidden state"}

_VOCABULARY_WEIGHTS = {"lm_head.": "its own LM head", "d2t": "a draft vocabulary map", "t2d": "a draft vocabulary map"}

#: speculators' DFlash settings blockspec cannot run, refused by name rather than ignored (the extra residuals, and
#: a DFlash2 draft's mixture-of-experts feed-forward).
SPECULATORS_UNSUPPORTED = ("dflash_context_residual", "dflash_block_position_embedding",
                           "dflash_gated_layer_fusion")
#: speculators' DFlash2 keys, carried into dflash_config.
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
                 "output_multiplier", "final_logit_softcapping", "attention_value_scale")

#: ``architectures`` of the DFlash-family layouts blockspec loads: DFlash's (Domino's drafts go by it too, or by
#: their own), and DSpark's (a DFlash backbone with a Markov head, DeepSpec's and SpecForge's names).
DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DominoDraftModel", "DFlash2DraftModel")
DSPARK_ARCHITECTURES = ("DSparkDraftModel", "Qwen3DSparkModel")

#: The settings of DSpark's heads and block convention, carried over from a speculators config.
_DSPARK_KEYS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                "sample_from_anchor")


def from_speculators_layout(raw: dict, directory) -> dict:
    """A config.json of vLLM's ``speculators`` DFlash layout (``speculators_model_type: dflash``: the layer config
    under ``transformer_layer_config``, hidden-state indices in ``aux_hidden_state_layer_ids``) in the public
    DFlash layout; any other config as it is. Its weights carry the same names."""
    kind = raw.get("speculators_model_type")
    if kind is None:
        return _flat_aux_layers(raw, directory)
    if kind not in ("dflash", "dspark", "dflash2"):
        raise CheckpointError(f"{directory}: speculators_model_type {kind!r} is not supported: blockspec runs "
                              "speculators' 'dflash', 'dflash2' and 'dspark' drafts (and its own 'eagle3' layout "
                              "through --method eagle3)")
    if kind == "dflash2" and raw.get("draft_ffn_type", "dense") != "dense":
        raise CheckpointError(f"{directory}: draft_ffn_type {raw['draft_ffn_type']!r} (a mixture-of-experts draft "
                              "layer) is not supported: blockspec runs dense DFlash2 drafts")
    on = [name for name in SPECULATORS_UNSUPPORTED if raw.get(name)]
    if on:
        raise CheckpointError(f"{directory}: {', '.join(on)} set in config.json, which blockspec does not run")
    layer = raw.get("transformer_layer_config")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(layer, dict) or not aux or raw.get("mask_token_id") is None:
        raise CheckpointError(f"{directory}/config.json: a speculators DFlash draft needs transformer_layer_config, "
                              "aux_hidden_state_layer_ids and mask_token_id")
    architecture = {"dspark": "DSparkDraftModel", "dflash2": "DFlash2DraftModel"}.get(kind, "DFlashDraftModel")
    converted = {**layer, "architectures": [architecture], "draft_vocab_size": raw.get("draft_vocab_size"),
                 # hidden-state indices (0: the embeddings) to the outputs of layers, as dflash_config counts them
                 "dflash_config": {"mask_token_id": raw["mask_token_id"], "block_size": raw.get("block_size", 8),
                                   "target_layer_ids": [int(i) - 1 for i in aux]}}
    if raw.get("target_hidden_size") is not None:
        converted["target_hidden_size"] = raw["target_hidden_size"]
    converted.update({key: raw[key] for key in _DSPARK_KEYS if raw.get(key) is not None})
    converted["dflash_config"].update({key: raw[key] for key in _DFLASH2_KEYS if raw.get(key) is not None})
    if kind == "dflash2":  # its sliding windows see the whole block (bidirectional) unless it says otherwise
        converted.setdefault("is_causal", not raw.get("sliding_window_non_causal", True))
    if kind == "dspark" and not raw.get("markov_rank"):
        raise CheckpointError(f"{directory}/config.json: a speculators DSpark draft needs markov_rank >= 1")
    return converted


def _flat_aux_layers(raw: dict, directory) -> dict:
    """A flat config that names the layers it reads as hidden-state indices (``aux_hidden_state_layer_ids``,
    1-based: 0 is the embeddings), as DSpark's DeepSpec configs may: the same layers as ``target_layer_ids``."""
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        return raw
    nested = raw.get("dflash_config") or {}
    layers = [int(i) - 1 for i in aux]
    given = nested.get("target_layer_ids", raw.get("target_layer_ids"))
    if given is not None and [int(i) for i in given] != layers:
        raise CheckpointError(f"{directory}/config.json: aux_hidden_state_layer_ids {list(aux)} (1-based) and "
                              f"target_layer_ids {list(given)} name different layers")
    return {**raw, "dflash_config": {**nested, "target_layer_ids": layers}}


def load_dflash_model(directory) -> DFlashDraftModel:
    """Load a DFlash draft checkpoint (ours, z-lab's, SpecForge's, or vLLM speculators' layout)."""
    read = read_config(directory)
    raw = from_speculators_layout(read, directory)
    architectures = raw.get("architectures") or []
    if not set(architectures) & {*DFLASH_ARCHITECTURES, *DSPARK_ARCHITECTURES}:
        raise CheckpointError(
            f"{directory} is not a DFlash or DSpark draft: config.json architectures is {architectures}, "
            f"expected one of {[*DFLASH_ARCHITECTURES, *DSPARK_ARCHITECTURES]}"
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
    try:
        settings = dspark_settings(raw)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}/config.json: {error}") from None
    if set(architectures) & set(DSPARK_ARCHITECTURES) and settings is None:
        raise CheckpointError(f"{directory}/config.json: a DSpark draft needs its Markov head's markov_rank >= 1")
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
    """Save in the public layout, atomically (``write_dflash_model`` into a temporary directory)."""
    save_atomically(lambda tmp: write_dflash_model(model, tmp), directory)


def write_dflash_model(model: DFlashDraftModel, directory) -> None:
    """Write the public layout into ``directory`` (a mask embedding of its own beside the weights): DSpark's name for
    a drafter with a Markov head, DFlash2's for one with a candidate selector."""
    architecture = DSPARK_ARCHITECTURES[0] if model.markov_head is not None else \
        "DFlash2DraftModel" if model.candidate_selector is not None else "DFlashDraftModel"
    model.save_pretrained(directory, safe_serialization=True)
    config = Path(directory) / "config.json"  # save_pretrained names the class; a DSpark draft goes by its own name
    config.write_text(json.dumps({**json.loads(config.read_text()), "architectures": [architecture]}, indent=2))
    if model.mask_embedding is not None:
        torch.save({"embedding": model.mask_embedding.detach().cpu(), "mask_token_id": int(model.mask_token_id)},
                   Path(directory) / MASK_EMBEDDING_FILE)
