"""The one table of drafting methods, and building any drafter by method name.

This module imports no torch, so the command line can list methods before loading anything;
each method's drafter module is imported when that method is built.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from blockspec.errors import BlockspecError

#: The method that decodes without a drafter (one token per target forward).
AUTOREGRESSIVE = "ar"


@dataclass(frozen=True)
class DraftMethod:
    """One way to draft: what ``--draft`` must name for it and where its drafter is built."""

    name: str
    #: "checkpoint": a directory of this method's own checkpoint; "model": a causal LM directory or a
    #: known model name; None: nothing (the drafter needs no weights).
    draft: str | None
    #: ``architectures`` entries of config.json that mark a checkpoint of this method.
    architectures: tuple[str, ...]
    #: "module:function" building the drafter from (draft, target, **options).
    builder: str
    #: Words for error messages: "a DFlash checkpoint directory".
    described: str
    #: The method whose checkpoint it reads (a hybrid reads DFlash's), None for its own.
    draft_of: str | None = None
    #: Its name in sentences: "DFlash" ("" for the method's own name).
    label: str = ""

    def build(self, draft, target, **options):
        module, function = self.builder.split(":")
        factory = getattr(importlib.import_module(module), function)
        return _call(factory, self.name, draft, target, **options)


METHODS: dict[str, DraftMethod] = {m.name: m for m in (
    DraftMethod("dflash", "checkpoint", ("DFlashDraftModel", "DFlashSpeculator"), "blockspec.drafters.dflash:build",
                "a DFlash checkpoint directory", label="DFlash"),
    DraftMethod("dflash2", "checkpoint", ("DFlash2DraftModel",), "blockspec.drafters.chained:build_dflash2",
                "a DFlash2 checkpoint directory", label="DFlash2"),
    DraftMethod("dspark", "checkpoint", ("DSparkDraftModel", "Qwen3DSparkModel"), "blockspec.drafters.chained:build",
                "a DSpark checkpoint directory", label="DSpark"),
    DraftMethod("domino", "checkpoint", ("DominoDraftModel",), "blockspec.drafters.chained:build_domino",
                "a Domino checkpoint directory", label="Domino"),
    DraftMethod("eagle3", "checkpoint", ("LlamaForCausalLMEagle3", "Eagle3Speculator"),
                "blockspec.drafters.eagle3_mtp:build_eagle3",
                "an EAGLE-3 checkpoint directory", label="EAGLE-3"),
    DraftMethod("mtp", "checkpoint", ("MTPDraftModel",), "blockspec.drafters.eagle3_mtp:build_mtp",
                "an MTP checkpoint directory", label="MTP"),
    DraftMethod("draft", "model", (), "blockspec.drafters.draft_lm:build",
                "a causal LM directory or a known model name such as qwen2.5-coder-0.5b-instruct", label="draft-model"),
    DraftMethod("ngram", None, (), "blockspec.drafters.ngram:build", "nothing (prompt lookup)"),
    DraftMethod("suffix", None, (), "blockspec.drafters.suffix:build", "nothing (suffix drafting)"),
    DraftMethod("dflash+suffix", "checkpoint", (), "blockspec.drafters.hybrid:build_hybrid",
                "a DFlash checkpoint directory", draft_of="dflash"),
    DraftMethod("dflash+lookup", "checkpoint", (), "blockspec.drafters.hybrid:build_hybrid_lookup",
                "a DFlash checkpoint directory", draft_of="dflash"),
)}
#: Methods' former names, pointed to their new ones.
RENAMED_METHODS = {"dflash+ngram": "dflash+lookup"}
#: Drafting methods, in the order they are listed to users.
DRAFT_METHODS = tuple(METHODS)
#: Methods that load a checkpoint of their own kind.
CHECKPOINT_METHODS = tuple(name for name, m in METHODS.items() if m.draft == "checkpoint")
#: Methods that take a ``--draft``.
DRAFTED_METHODS = tuple(name for name, m in METHODS.items() if m.draft is not None)
#: Methods that read a DFlash-family checkpoint (DFlash itself, the hybrids over it, DFlash2's, DSpark's, Domino's).
DFLASH_METHODS = tuple(name for name, m in METHODS.items()
                       if "dflash" in (name, m.draft_of) or name in ("dflash2", "dspark", "domino"))

#: The drafters shipped in the package (folders under ``blockspec/assets/``): by the known target
#: they serve, then by method.
SHIPPED_DRAFTS = {
    "smollm2-135m-instruct": {"dflash": "dflash-smollm2-135m", "eagle3": "eagle3-smollm2-135m",
                              "mtp": "mtp-smollm2-135m", "draft": "draft-smollm2-135m"},
}


def detect_method(draft) -> str:
    """The method a draft checkpoint directory (or known draft model name) is for."""
    from blockspec import hub
    from blockspec.models.checkpoint import read_config

    if not Path(draft).is_dir() and str(draft) in hub.KNOWN_MODELS:
        return "draft"
    config = read_config(draft)
    if config.get("speculators_model_type") in ("dspark", "dflash2"):
        return config["speculators_model_type"]
    if (config.get("dflash_config") or {}).get("projector_type") == "domino":
        return "domino"
    architectures = config.get("architectures") or []
    for method in METHODS.values():
        if any(name in architectures for name in method.architectures):
            return method.name
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
    spec = METHODS.get(method)
    if spec is None:
        hint = ": 'ar' decodes without a drafter (pass drafter=None)" if method == AUTOREGRESSIVE else ""
        if method in RENAMED_METHODS:
            hint = f": it is now called {RENAMED_METHODS[method]!r}"
        raise BlockspecError(f"unknown drafting method {method!r}{hint}; choose one of {', '.join(DRAFT_METHODS)}")
    if spec.draft is None and draft is not None:
        raise BlockspecError(f"the {method} method drafts from the context and takes no draft model, got {draft!r}")
    if spec.draft is not None and draft is None:
        raise BlockspecError(f"the {method} method needs a draft: {spec.described}")
    return spec.build(draft, target, **options)


def load_drafter(directory, target, method: str | None = None, **options):
    """A drafter for ``target`` from a checkpoint directory (the method read from it if not given)."""
    return build_drafter(method or detect_method(directory), target, directory, **options)


def shipped_draft(target_name: str, method: str = "dflash", *, assets=None) -> Path | None:
    """The drafter of ``method`` shipped with the package for a known target (None if none is).

    A hybrid method gets the drafter of the method it reads (dflash+suffix: DFlash's).
    ``assets``: the folder holding the shipped drafters (default: the package's ``assets``).
    """
    spec = METHODS.get(method)
    kind = (spec.draft_of or method) if spec is not None else method
    asset = SHIPPED_DRAFTS.get(str(target_name), {}).get(kind)
    if asset is None:
        return None
    directory = Path(assets) / asset if assets is not None else resources.files("blockspec") / "assets" / asset
    shipped = METHODS[kind]
    what, instead = f"the shipped {shipped.label or kind} drafter", f"--draft DIR ({shipped.described})"
    if not directory.is_dir():
        raise BlockspecError(
            f"{what} is missing: expected the directory {directory} inside the "
            f"installed package; reinstall blockspec, or pass {instead}"
        )
    if not directory.joinpath("config.json").is_file():
        raise BlockspecError(
            f"{what} at {directory} is incomplete (no config.json); reinstall blockspec, or pass {instead}"
        )
    path = Path(str(directory))
    if not path.is_dir():  # a package imported from a zip archive
        raise BlockspecError(f"{what} cannot be read from a zipped package: install blockspec "
                             "as ordinary files, or pass --draft DIR")
    return path


def shipped_drafts(target_name: str, *, assets=None) -> dict[str, Path]:
    """Every drafter shipped for a known target, by method ({} for other targets)."""
    return {method: shipped_draft(target_name, method, assets=assets)
            for method in SHIPPED_DRAFTS.get(str(target_name), {})}


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
