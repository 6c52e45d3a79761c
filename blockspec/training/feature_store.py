"""The frozen target's context features kept on disk instead of in memory.

One safetensors file per training sequence, named by a hash of its tokens, so the store
serves every run, resume and DDP rank that trains on the same target and layers: the
features of a sequence are computed once, ever. A run on 7500 SmolLM2 responses keeps
about 7.5 GB of features; on disk that is page cache the kernel can drop, not process
memory that can run a 24 GB machine out. Files are written atomically (a crash leaves no
half file), and one that cannot be read is recomputed. A run reading some of the stored layers
(an MTP head reads the last of a DFlash run's three) is served from the same files.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from blockspec.errors import BlockspecError
from blockspec.io import write_file_atomically, write_text_atomically

FINGERPRINT_FILE = "features.json"
TENSOR_NAME = "features"


def target_fingerprint(target_model, layer_ids: list[int], dtype: torch.dtype) -> dict:
    """What the stored features depend on: the target's weights, the layers read, the dtype kept.

    The weights are identified by a digest of their first rows (cheap, and different for any
    other checkpoint of the same architecture), not by their path, which a user may reuse.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(target_model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    return {
        "format": 1,
        "target": str(getattr(target_model.config, "_name_or_path", "")),
        "target_weights_sha256": digest.hexdigest(),
        "target_dtype": str(next(target_model.parameters()).dtype).removeprefix("torch."),
        "layer_ids": list(layer_ids),
        "dtype": str(dtype).removeprefix("torch."),
    }


class FeatureStore:
    """Features of the layers ``fingerprint`` names, or of a superset of them already on disk."""

    def __init__(self, directory: str | Path, fingerprint: dict):
        self.directory = Path(directory)
        self.recomputed_unreadable = 0
        self.directory.mkdir(parents=True, exist_ok=True)
        wanted = list(fingerprint["layer_ids"])
        #: The layers each file holds (what a missing sequence must be computed for).
        self.layer_ids = self._check_fingerprint(fingerprint)
        columns = [self.layer_ids.index(layer) for layer in wanted]
        self._columns = None if columns == list(range(len(self.layer_ids))) else columns  # None: every layer

    def _check_fingerprint(self, fingerprint: dict) -> list[int]:
        path = self.directory / FINGERPRINT_FILE
        if not path.exists():
            write_text_atomically(path, json.dumps(fingerprint, indent=2) + "\n")
            return list(fingerprint["layer_ids"])
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise BlockspecError(f"{path} is not valid JSON ({error}): remove the feature cache "
                                 f"{self.directory} or pass another --feature-cache") from None
        differing = sorted(key for key in fingerprint.keys() | stored.keys()
                           if stored.get(key) != fingerprint.get(key))
        stored_layers = list(stored.get("layer_ids") or [])
        if differing == ["layer_ids"] and set(fingerprint["layer_ids"]) <= set(stored_layers):
            return stored_layers
        if differing:
            raise BlockspecError(
                f"the feature cache {self.directory} holds features of another target or setting "
                f"(differs in: {', '.join(differing)}): pass another --feature-cache directory, "
                f"or remove this one to rebuild it")
        return stored_layers

    def select(self, features: torch.Tensor) -> torch.Tensor:
        """The wanted layers' columns of features of every stored layer ([T, stored * D] -> [T, wanted * D])."""
        if self._columns is None:
            return features
        per_layer = features.reshape(features.shape[0], len(self.layer_ids), -1)
        return per_layer[:, self._columns].reshape(features.shape[0], -1).clone()

    def path(self, token_ids: torch.Tensor) -> Path:
        name = hashlib.sha256(token_ids.to(torch.int64).cpu().numpy().tobytes()).hexdigest()
        return self.directory / name[:2] / f"{name}.safetensors"

    def load(self, token_ids: torch.Tensor) -> torch.Tensor | None:
        path = self.path(token_ids)
        if not path.exists():
            return None
        try:
            features = load_file(path)[TENSOR_NAME]
        except (SafetensorError, KeyError, OSError):
            features = None
        if features is None or features.shape[0] != token_ids.numel():
            self.recomputed_unreadable += 1
            return None
        return self.select(features)

    def save(self, token_ids: torch.Tensor, features: torch.Tensor) -> None:
        """Keep ``features`` of every stored layer (``layer_ids``) of a sequence."""
        path = self.path(token_ids)
        path.parent.mkdir(exist_ok=True)
        write_file_atomically(path, lambda tmp: save_file({TENSOR_NAME: features.contiguous()}, tmp))

    def summary(self) -> str:
        unreadable = f"; {self.recomputed_unreadable} unreadable files recomputed" if self.recomputed_unreadable else ""
        return f"feature cache {self.directory}: {len(self)} sequences{unreadable}"

    def __len__(self) -> int:
        return sum(1 for _ in self.directory.glob("*/*.safetensors"))

