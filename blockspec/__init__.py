"""blockspec: lossless speculative decoding with DFlash block-diffusion drafters."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# Imported on first use, so that `blockspec.hub` and the CLI's fast paths do not pay for torch.
_EXPORTS = {
    "GenerationConfig": "blockspec.decoding.sequence",
    "GenerationStats": "blockspec.decoding.sequence",
    "speculative_generate": "blockspec.decoding.generate",
    "hf_custom_generate": "blockspec.decoding.hf_generate",
    "GenerationResult": "blockspec.decoding.text",
    "generate_text": "blockspec.decoding.text",
    "stream_text": "blockspec.decoding.text",
    "BlockspecError": "blockspec.errors",
    "build_drafter": "blockspec.drafters.registry",
    "load_drafter": "blockspec.drafters.registry",
    "Target": "blockspec.models.target",
    "load_target": "blockspec.models.target",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'blockspec' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
