"""The benchmark harness on a tiny target: every method, every output, the token check."""

import json
from dataclasses import replace

import pytest
import torch

from blockspec.bench import report
from blockspec.bench.datasets import BUNDLED, load_bundled, load_from_directory, select_rows
from blockspec.bench.methods import LoopMethod, build_methods
from blockspec.bench.runner import BenchConfig, first_mismatch, run_benchmark
from blockspec.bench.setup import parse_drafts, parse_methods
from blockspec.cli import main
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.registry import build_drafter
from blockspec.errors import BlockspecError
from blockspec.models.target import load_target
from helpers import make_causal_lm

PROMPTS = [
    {"id": "a/0", "dataset": "a", "turns": ["the cat sat on the mat and the cat sat"]},
    {"id": "a/1", "dataset": "a", "turns": ["one two three one two three one two"]},
    {"id": "b/0", "dataset": "b", "turns": ["hello there", "and again, hello there"]},
]
CONFIG = BenchConfig(GenerationConfig(max_new_tokens=12, seed=0), warmup_tokens=2, use_chat_template=False)


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(str(tiny_target_dir), device="cpu")


@pytest.fixture(scope="module")
def methods(target, tiny_draft_dir):
    drafters = {"dflash": build_drafter("dflash", target, str(tiny_draft_dir)), "ngram": build_drafter("ngram", target)}
    assistant = make_causal_lm("llama", vocab_size=target.model.config.vocab_size, seed=9)
    names = ["ar", "hf", "hf-prompt-lookup", "hf-assisted", "ngram", "dflash"]
    return build_methods(names, target, drafters=drafters, assistant=assistant)


@pytest.fixture(scope="module")
def greedy_run(target, methods):
    return run_benchmark(target, methods, PROMPTS, CONFIG, progress=False)


def test_every_method_decodes_every_prompt_identically(greedy_run):
    run = greedy_run
    assert not run.interrupted
    assert len(run.records) == len(PROMPTS) * len(run.methods)
    assert run.mismatches == []
    for record in run.records:
        assert record["matches_reference"] is True
        assert record["new_tokens"] == sum(len(t) for t in record["token_ids"]) > 0
        assert record["seconds"] > 0 and record["tokens_per_s"] > 0
        assert record["tau"] >= 1.0 and record["peak_memory_mib"] > 0
        assert record["turns"] == (2 if record["dataset"] == "b" else 1)
    plain = [r for r in run.records if r["method"] in ("ar", "hf")]
    assert all(r["tau"] == 1.0 for r in plain)


def test_summary_figures(greedy_run):
    summary = report.summarize(greedy_run.records, greedy_run.methods)
    assert list(summary) == ["a", "b", "all"]
    assert summary["all"]["ar"]["prompts"] == 3
    ar = summary["a"]["ar"]
    assert ar["speedup_vs_ar_median"] == pytest.approx(1.0)
    assert summary["a"]["hf"]["speedup_vs_hf_mean"] == pytest.approx(1.0)
    dflash = summary["all"]["dflash"]
    steps = sum(dflash["tau_histogram"].values())
    assert steps == sum(len(r["acceptance_lengths"]) for r in greedy_run.records if r["method"] == "dflash")
    assert 0 < len(dflash["acceptance_by_position"]) <= 15
    assert all(0.0 <= rate <= 1.0 for rate in dflash["acceptance_by_position"])
    assert dflash["checked"] == 3 and dflash["mismatches"] == 0
    # where a step's time goes: drafting and verifying, measured apart (HF's loop does not say)
    assert dflash["draft_ms_per_step"] > 0 and dflash["verify_ms_per_step"] > 0
    assert 0 < dflash["draft_share"] < 1
    assert dflash["draft_seconds"] + dflash["verify_seconds"] <= sum(
        r["seconds"] for r in greedy_run.records if r["method"] == "dflash")
    assert summary["all"]["hf"]["draft_share"] == 0 and summary["all"]["ar"]["draft_ms_per_step"] == 0  # no drafter
    assert summary["all"]["ar"]["verify_ms_per_step"] > 0


