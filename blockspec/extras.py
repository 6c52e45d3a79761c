"""The optional parts of blockspec and the packages each needs (pyproject.toml's extras)."""

from __future__ import annotations

import importlib

from blockspec.errors import BlockspecError

EXTRAS = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "httpx"),
    "bench": ("matplotlib",),
}


def missing_modules(extra: str) -> list[str]:
    missing = []
    for module in EXTRAS[extra]:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    return missing


def require_extra(extra: str, what: str, *, otherwise: str = "") -> None:
    """Refuse ``what`` up front, before any model loads, when a package of ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        alternative = f", or {otherwise}" if otherwise else ""
        raise BlockspecError(f"{what} needs {', '.join(missing)}: pip install 'blockspec[{extra}]'{alternative}")
