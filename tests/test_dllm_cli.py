"""`blockspec dllm generate` and `blockspec dllm bench` on a tiny adapted model."""

from __future__ import annotations

import json

import pytest

from blockspec.cli import main
from tiny_models import save_tiny_target


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dllm")
    target = save_tiny_target(root / "target")
    prompts = root / "train.jsonl"
    prompts.write_text("".join(json.dumps({"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"}) + "\n"
                               for a in range(1, 9)))
    assert main(["dllm", "train", "--init", str(target), "--data", str(prompts), "--out", str(root / "run"),
                 "--steps", "2", "--batch-size", "2", "--max-length", "256", "--save-every", "0"]) == 0
    return target, root / "run" / "model"


@pytest.mark.parametrize("sampler", ["llada", "dream", "fast-dllm"])
def test_generate_prints_one_json_object(adapted, sampler, capsys):
    capsys.readouterr()
    _, model = adapted
    assert main(["dllm", "generate", "--model", str(model), "--sampler", sampler, "--gen-length", "16",
                 "--block-length", "8", "--steps", "8", "--json", "What is 2 plus 2?"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["steps"] >= 2 and len(result["token_ids"]) == result["tokens"][0] <= 16


def test_generate_streams_text_and_shows_steps(adapted, capsys):
    capsys.readouterr()
    _, model = adapted
    assert main(["dllm", "generate", "--model", str(model), "--gen-length", "8", "--block-length", "4",
                 "--steps", "8", "--show-steps", "--threshold", "0.5", "--count", "threshold", "Hello"]) == 0
    captured = capsys.readouterr()
    assert "░" in captured.err and "[llada]" in captured.err and "forwards" in captured.err


def test_generate_with_an_unusable_setting_is_one_line_of_error(adapted, capsys):
    _, model = adapted
    assert main(["dllm", "generate", "--model", str(model), "--gen-length", "10", "--block-length", "4", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and "multiple of block_length" in err


def test_bench_compares_settings_with_the_ar_target(adapted, tmp_path, capsys):
    target, model = adapted
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus 1?", "answer": f"#### {a + 1}"}) + "\n"
                            for a in range(3)))
    out = tmp_path / "bench"
    assert main(["dllm", "bench", "--model", str(model), "--dataset", str(data), "--num-prompts", "2",
                 "--gen-length", "8", "--setting", "llada:steps=8,block=4", "fast-dllm:threshold=0.9,block=8",
                 "--ar-target", str(target), "--batch-size", "2", "--out", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ar (target)" in table and "llada:steps=8,block=4" in table
    summary = json.loads((out / "summary.json").read_text())
    assert [r["setting"] for r in summary["results"]] == ["ar (target)", "llada:steps=8,block=4",
                                                          "fast-dllm:threshold=0.9,block=8"]
    assert all(r["prompts"] == 2 for r in summary["results"])
    assert (out / "accuracy_vs_speed.png").exists()
