"""Drafters and their checkpoints."""

from __future__ import annotations

from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import read_config

METHODS = ("dflash",)


def detect_method(directory) -> str:
    architectures = read_config(directory).get("architectures") or []
    if "DFlashDraftModel" in architectures:
        return "dflash"
    raise BlockspecError(
        f"cannot tell which kind of drafter {directory} holds (architectures {architectures}); "
        f"pass --method, one of {', '.join(METHODS)}"
    )


def load_drafter(directory, target, method: str | None = None, **options):
    """A drafter for ``target`` (a ``Target``) from a checkpoint directory."""
    method = method or detect_method(directory)
    if method == "dflash":
        from blockspec.models.dflash import load_dflash_drafter

        return load_dflash_drafter(directory, target.model, **options)
    raise BlockspecError(f"unknown drafting method {method!r}: choose one of {', '.join(METHODS)}")
