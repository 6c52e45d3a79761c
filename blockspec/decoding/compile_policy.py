"""When the target is compiled: which targets the fast path runs, when compiling pays, inductor's settings."""

from __future__ import annotations

import os
import shutil

from blockspec.decoding.sequence import COMPILE_CHOICES
from blockspec.errors import BlockspecError
from blockspec.models.quantized import parameter_count

#: Model families whose decoder layers run in the fast path's loop (full attention, plain embeddings).
FAST_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")


def unsupported_reason(model) -> str | None:
    """Why the fast path cannot run ``model`` (None: it can)."""
    config = model.config
    if config.model_type not in FAST_FAMILIES:
        return f"the fast path runs {', '.join(FAST_FAMILIES)} targets, not {config.model_type}"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types) or getattr(config, "use_sliding_window", False):
        return "the fast path needs full attention in every layer; this target has sliding-window layers"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the decoder layout the fast path runs"
    return None


#: Graphs one compiled function may hold: a width bucket per batch size and cache capacity.
GRAPH_LIMIT = 64


def allow_a_graph_per_shape() -> None:
    """Raise dynamo's recompile limit (8) in the calling thread: its config is per thread, and a graph past the
    limit silently runs eagerly (a server decodes in a thread of its own)."""
    import torch._dynamo

    if torch._dynamo.config.recompile_limit < GRAPH_LIMIT:
        torch._dynamo.config.recompile_limit = GRAPH_LIMIT


def configure_inductor(cache_dir: str | None = None) -> None:
    """Keep inductor's compiled artefacts under BLOCKSPEC_HOME, and allow a graph per width bucket and capacity."""
    if cache_dir is None:
        from blockspec import hub

        cache_dir = str(hub.home_dir() / "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)  # before inductor reads it
    import torch._inductor.config as inductor

    inductor.fx_graph_cache = True
    allow_a_graph_per_shape()
    if shutil.which(os.environ.get("CXX", "g++")) is None and shutil.which("c++") is None:
        raise BlockspecError("compiling the target needs a C++ compiler (g++): install one, or use --compile off")


#: On a CPU, compiling costs about a minute per width bucket once; below this size the eager forward's
#: overheads are not worth removing.
MIN_COMPILED_PARAMETERS = 50_000_000


def compile_choice(model, mode: str) -> tuple[bool, str]:
    """Whether to run the target through the compiled fast path under ``--compile mode``, and why.

    "on" insists (an unsupported target is an error); "auto" compiles a supported target on a GPU, or
    on a CPU when it is large enough for the saved time to pay for compiling; "off" never does.
    """
    if mode not in COMPILE_CHOICES:
        raise BlockspecError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {mode!r}")
    if mode == "off":
        return False, "compile off: the eager forward"
    reason = unsupported_reason(model)
    if reason is not None:
        if mode == "on":
            raise BlockspecError(f"{reason}: use --compile off")
        return False, f"{reason}; running eagerly"
    parameters = parameter_count(model)
    if mode == "auto" and model.device.type == "cpu" and parameters < MIN_COMPILED_PARAMETERS:
        return False, (f"a target of {parameters / 1e6:.1f}M parameters runs eagerly (compiling pays from "
                       f"{MIN_COMPILED_PARAMETERS / 1e6:.0f}M on a CPU)")
    return True, "compiled fast path: a static KV cache, one graph per verify width bucket"
