"""File writes that never leave half a file or half a checkpoint behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from blockspec.errors import BlockspecError


def _process_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _give_default_mode(path: str | Path, base: int) -> None:
    """tempfile makes owner-only staging files and directories; what lands gets the mode any
    ordinary file or directory of this process would get, so others can still read checkpoints."""
    os.chmod(path, base & ~_process_umask())


def write_file_atomically(path: str | Path, write_fn) -> Path:
    """Run ``write_fn(tmp_path)`` then move the file into place: readers see the old file or the new one."""
    path = Path(path)
    handle, staging = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(handle)
    try:
        write_fn(staging)
        _give_default_mode(staging, 0o666)
        os.replace(staging, path)
    except BaseException:
        Path(staging).unlink(missing_ok=True)
        raise
    return path


def write_text_atomically(path: str | Path, text: str) -> Path:
    return write_file_atomically(path, lambda staging: Path(staging).write_text(text, encoding="utf-8"))


def save_atomically(save_fn, directory: str | Path) -> Path:
    """Run ``save_fn(tmp_dir)`` then move tmp_dir into place, so a crash never leaves half a checkpoint."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        save_fn(staging)
        _give_default_mode(staging, 0o777)
        if directory.exists():
            retired = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(directory, retired)
            os.replace(staging, directory)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def make_output_dir(path: str | Path, option: str = "--out") -> Path:
    """Create an output directory (and its parents), or say in one line why nothing can be written there."""
    if not str(path).strip():
        raise BlockspecError(f"{option} is empty: name the directory to write to")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise BlockspecError(f"{option} {path} is a file, not a directory: choose another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        raise BlockspecError(f"{option} {path}: cannot write there ({error.strerror or error}): "
                             "choose a writable directory") from None
    return path


def incomplete_safetensors(directory: str | Path) -> list[Path]:
    """The .safetensors files of ``directory`` whose size is not what their header says (cut short)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return [path for path in sorted(directory.glob("*.safetensors")) if not _safetensors_complete(path)]


def _safetensors_complete(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            header_size = int.from_bytes(file.read(8), "little")
            header = json.loads(file.read(header_size))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        return path.stat().st_size == 8 + header_size + max(ends, default=0)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return False
