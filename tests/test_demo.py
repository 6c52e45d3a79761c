"""`blockspec demo` on the tiny target and drafter."""

import argparse
import io

import pytest
from rich.console import Console

from blockspec import demo
from blockspec.bench.datasets import load_bundled
from blockspec.cli.demo import add_demo_command, run_demo_command
from blockspec.drafters.registry import SHIPPED_DRAFTS, detect_method, load_drafter, shipped_draft, shipped_drafts
from blockspec.errors import BlockspecError
from blockspec.hub import DEFAULT_TARGET
from blockspec.models.target import load_target


@pytest.fixture(scope="module")
def tiny_pair(tiny_target_dir, tiny_draft_dir):
    target = load_target(str(tiny_target_dir), device="cpu")
    return target, load_drafter(tiny_draft_dir, target)


def quiet_console():
    return Console(file=io.StringIO(), width=120)


def test_run_demo_gives_figures_per_prompt_with_lossless_tokens(tiny_pair):
    target, drafter = tiny_pair
    prompts = load_bundled("gsm8k", limit=1) + load_bundled("humaneval", limit=1) + load_bundled("mt_bench", limit=1)
    console = quiet_console()
    figures = demo.run_demo(target, drafter, prompts, max_new_tokens=24, block_size=4, console=console)
    assert [f["id"] for f in figures] == [p["id"] for p in prompts]
    for figure in figures:
        assert figure["match"] and figure["first_mismatch"] is None
        assert figure["dflash_token_ids"] == figure["ar_token_ids"] and figure["new_tokens"] >= 1
        assert figure["tau"] >= 1
        assert figure["speedup"] > 0 and figure["ar_tokens_per_s"] > 0 and figure["dflash_tokens_per_s"] > 0
        assert figure["dflash_ttft"] > 0 and figure["block_size"] == 4
    out = console.file.getvalue()
    assert "gsm8k" in out and "mt_bench" in out and "speedup" in out and "median" in out
    assert "WARNING" not in out


def test_run_demo_with_auto_width_reports_the_chosen_widths(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))  # the cost calibration is cached there
    target, drafter = tiny_pair
    console = quiet_console()
    figures = demo.run_demo(target, drafter, load_bundled("gsm8k", limit=2), max_new_tokens=16, block_size="auto",
                            console=console)
    widest = drafter.max_draft_tokens + 1
    for figure in figures:
        assert figure["match"] and figure["block_size"] == "auto"
        assert figure["verify_widths"] and all(1 <= w <= widest for w in figure["verify_widths"])
        assert 1 <= figure["mean_verify_width"] <= widest
    assert f"verify width auto (1..{widest})" in console.file.getvalue()
    assert list(tmp_path.joinpath("costs").glob("*.json"))


def test_run_demo_reports_a_mismatch(tiny_pair, monkeypatch, tmp_path):
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))
    target, drafter = tiny_pair
    real_decode = demo._decode

    def corrupted(target, prompt, drafter, config, console=None, **options):
        result = real_decode(target, prompt, drafter, config, console, **options)
        if drafter is not None:
            result["token_ids"] = result["token_ids"][:-1] + [result["token_ids"][-1] + 1]
        return result

    monkeypatch.setattr(demo, "_decode", corrupted)
    console = quiet_console()
    figures = demo.run_demo(target, drafter, ["Hello"], max_new_tokens=6, console=console)
    assert not figures[0]["match"] and figures[0]["first_mismatch"] == figures[0]["new_tokens"] - 1
    assert "WARNING" in console.file.getvalue()


def demo_parser():
    parser = argparse.ArgumentParser(prog="blockspec")
    add_demo_command(parser.add_subparsers())
    return parser


