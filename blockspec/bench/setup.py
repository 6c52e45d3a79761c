"""What a benchmark run decodes: its prompts, and its methods with their drafters loaded once."""

from __future__ import annotations

from pathlib import Path

from blockspec.bench.datasets import load_benchmark_prompts
from blockspec.bench.methods import BASELINES, build_methods, parse_method_name
from blockspec.drafters.registry import (
    AUTOREGRESSIVE,
    CHECKPOINT_METHODS,
    DFLASH_METHODS,
    DRAFT_METHODS,
    DRAFTED_METHODS,
    METHODS,
    build_drafter,
    shipped_drafts,
)
from blockspec.errors import BlockspecError

#: Drafters that draft from the context alone, so a run can always include them.
CONTEXT_DRAFTERS = tuple(name for name in DRAFT_METHODS if name not in DRAFTED_METHODS)


def load_prompts(datasets, data_dir, num_prompts, seed) -> list[dict]:
    """The rows of every data set in ``datasets``; ``data_dir`` None reads the bundled subsets."""
    source = "bundled" if data_dir is None else data_dir
    if source not in ("bundled", "hub") and not Path(source).is_dir():
        raise BlockspecError(f"--data-dir {source} is not a directory (or 'hub')")
    prompts = []
    for name in datasets:
        prompts.extend(load_benchmark_prompts(name, source=source, num_prompts=num_prompts, seed=seed))
    return prompts


def load_methods(target_name: str, methods: str | None = None, drafts: list[str] = (), assistant: str | None = None,
                 *, device: str | None = None, dtype: str | None = None, block_size: int | str | None = None,
                 compile: str = "off", draft_vocab_data: list[str] | None = None,
                 quantize: str | None = None):
    """The target and the methods named, each drafter loaded once.

    ``methods``: comma-separated names (None: the default set); ``drafts``: [METHOD=]DIR values;
    ``assistant``: the small LM of the draft and hf-assisted methods; ``compile``: whether blockspec's
    methods run through the fast path (a DFlash drafter then drafts through its packed LM head);
    ``draft_vocab_data``: the files a dflash/vK method counts its K tokens in; ``quantize``: the target's
    weights ("fp16", "int8", "int4": every method, the HF baselines included, runs the same quantized target).
    """
    from transformers.utils import logging as hf_logging

    from blockspec.decoding.compile_policy import compile_choice
    from blockspec.drafters.draft_lm import load_draft_model
    from blockspec.models.target import load_target

    hf_logging.disable_progress_bar()
    drafts = parse_drafts(drafts, target_name)
    names = parse_methods(methods, drafts, assistant)
    # dflash@4 and dflash@auto share one drafter; dflash/d2 has its own (its own state and calibration).
    specs = {spec.drafter: spec for spec in map(parse_method_name, names)}
    target = load_target(target_name, device=device, dtype=dtype, quantize=quantize)
    compiled, _ = compile_choice(target.model, compile)
    if methods is None and compiled:  # blockspec's methods are compiled: so is HF's strongest baseline
        names.insert(names.index("hf") + 1, "hf-compiled")
    drafters = {}
    for key, spec in specs.items():
        name = spec.base
        if name in DRAFT_METHODS:
            draft = drafts.get(name) or drafts.get(METHODS[name].draft_of) or (assistant if name == "draft" else None)
            if name in CHECKPOINT_METHODS and draft is None:
                raise BlockspecError(f"the {name} method needs --draft {name}=DIR (its checkpoint) for this target")
            options = {} if spec.denoise_steps == 1 else {"denoise_steps": spec.denoise_steps}
            if name in DFLASH_METHODS and compiled:
                options["packed"] = True
            if spec.draft_vocab is not None:
                options["draft_vocabulary"] = _draft_vocabulary(target, spec.draft_vocab, draft_vocab_data)
            drafters[key] = build_drafter(name, target, draft, **options)
    if compiled:  # AR shares the graphs of the first drafter that reads features (see fast_forward)
        from blockspec.decoding.fast import fast_forward

        readers = [d for d in drafters.values() if d.feature_layers]
        if readers:
            fast_forward(target.model, readers[0].feature_layers)
    loaded = None
    if "hf-assisted" in names:  # the draft method's LM when it is the same one, loaded once
        wanted = assistant or drafts["draft"]
        same = "draft" in drafters and (drafts.get("draft") or assistant) == wanted
        loaded = drafters["draft"].model if same else load_draft_model(wanted, target)
    return target, build_methods(names, target, drafters=drafters, assistant=loaded, block_size=block_size)


def _draft_vocabulary(target, size: int, data: list[str] | None):
    from blockspec.training.vocabulary import target_vocabulary

    if not data:
        raise BlockspecError(f"a dflash/v{size} method counts its draft vocabulary in data: add --draft-vocab-data "
                             "FILE (a response cache or prompt files; never the benchmark's own prompts)")
    return target_vocabulary(target, data, size)


def parse_drafts(values: list[str], target: str) -> dict[str, str]:
    """``--draft`` values as {method: directory}; a bare directory is DFlash's."""
    drafts = {}
    for value in values:
        method, _, directory = value.rpartition("=") if "=" in value else ("dflash", "", value)
        if not directory:
            raise BlockspecError(f"--draft {value!r}: give DIR or METHOD=DIR")
        if method not in DRAFTED_METHODS:
            raise BlockspecError(f"--draft {value!r}: METHOD must be one of {', '.join(DRAFTED_METHODS)}")
        drafts[method] = directory
    for method, shipped in shipped_drafts(target).items():
        drafts.setdefault(method, str(shipped))
    return drafts


def parse_methods(value: str | None, drafts: dict[str, str], assistant: str | None) -> list[str]:
    """The method names of a run: ``value`` (comma-separated) or the default set, always with ar."""
    if value is None:
        names = [*(name for name in BASELINES if name != "hf-compiled"), *CONTEXT_DRAFTERS]
        names += [m for m in drafts if m not in names]
        if assistant or "draft" in drafts:
            names += [m for m in ("draft", "hf-assisted") if m not in names]
    else:
        names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise BlockspecError("--methods is empty: name at least one method, e.g. ar,dflash")
    if AUTOREGRESSIVE not in names:
        names.insert(0, AUTOREGRESSIVE)  # the reference every speedup and token check is measured against
    if ("draft" in names or "hf-assisted" in names) and not assistant and "draft" not in drafts:
        raise BlockspecError("the draft and hf-assisted methods need --assistant MODEL or --draft draft=DIR "
                             "(a smaller LM with the target's tokenizer)")
    return names
