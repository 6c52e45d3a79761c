"""The diffusion benchmark's settings grammar, answer scoring and report."""

from __future__ import annotations

import json

import pytest

from blockspec.dllm.bench import (
    default_settings,
    final_number,
    format_table,
    is_correct,
    parse_setting,
    run_setting,
    write_report,
)
from blockspec.errors import BlockspecError
from helpers import make_tokenizer, tiny_dllm


def test_settings_start_from_the_sampler_preset_and_take_overrides():
    config = parse_setting("fast-dllm:threshold=0.8,cache=prefix,block=16", gen_length=64)
    assert config.scheduler.count == "threshold" and config.scheduler.threshold == 0.8
    assert config.cache == "prefix" and config.block_length == 16 and config.gen_length == 64
    llada = parse_setting("llada:steps=32,score=random", gen_length=64)
    assert llada.steps == 32 and llada.scheduler.score == "random" and llada.cache == "none"


def test_default_settings_are_the_figure_of_the_issue():
    names = default_settings(256)
    assert names[:3] == ["llada:steps=256", "llada:steps=128", "llada:steps=64"]
    assert all("threshold=0.9" in name for name in names[3:])


@pytest.mark.parametrize("spec, message", [
    ("mdlm", "unknown sampler"),
    ("llada:steps", "key=value"),
    ("llada:speed=3", "key=value"),
    ("llada:steps=many", "needs a int"),
])
def test_bad_settings_say_what_is_wrong(spec, message):
    with pytest.raises(BlockspecError, match=message):
        parse_setting(spec, gen_length=64)


@pytest.mark.parametrize("text, number", [
    ("so the total is \\boxed{72}.", "72"),
    ("48 + 24 = 72\n#### 72", "72"),
    ("She earns $1,250.00 in all, not 3", "3"),
    ("The answer is 1,250.", "1250"),
    ("no digits here", None),
])
def test_the_final_number_of_a_response(text, number):
    assert final_number(text) == number


def test_correctness_compares_numbers_not_strings():
    assert is_correct("\\boxed{18.0}", "18") and not is_correct("\\boxed{17}", "18")


def test_a_run_scores_rows_and_writes_its_report(tmp_path):
    tokenizer = make_tokenizer()
    model = tiny_dllm()
    rows = [{"id": "a", "answer": "4"}, {"id": "b", "answer": "5"}]
    prompts = [[5, 6, 7], [8, 9]]
    result = run_setting(model, tokenizer, rows, prompts, "llada:steps=8", parse_setting("llada:steps=8", 8),
                         batch_size=2, progress=False)
    assert result.prompts == 2 and result.tokens == 16 and result.forwards == 16
    assert result.forwards_per_token == pytest.approx(1.0)
    write_report([result], tmp_path, {"model": "tiny"})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["results"][0]["prompts"] == 2
    assert (tmp_path / "accuracy_vs_speed.png").stat().st_size > 0
    assert "llada:steps=8" in format_table([result])