def test_outputs_are_written(greedy_run, tmp_path):
    paths = report.write_outputs(greedy_run, tmp_path)
    assert set(paths) - {"verify_widths"} == {"json", "markdown", "tau_histogram", "acceptance_by_position", "speedup"}
    data = json.loads(paths["json"].read_text())
    assert data["environment"]["torch"] == torch.__version__
    assert {"device", "dtype", "torch_threads", "transformers", "python"} <= set(data["environment"])
    assert len(data["records"]) == 18 and "summary" in data
    table = paths["markdown"].read_text()
    assert "| a | dflash |" in table and "| all | hf-assisted |" in table
    for kind in ("tau_histogram", "acceptance_by_position", "speedup"):
        assert paths[kind].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class BrokenMethod(LoopMethod):
    """Greedy AR, except that it changes one token: what a lossy drafter would do."""

    def decode(self, prompt_ids, config):
        decode = super().decode(prompt_ids, config)
        if len(decode.token_ids) > 3:
            decode.token_ids[3] = (decode.token_ids[3] + 1) % self.model.config.vocab_size
        return decode


def test_the_token_check_catches_a_broken_method(target, tmp_path):
    methods = [LoopMethod("ar", target.model), BrokenMethod("broken", target.model)]
    run = run_benchmark(target, methods, PROMPTS[:2], CONFIG, progress=False)
    assert [r["id"] for r in run.mismatches] == ["a/0", "a/1"]
    assert run.mismatches[0]["first_mismatch"] == {"turn": 0, "position": 3}
    summary = report.summarize(run.records, run.methods)
    assert summary["a"]["broken"]["mismatches"] == 2
    paths = report.write_outputs(run, tmp_path, plots=False)
    assert "differ from ar's tokens" in paths["markdown"].read_text()


def test_sampled_runs_skip_the_token_check(target, methods):
    config = replace(CONFIG, generation=replace(CONFIG.generation, temperature=1.0, seed=3))
    run = run_benchmark(target, methods[:2] + methods[4:5], PROMPTS[:1], config, progress=False)
    assert all(r["matches_reference"] is None for r in run.records)


class InterruptingMethod(LoopMethod):
    def __init__(self, *args, after: int):
        super().__init__(*args)
        self.calls, self.after = 0, after

    def decode(self, prompt_ids, config):
        self.calls += 1
        if self.calls > self.after:
            raise KeyboardInterrupt
        return super().decode(prompt_ids, config)


def test_ctrl_c_keeps_the_prompts_already_done(target, tmp_path):
    # warm-up + 2 prompts, then Ctrl-C during the third
    methods = [LoopMethod("ar", target.model), InterruptingMethod("late", target.model, after=3)]
    run = run_benchmark(target, methods, PROMPTS[:3], replace(CONFIG, max_turns=1), progress=False)
    assert run.interrupted
    assert [r["id"] for r in run.records] == ["a/0", "a/0", "a/1", "a/1"]
    paths = report.write_outputs(run, tmp_path)
    assert json.loads(paths["json"].read_text())["interrupted"] is True
    assert "Interrupted" in paths["markdown"].read_text()


def test_compare_puts_two_runs_side_by_side(greedy_run, tmp_path, capsys):
    first = report.write_outputs(greedy_run, tmp_path / "one", plots=False)["json"]
    data = json.loads(first.read_text())
    data["records"] = [r for r in data["records"] if r["method"] != "ngram"]
    data["methods"] = [m for m in data["methods"] if m != "ngram"]
    second = tmp_path / "two.json"
    second.write_text(json.dumps(data))
    assert main(["bench", "--compare", str(first), str(second)]) == 0
    table = capsys.readouterr().out
    assert "| a | dflash |" in table
    assert "| a | ngram |" in table and "| 1.00x |" in table
    ngram_row = next(line for line in table.splitlines() if line.startswith("| a | ngram |"))
    assert ngram_row.count("| - ") >= 3  # missing from B


