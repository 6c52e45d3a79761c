"""Drafters and their checkpoints: one registry that builds any drafter by method name."""

from __future__ import annotations

import inspect
from pathlib import Path

from blockspec.errors import BlockspecError
from blockspec.models.checkpoint import read_config

#: Drafting methods; "ar" (no drafter) is the CLI's fourth choice.
DRAFT_METHODS = ("dflash", "eagle3", "mtp", "draft", "ngram")
#: Methods that load a checkpoint of their own kind (draft also takes a known model name).
CHECKPOINT_METHODS = ("dflash", "eagle3", "mtp")
_CHECKPOINT_KIND = {"dflash": "a DFlash", "eagle3": "an EAGLE-3", "mtp": "an MTP"}
METHODS = DRAFT_METHODS


def detect_method(draft) -> str:
    """The method a draft checkpoint directory (or known draft model name) is for."""
    from blockspec import hub

    if not Path(draft).is_dir() and str(draft) in hub.KNOWN_MODELS:
        return "draft"
    architectures = read_config(draft).get("architectures") or []
    if "DFlashDraftModel" in architectures:
        return "dflash"
    if "LlamaForCausalLMEagle3" in architectures:
        return "eagle3"
    if "MTPDraftModel" in architectures:
        return "mtp"
    if any(name.endswith("ForCausalLM") for name in architectures):
        return "draft"
    raise BlockspecError(
        f"cannot tell which kind of drafter {draft} holds (architectures {architectures}); "
        f"pass --method, one of {', '.join(DRAFT_METHODS)}"
    )


def build_drafter(method: str, target, draft: str | None = None, **options):
    """A drafter for ``target`` (a ``Target``).

    dflash, eagle3, mtp: ``draft`` is a checkpoint directory of that kind; draft: ``draft`` is a causal LM
    directory or a known model name; ngram: no ``draft`` (prompt lookup). ``options`` go to
    the drafter (e.g. sample_drafts, block_size, max_ngram, min_ngram).
    """
    if method not in DRAFT_METHODS:
        hint = ": 'ar' decodes without a drafter (pass drafter=None)" if method == "ar" else ""
        raise BlockspecError(f"unknown drafting method {method!r}{hint}; choose one of {', '.join(DRAFT_METHODS)}")
    if method == "ngram":
        if draft is not None:
            raise BlockspecError(f"the ngram method drafts from the context and takes no draft model, got {draft!r}")
        from blockspec.drafters.ngram import PromptLookupDrafter

        return _call(PromptLookupDrafter, method, **options)
    if draft is None:
        what = f"{_CHECKPOINT_KIND.get(method, method)} checkpoint directory" if method in CHECKPOINT_METHODS else \
            "a causal LM directory or a known model name such as qwen2.5-coder-0.5b-instruct"
        raise BlockspecError(f"the {method} method needs a draft: {what}")
    if method == "dflash":
        from blockspec.models.dflash import load_dflash_drafter

        return _call(load_dflash_drafter, method, draft, target.model, **options)
    if method in ("eagle3", "mtp"):
        from blockspec.drafters.recursive import load_recursive_drafter

        return _call(load_recursive_drafter, method, draft, target.model, method, **options)
    from blockspec.drafters.draft_model import load_draft_model_drafter

    return _call(load_draft_model_drafter, method, draft, target, **options)


def load_drafter(directory, target, method: str | None = None, **options):
    """A drafter for ``target`` from a checkpoint directory (the method read from it if not given)."""
    return build_drafter(method or detect_method(directory), target, directory, **options)


def _call(factory, method: str, *args, **options):
    """``factory(*args, **options)``, refusing options it does not take with a clear message."""
    parameters = inspect.signature(factory).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if not takes_any:
        unknown = sorted(set(options) - set(parameters))
        if unknown:
            accepted = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
                        or (p.default is not inspect.Parameter.empty)]
            raise BlockspecError(f"the {method} method takes no option {', '.join(unknown)}: "
                                 f"its options are {', '.join(accepted) or 'none'}")
    return factory(*args, **options)
