"""The command line, as a user types it."""

import json
import re
import subprocess
import sys

import pytest

from blockspec.cli import main
from helpers import make_causal_lm, make_dflash


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "blockspec.cli", *args], capture_output=True, text=True, timeout=300)


def test_generate_json_with_a_draft(tiny_target_dir, tiny_draft_dir, capsys):
    code = main(["generate", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                 "--max-new-tokens", "20", "--block-size", "4", "--json", "What is 12 times 7?"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"token_ids", "text", "acceptance_lengths", "tau", "tokens_per_s"}
    assert 1 <= len(result["token_ids"]) <= 20
    assert all(1 <= n <= 4 for n in result["acceptance_lengths"])
    assert result["draft_ms_per_step"] > 0 and result["verify_ms_per_step"] > 0 and 0 < result["draft_share"] < 1
    steps = len(result["acceptance_lengths"])
    assert result["draft_seconds"] == pytest.approx(result["draft_ms_per_step"] * steps / 1000)


def test_greedy_output_is_the_same_with_and_without_a_draft(tiny_target_dir, tiny_draft_dir, capsys):
    outputs = []
    for extra in ([], ["--draft", str(tiny_draft_dir)], ["--draft", str(tiny_draft_dir), "--method", "ar"]):
        assert main(["generate", "--target", str(tiny_target_dir), *extra, "--max-new-tokens", "30",
                     "--json", "Write a function"]) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("control,check", [
    (["--json-schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], '
      '"additionalProperties": false, "x-guidance": {"whitespace_flexible": false}}'],
     lambda text: set(json.loads(text)) == {"n"}),
    (["--regex", "[0-9]{3}-[ab]{2}"], lambda text: re.fullmatch("[0-9]{3}-[ab]{2}", text)),
    (["--choice", "yes", "--choice", "no"], lambda text: text in ("yes", "no")),
    (["--repetition-penalty", "1.5", "--presence-penalty", "1", "--logit-bias", "5=-100", "--ban", "the"],
     lambda text: True),
])
def test_output_controls_hold_and_speculation_changes_no_token(tiny_target_dir, tiny_draft_dir, control, check,
                                                               capsys):
    outputs = []
    for extra in (["--method", "ar"], ["--draft", str(tiny_draft_dir)]):
        assert main(["generate", "--target", str(tiny_target_dir), *extra, *control, "--max-new-tokens", "40",
                     "--json", "Answer in the format asked"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0]["token_ids"] == outputs[1]["token_ids"]
    assert check(outputs[0]["text"]), outputs[0]["text"]
    if "--logit-bias" in control:
        assert 5 not in outputs[0]["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--logit-bias", "five=1"], "--logit-bias takes TOKEN=BIAS"),
    (["--logit-bias", "99999=1"], "outside the target's vocabulary"),
    (["--min-p", "2"], "--min-p must lie in [0, 1]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--json-schema", "/nonexistent/schema.json"], "cannot read /nonexistent/schema.json"),
    (["--json-schema", "{not json"], "--json-schema is not valid JSON"),
    (["--regex", "[0-9"], "regex cannot be used"),
    (["--ban", " "], "banned word must not be empty"),
])
def test_bad_output_controls_are_one_clear_line(tiny_target_dir, args, message, capsys):
    assert main(["generate", "--target", str(tiny_target_dir), "--method", "ar", *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and message in err, err


def test_streaming_text_and_stats(tiny_target_dir, tiny_draft_dir, capsys):
    assert main(["generate", "--target", str(tiny_target_dir), "--draft", str(tiny_draft_dir),
                 "--max-new-tokens", "12", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
                 "--seed", "3", "--no-chat-template", "The quick brown"]) == 0
    captured = capsys.readouterr()
    assert "tau" in captured.err and "tokens/s" in captured.err


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "2"], "top_p must be in"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--block-size", "12", "--draft", "DRAFT"], "above the dflash drafter's trained block size 8"),
    (["--draft", "/nonexistent/draft"], "does not exist"),
    (["--method", "dflash"], "--method dflash needs --draft"),
])
def test_bad_input_is_one_clear_line_and_exit_code_2(tiny_target_dir, tiny_draft_dir, args, message, capsys):
    args = [str(tiny_draft_dir) if a == "DRAFT" else a for a in args]
    assert main(["generate", "--target", str(tiny_target_dir), *args, "hello"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and message in err


def test_a_real_process_prints_no_traceback(tiny_target_dir):
    result = run_cli("generate", "--target", str(tiny_target_dir), "--no-chat-template", "   ")
    assert result.returncode == 2
    assert "prompt is empty" in result.stderr and "Traceback" not in result.stderr


def test_the_default_target_drafts_with_the_shipped_drafter():
    from blockspec.cli import build_parser
    from blockspec.cli.generate import drafter_choice
    from blockspec.drafters.registry import shipped_draft

    method, draft, _ = drafter_choice(build_parser().parse_args(["generate", "hello"]))
    assert (method, draft) == ("dflash", str(shipped_draft("smollm2-135m-instruct")))
    assert drafter_choice(build_parser().parse_args(["generate", "--method", "ar", "hello"])) == (None, None, {})


def test_every_method_with_a_shipped_drafter_needs_no_draft_on_the_default_target():
    from blockspec.cli import build_parser
    from blockspec.cli.generate import drafter_choice
    from blockspec.drafters.registry import shipped_drafts

    shipped = shipped_drafts("smollm2-135m-instruct")
    for method, directory in shipped.items():
        chosen = drafter_choice(build_parser().parse_args(["generate", "--method", method, "hello"]))
        assert chosen[:2] == (method, str(directory))
    hybrid = drafter_choice(build_parser().parse_args(["generate", "--method", "dflash+suffix", "hello"]))
    assert hybrid[:2] == ("dflash+suffix", str(shipped["dflash"]))


def test_generate_defaults_to_the_adaptive_width_for_a_dflash_chain():
    from blockspec.decoding.sequence import PREFERRED_TREE_BUDGET, GenerationConfig, preferred_decoding
    from blockspec.drafters.dflash import DFlashDrafter
    from blockspec.drafters.ngram import PromptLookupDrafter

    target = make_causal_lm("llama", vocab_size=320)
    dflash, ngram = DFlashDrafter(make_dflash(target, block_size=8), target), PromptLookupDrafter()
    chosen = preferred_decoding(dflash, GenerationConfig())
    assert (chosen.block_size, chosen.tree_budget) == ("auto", PREFERRED_TREE_BUDGET)
    assert preferred_decoding(ngram, GenerationConfig()) == GenerationConfig()
    assert preferred_decoding(None, GenerationConfig()) == GenerationConfig()
    assert preferred_decoding(dflash, GenerationConfig(block_size=8)) == GenerationConfig(block_size=8)
    assert preferred_decoding(dflash, GenerationConfig(tree_budget=16)) == GenerationConfig(tree_budget=16)


def test_generate_and_serve_default_to_the_library_tree_fan_out():
    from blockspec.cli import build_parser
    from blockspec.cli.generate import generation_config
    from blockspec.cli.serve import decoding_options
    from blockspec.drafters.tree import DEFAULT_TREE_TOP_K

    assert generation_config(build_parser().parse_args(["generate", "hello"])).tree_top_k == DEFAULT_TREE_TOP_K
    assert decoding_options(build_parser().parse_args(["serve"])).tree_top_k == DEFAULT_TREE_TOP_K
    assert generation_config(build_parser().parse_args(["generate", "--tree-top-k", "3", "hi"])).tree_top_k == 3
    assert decoding_options(build_parser().parse_args(["serve", "--tree-top-k", "3"])).tree_top_k == 3


@pytest.mark.parametrize(("command", "blocked", "expected"), [
    (["serve"], "fastapi", "blockspec serve needs fastapi: pip install 'blockspec[serve]'"),
    (["loadtest"], "httpx", "blockspec loadtest needs httpx: pip install 'blockspec[serve]'"),
    (["bench", "--methods", "dflash"], "matplotlib",
     "PNG plots needs matplotlib: pip install 'blockspec[bench]', or pass --no-plots"),
])
def test_a_command_whose_extra_is_not_installed_says_which_to_install(command, blocked, expected):
    hide_and_run = f"import sys; sys.modules[{blocked!r}] = None; from blockspec.cli import main; sys.exit(main())"
    result = subprocess.run([sys.executable, "-c", hide_and_run, *command], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert expected in result.stderr and "Traceback" not in result.stderr
