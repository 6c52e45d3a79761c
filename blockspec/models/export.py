"""Drafts in the layouts other engines load: ``export_draft(directory, "vllm", out)``.

- ``vllm`` / ``speculators``: vLLM's ``speculators`` layout (``speculators_model_type`` dflash or eagle3), which vLLM
  reads natively and blockspec loads back;
- ``hf``: the public DFlash / EAGLE-3 layout blockspec saves (a checked copy).

Engines hand a drafter the outputs of target layers as their residual streams carry them, before the final norm.
A drafter that reads the last layer after the final norm (Hugging Face's ``hidden_states[L]``) cannot run there,
so its export to an engine's layout is refused by name. GGUF and SGLang are refused: blockspec writes neither.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from blockspec.errors import CheckpointError
from blockspec.io import save_atomically
from blockspec.models.checkpoint import read_config

EXPORT_FORMATS = ("vllm", "speculators", "hf")
REFUSED_FORMATS = {
    "gguf": "blockspec does not write GGUF: export --to hf and convert that with llama.cpp's convert_hf_to_gguf.py",
    "sglang": "blockspec has no SGLang to check an export against: --to hf writes the public layout",
}
_DFLASH, _EAGLE3 = "DFlashDraftModel", "LlamaForCausalLMEagle3"
#: Keys of the public layouts' config.json that speculators keeps outside ``transformer_layer_config``.
_DRAFT_KEYS = ("architectures", "dflash_config", "eagle_config", "draft_vocab_size", "num_target_layers",
               "target_hidden_size", "block_size", "mask_token_id", "norm_before_residual")


def export_draft(directory, to: str, out, *, verifier: str | None = None, force: bool = False) -> Path:
    """Write the draft at ``directory`` in the layout ``to`` at ``out`` (atomically; an existing ``out`` only with
    ``force``); ``verifier``: the target's name or path, recorded where the layout has a place for it."""
    if to in REFUSED_FORMATS:
        raise CheckpointError(f"--to {to}: {REFUSED_FORMATS[to]}")
    if to not in EXPORT_FORMATS:
        raise CheckpointError(f"--to must be one of {', '.join(EXPORT_FORMATS)}, got {to!r}")
    directory, out = Path(directory), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise CheckpointError(f"{out} already exists: choose another --out, or pass --force to replace it")
    raw = read_config(directory)
    kind = _kind(raw, directory)
    if to == "hf":
        save_atomically(lambda tmp: _copy_files(directory, Path(tmp)), out)
        return out
    _refuse_post_norm_features(raw, kind, directory)
    if (directory / "mask_embedding.pt").is_file():
        raise CheckpointError(f"{directory} ships its own mask embedding (mask_embedding.pt), which the speculators "
                              "layout has no place for")
    config = _speculators_dflash(raw) if kind == _DFLASH else _speculators_eagle3(raw)
    config["speculators_config"]["verifier"] = {"name_or_path": verifier, "architectures": []}

    def write(tmp):
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = load_file(_single_weights(directory))
        if kind == _EAGLE3:
            tensors = {_eagle3_key(name): tensor for name, tensor in tensors.items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})

    save_atomically(write, out)
    return out


def _kind(raw: dict, directory) -> str:
    architectures = raw.get("architectures") or []
    for kind in (_DFLASH, _EAGLE3):
        if kind in architectures:
            return kind
    raise CheckpointError(f"{directory}: only DFlash and EAGLE-3 drafts export (architectures {architectures})")


def _refuse_post_norm_features(raw: dict, kind: str, directory) -> None:
    """The last target layer's output after the final norm is not what an engine exposes: refuse such a drafter."""
    layers = raw.get("num_target_layers")
    if layers is None:
        return
    if kind == _DFLASH:
        read = (raw.get("dflash_config") or {}).get("target_layer_ids") or raw.get("target_layer_ids") or []
        last = int(layers) - 1
    else:
        read = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or []
        last = int(layers)  # input-of-layer indices: L is the output of the last layer
    if last in [int(i) for i in read]:
        raise CheckpointError(f"{directory} reads the target's last layer after its final norm (Hugging Face's "
                              f"hidden_states[{layers}]), which vLLM and llama.cpp do not expose: train a drafter "
                              f"whose --target-layers stop below {layers - 1} to run it in an engine")


def _speculators_dflash(raw: dict) -> dict:
    nested = raw.get("dflash_config") or {}
    block = int(nested.get("block_size", raw.get("block_size", 16)))
    config = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
              "transformer_layer_config": _layer_config(raw),
              "draft_vocab_size": raw.get("draft_vocab_size") or raw["vocab_size"], "block_size": block,
              "mask_token_id": nested.get("mask_token_id", raw.get("mask_token_id")),
              "aux_hidden_state_layer_ids": [int(i) + 1 for i in nested["target_layer_ids"]],
              "speculators_config": _proposal("dflash", block - 1)}
    if raw.get("target_hidden_size") is not None:
        config["target_hidden_size"] = raw["target_hidden_size"]
    return config


def _speculators_eagle3(raw: dict) -> dict:
    eagle = raw.get("eagle_config") or {}
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "transformer_layer_config": {**_layer_config(raw), "num_hidden_layers": 1},
              "draft_vocab_size": raw.get("draft_vocab_size") or raw["vocab_size"],
              "norm_before_residual": bool(raw.get("norm_before_residual", False)), "norm_before_fc": False,
              "speculators_config": _proposal("eagle3", int(eagle.get("ttt_steps") or 4))}
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        config["eagle_aux_hidden_state_layer_ids"] = list(eagle["eagle_aux_hidden_state_layer_ids"])
    if raw.get("target_hidden_size") is not None:
        config["target_hidden_size"] = raw["target_hidden_size"]
    return config


def _layer_config(raw: dict) -> dict:
    return {key: value for key, value in raw.items() if key not in _DRAFT_KEYS}


def _proposal(algorithm: str, tokens: int) -> dict:
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens}]}


def _eagle3_key(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def _single_weights(directory: Path) -> Path:
    weights = directory / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{directory} has no model.safetensors: export reads one safetensors file")
    return weights


def _copy_files(directory: Path, out: Path) -> None:
    for path in sorted(directory.iterdir()):
        if path.is_file():
            shutil.copy2(path, out / path.name)