def test_compare_rejects_what_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["bench", "--compare", str(bad), str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_bench_command_end_to_end(tiny_target_dir, tiny_draft_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "out"
    code = main(["bench", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                 "--datasets", str(prompts), "--max-new-tokens", "8", "--warmup-tokens", "0",
                 "--no-chat-template", "--no-progress", "--out", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    for method in ("ar", "hf", "hf-prompt-lookup", "ngram", "dflash"):
        assert f"| all | {method} |" in table
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "speedup.png"}


def test_method_and_draft_options():
    assert parse_methods("dflash,hf", {}, None) == ["ar", "dflash", "hf"]
    assert parse_drafts(["eagle3=/x", "/y"], "some/target") == {"eagle3": "/x", "dflash": "/y"}
    with pytest.raises(BlockspecError, match="--assistant"):
        parse_methods("ar,hf-assisted", {}, None)
    with pytest.raises(BlockspecError, match="empty"):
        parse_methods(" , ", {}, None)
    drafts = parse_drafts(["eagle3=/e", "mtp=/m", "draft=/d"], "some/target")
    assert parse_methods(None, drafts, None) == ["ar", "hf", "hf-prompt-lookup", "ngram", "suffix", "eagle3", "mtp",
                                                 "draft", "hf-assisted"]
    with pytest.raises(BlockspecError,
                       match="METHOD must be one of dflash, dflash2, dspark, domino, eagle3, mtp, draft"):
        parse_drafts(["eagle=/e"], "some/target")


def test_the_default_target_benchmarks_every_shipped_drafter():
    from blockspec.drafters.registry import shipped_drafts

    shipped = {method: str(directory) for method, directory in shipped_drafts("smollm2-135m-instruct").items()}
    assert parse_drafts([], "smollm2-135m-instruct") == shipped
    assert parse_drafts(["dflash=/mine"], "smollm2-135m-instruct") == {**shipped, "dflash": "/mine"}
    names = parse_methods(None, shipped, None)
    assert set(shipped) <= set(names)
    assert ("hf-assisted" in names) == ("draft" in shipped)


def test_unknown_method_is_refused(target):
    with pytest.raises(BlockspecError, match="unknown benchmark method 'nope'"):
        build_methods(["ar", "nope"], target)


def test_first_mismatch():
    assert first_mismatch([[1, 2, 3]], [[1, 2, 3]]) is None
    assert first_mismatch([[1, 2, 3]], [[1, 2]]) == {"turn": 0, "position": 2}
    assert first_mismatch([[1], [4, 5]], [[1], [4, 6]]) == {"turn": 1, "position": 1}


# ---- the evaluation sets from a data directory -------------------------------------------

SHARED = __import__("pathlib").Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.mark.skipif(not SHARED.is_dir(), reason="the offline copies of the evaluation sets are not beside the repo")
@pytest.mark.parametrize("name", BUNDLED)
def test_data_directory_rows_match_the_bundled_subsets(name):
    full = load_from_directory(name, SHARED)
    bundled = load_bundled(name)
    assert full[: len(bundled)] == bundled
    if name == "mbpp":
        assert len(full) == 500  # the test split only


def test_data_directory_errors(tmp_path):
    with pytest.raises(BlockspecError, match="gsm8k_test.jsonl"):
        load_from_directory("gsm8k", tmp_path)
    (tmp_path / "gsm8k_test.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(BlockspecError, match="line 1 is not a gsm8k row"):
        load_from_directory("gsm8k", tmp_path)


def test_seeded_selection_is_reproducible_and_ordered():
    rows = [{"id": i} for i in range(50)]
    chosen = select_rows(rows, 5, seed=1)
    assert chosen == select_rows(rows, 5, seed=1) and chosen != rows[:5]
    assert [r["id"] for r in chosen] == sorted(r["id"] for r in chosen)
    assert select_rows(rows, 5, None) == rows[:5]


def test_hub_sets_go_through_the_same_formatting(monkeypatch):
    import sys
    import types

    from blockspec.bench.datasets import load_from_hub

    calls = []

    def load_dataset(repo, subset, split):
        calls.append((repo, subset, split))
        return [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    rows = load_from_hub("gsm8k")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert rows[0]["answer"] == "4" and rows[0]["turns"][0].startswith("What is 2+2?\nPlease reason step by step")


def test_hub_without_the_datasets_package_says_what_to_install(monkeypatch):
    import sys

    from blockspec.bench.datasets import load_from_hub

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(BlockspecError, match="pip install datasets"):
        load_from_hub("humaneval")
