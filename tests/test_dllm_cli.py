"""`blockspec dllm generate` and `blockspec dllm bench` on a tiny adapted model."""

from __future__ import annotations

import json

import pytest

from blockspec.cli import main
from helpers import save_tiny_target


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    root = tmp_path_factory.mktemp("dllm")
    target = save_tiny_target(root / "target")
    prompts = root / "train.jsonl"
    rows = [{"question": f"What is {a} plus {a}?", "answer": f"{a} + {a} = {2 * a}\n#### {2 * a}"} for a in range(1, 9)]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
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


def test_bench_resume_keeps_finished_settings_and_runs_the_rest(adapted, tmp_path, capsys, monkeypatch):
    target, model = adapted
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {a} plus 2?", "answer": f"#### {a + 2}"}) + "\n"
                            for a in range(2)))
    out = tmp_path / "bench"
    common = ["dllm", "bench", "--model", str(model), "--dataset", str(data), "--num-prompts", "2",
              "--gen-length", "8", "--ar-target", str(target), "--out", str(out)]
    assert main(common + ["--setting", "llada:steps=8,block=4"]) == 0
    first = json.loads((out / "summary.json").read_text())["results"]

    from blockspec.dllm import bench

    ran = []
    original = bench.run_setting
    monkeypatch.setattr(bench, "run_setting", lambda *a, **k: ran.append(a[4]) or original(*a, **k))
    monkeypatch.setattr(bench, "run_autoregressive", lambda *a, **k: pytest.fail("the AR target ran again"))
    assert main(common + ["--setting", "llada:steps=8,block=4", "llada:steps=4,block=4", "--resume"]) == 0
    assert ran == ["llada:steps=4,block=4"]
    second = json.loads((out / "summary.json").read_text())["results"]
    exact = ("setting", "prompts", "accuracy", "tokens", "forwards")
    assert [{k: r[k] for k in exact} for r in second[:2]] == [{k: r[k] for k in exact} for r in first]
    assert [r["seconds"] for r in second[:2]] == pytest.approx([r["seconds"] for r in first], abs=1e-4)
    assert [r["setting"] for r in second] == ["ar (target)", "llada:steps=8,block=4", "llada:steps=4,block=4"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6

    capsys.readouterr()
    assert main(common[:-4] + ["--gen-length", "4", "--ar-target", str(target), "--out", str(out),
                               "--setting", "llada:steps=4,block=4", "--resume"]) == 2
    assert "other options" in capsys.readouterr().err
