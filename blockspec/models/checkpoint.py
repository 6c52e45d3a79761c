"""Checks and helpers shared by every drafter checkpoint (HF ``save_pretrained`` layout)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError

from blockspec.errors import CheckpointError

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def read_config(directory: str | Path) -> dict:
    """config.json of a checkpoint directory, with a clear error when it is absent or broken."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"draft checkpoint {directory} does not exist or is not a directory")
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{directory} has no config.json: is it a checkpoint saved with save_pretrained?")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error}); re-save the checkpoint") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config


def require_weights(directory: str | Path) -> None:
    directory = Path(directory)
    if not any((directory / name).is_file() for name in WEIGHT_FILES):
        raise CheckpointError(
            f"{directory} holds no weights: expected one of {', '.join(WEIGHT_FILES)}"
        )


def require_keys(config: dict, keys: list[str], path: str | Path) -> None:
    missing = [key for key in keys if config.get(key) is None]
    if missing:
        raise CheckpointError(f"{Path(path) / 'config.json'} lacks {', '.join(missing)}")


#: Sizes a network is built from: each must be a whole number >= 1 where a config sets it.
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size",
             "vocab_size", "head_dim")
#: What a config's own validation raises (transformers' strict dataclasses), reported as the file's fault.
CONFIG_ERRORS = (StrictDataclassError, ValueError, TypeError)


#: The architectures of drafter checkpoints (ours and the layouts blockspec loads), by what they are.
DRAFT_ARCHITECTURES = {"DFlashDraftModel": "a DFlash draft", "DSparkDraftModel": "a DSpark draft",
                       "Qwen3DSparkModel": "a DSpark draft", "DominoDraftModel": "a Domino draft",
                       "LlamaForCausalLMEagle3": "an EAGLE-3 draft",
                       "MTPDraftModel": "an MTP draft"}
#: Config keys only drafter checkpoints carry.
DRAFT_CONFIG_KEYS = {"dflash_config": "a DFlash draft", "eagle_config": "an EAGLE draft",
                     "speculators_config": "a speculators draft"}


def draft_kind(config: dict) -> str | None:
    """What kind of drafter checkpoint a config.json describes ("a DFlash draft"), None for anything else."""
    for architecture in config.get("architectures") or []:
        if architecture in DRAFT_ARCHITECTURES:
            return DRAFT_ARCHITECTURES[architecture]
    return next((kind for key, kind in DRAFT_CONFIG_KEYS.items() if key in config), None)


def is_whole_number(value, minimum: int = 1) -> bool:
    """An int (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def require_sizes(config: dict, path: str | Path, keys: tuple[str, ...] = SIZE_KEYS) -> None:
    """Every size of ``keys`` the config sets is a whole number >= 1 (a network of -1 layers is a typo, not a model)."""
    for key in keys:
        value = config.get(key)
        if value is not None and not is_whole_number(value):
            raise CheckpointError(f"{Path(path) / 'config.json'}: {key} must be a whole number >= 1, got {value!r}")


def load_pretrained_strict(model_class, directory: str | Path, **kwargs):
    """``from_pretrained`` that refuses missing weights instead of initialising them randomly."""
    kwargs.setdefault("ignore_mismatched_sizes", True)  # reported below by name, not raised from deep inside
    try:
        model, info = model_class.from_pretrained(str(directory), output_loading_info=True, **kwargs)
    except StrictDataclassError as error:
        raise CheckpointError(f"{Path(directory) / 'config.json'} is not a valid config: {error}") from error
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as error:
        raise CheckpointError(f"could not read the weights in {directory}: {error}") from error
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise CheckpointError(
            f"{directory} is missing {len(missing)} weight(s), e.g. {', '.join(missing[:4])}; "
            "the checkpoint is incomplete or was saved for another architecture"
        )
    if info.get("mismatched_keys"):
        shown = "; ".join(_describe_mismatch(m) for m in list(info["mismatched_keys"])[:4])
        raise CheckpointError(f"{directory} has weights of the wrong shape for its config.json: {shown}")
    if info.get("unexpected_keys"):
        warnings.warn(f"{directory}: ignoring unknown weights {sorted(info['unexpected_keys'])[:4]}")
    return model


def _describe_mismatch(mismatch) -> str:
    if isinstance(mismatch, (tuple, list)) and len(mismatch) == 3:
        key, found, expected = mismatch
        return f"{key} is {tuple(found)}, expected {tuple(expected)}"
    return str(mismatch)