def test_demo_command_returns_0_on_the_tiny_pair(tiny_target_dir, tiny_draft_dir, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKSPEC_HOME", str(tmp_path))
    args = demo_parser().parse_args(["demo", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                                     "--max-new-tokens", "8", "--num-prompts", "2",
                                     "--dataset", "gsm8k", "--dataset", "mbpp"])
    assert args.run is run_demo_command
    assert args.run(args) == 0
    out = capsys.readouterr().out
    assert "gsm8k" in out and "mbpp" in out and "speedup" in out


def test_demo_command_defaults():
    args = demo_parser().parse_args(["demo"])
    assert args.target == DEFAULT_TARGET and args.draft is None
    assert args.block_size == "auto"
    assert demo_parser().parse_args(["demo", "--block-size", "8"]).block_size == 8
    assert [row["dataset"] for row in demo.demo_prompts(args.dataset, args.num_prompts)] == [
        "gsm8k", "gsm8k", "humaneval", "mt_bench"]


def test_demo_prompts_deal_round_robin():
    rows = demo.demo_prompts(["mbpp", "math500"], 3)
    assert [row["id"] for row in rows] == ["mbpp/11", "mbpp/12", "math500/0"]
    with pytest.raises(BlockspecError, match="unknown bundled prompt set"):
        demo.demo_prompts(["nope"], 2)
    with pytest.raises(BlockspecError, match="--num-prompts must be >= 1"):
        demo.demo_prompts(None, 0)


def test_a_missing_shipped_drafter_is_a_clear_error(tmp_path, tiny_target_dir):
    with pytest.raises(BlockspecError, match="shipped DFlash drafter is missing.*--draft DIR"):
        shipped_draft(DEFAULT_TARGET, assets=tmp_path)
    args = demo_parser().parse_args(["demo", "--target", str(tiny_target_dir)])
    with pytest.raises(BlockspecError, match="no drafter is shipped for .*: pass --draft DIR"):
        args.run(args)


def test_the_shipped_drafter_is_found_inside_the_package(tmp_path):
    assert shipped_draft(DEFAULT_TARGET).joinpath("config.json").is_file()
    assert shipped_draft("some/other-model") is None
    asset = SHIPPED_DRAFTS[DEFAULT_TARGET]["dflash"]
    (tmp_path / asset).mkdir()
    with pytest.raises(BlockspecError, match="incomplete"):
        shipped_draft(DEFAULT_TARGET, assets=tmp_path)
    (tmp_path / asset / "config.json").write_text("{}")
    assert shipped_draft(DEFAULT_TARGET, assets=tmp_path) == tmp_path / asset


def test_every_shipped_drafter_is_found_by_its_method(tmp_path):
    shipped = shipped_drafts(DEFAULT_TARGET)
    assert set(shipped) == set(SHIPPED_DRAFTS[DEFAULT_TARGET]) and "dflash" in shipped
    for method, directory in shipped.items():
        assert directory == shipped_draft(DEFAULT_TARGET, method)
        assert detect_method(directory) == method
    # a hybrid reads DFlash's drafter; a method nothing is shipped for gets none
    assert shipped_draft(DEFAULT_TARGET, "dflash+suffix") == shipped["dflash"]
    assert shipped_draft(DEFAULT_TARGET, "ngram") is None
    assert shipped_drafts("some/other-model") == {}
    for method in shipped:
        label = {"dflash": "DFlash", "eagle3": "EAGLE-3", "mtp": "MTP", "draft": "draft-model"}[method]
        with pytest.raises(BlockspecError, match=f"the shipped {label} drafter is missing"):
            shipped_draft(DEFAULT_TARGET, method, assets=tmp_path / "empty")

@pytest.mark.real_model
@pytest.mark.parametrize("method", sorted(SHIPPED_DRAFTS[DEFAULT_TARGET]))
def test_every_shipped_drafter_is_lossless_and_useful_on_the_default_target(method):
    from blockspec.decoding.generate import GenerationConfig, speculative_generate

    target = load_target(DEFAULT_TARGET, device="cpu")
    drafter = load_drafter(shipped_draft(DEFAULT_TARGET, method), target)
    config = GenerationConfig(max_new_tokens=32)
    accepted = steps = 0
    for row in load_bundled("gsm8k", limit=2):
        ids = target.encode_prompt(row["turns"][0])
        plain = speculative_generate(target.model, ids, None, config)
        drafted = speculative_generate(target.model, ids, drafter, config)
        list(plain), list(drafted)
        assert drafted.token_ids == plain.token_ids
        accepted, steps = accepted + sum(drafted.stats.accepted), steps + len(drafted.stats.accepted)
    assert 1 + accepted / steps > 1.3  # a trained drafter, not noise: its drafts pay
