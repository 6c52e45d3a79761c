"""Hostile and careless input, case by case: each gets a one-line error (OpenAI-style JSON from the
server) or the right behaviour, never a traceback, a 5xx or someone else's failure."""

import json
import re
import shutil

import httpx
import pytest

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.grammar import Grammar
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.registry import build_drafter
from blockspec.serve.app import create_app
from helpers import load_served_target, running_server

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served(tiny_target_dir, tiny_draft_dir):
    """The tiny target with its DFlash drafter (block size 8)."""
    target = load_served_target(tiny_target_dir)
    app = create_app(target, build_drafter("dflash", target, str(tiny_draft_dir)), max_batch_size=4)
    with running_server(app) as url:
        yield url, target


def post(url: str, endpoint: str, body, headers=None) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(f"{url}/v1/{endpoint}", content=body, timeout=60,
                          headers={"content-type": "application/json", **(headers or {})})
    return httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60, headers=headers)


def openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def greedy_tokens(target, prompt_ids, max_new_tokens, stop=True) -> list[int]:
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=target.stop_token_ids() if stop else ())
    stream = speculative_generate(target.model, prompt_ids, None, config)
    list(stream)
    return stream.token_ids


def streamed_text(response: httpx.Response) -> tuple[str, str]:
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    return "".join(choice["text"] for choice in choices), choices[-1]["finish_reason"]


# -- 1. a seed out of range is refused before it joins the batch ---------------------------------------------

@pytest.mark.parametrize("seed", [2**70, 2**64, -(2**63) - 1])
def test_a_seed_a_generator_cannot_take_is_a_400(served, seed):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "seed": seed}
    assert openai_error(post(url, "chat/completions", body), 400)["param"] == "seed"


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63)])
def test_the_extreme_seeds_a_generator_takes_work(served, seed):
    url, target = served
    body = {"model": target.name, "prompt": "hi", "temperature": 0.7, "seed": seed, "max_tokens": 3}
    assert post(url, "completions", body).status_code == 200


@pytest.mark.parametrize("values", [{"temperature": 1e-300}, {"temperature": 1e-40, "top_p": 0.5},
                                    {"temperature": 1.0, "top_p": 1e-300}])
def test_sampling_values_at_the_float32_edge_decode(served, values):
    url, target = served
    body = {"model": target.name, "prompt": "The quick brown", "max_tokens": 4, "seed": 1, **values}
    assert post(url, "completions", body).status_code == 200


# -- 2. a row prefilled and finished within one engine step keeps its tokens ----------------------------------

@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_tokens", [2, 4, 7])
def test_a_short_answer_within_one_step_keeps_every_token(served, max_tokens, stream):
    url, target = served
    prompt = "Natalia sold clips to her friends"
    expected = greedy_tokens(target, target.encode_prompt(prompt, use_chat_template=False), max_tokens)
    body = {"model": target.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}
    response = post(url, "completions", body)
    assert response.status_code == 200
    if stream:
        text, finish = streamed_text(response)
    else:
        choice = response.json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
        assert response.json()["usage"]["completion_tokens"] == len(expected)
    assert text == target.tokenizer.decode(expected, skip_special_tokens=True)
    assert finish == ("length" if len(expected) == max_tokens else "stop")


# -- 4. text that is not valid Unicode; every error JSON and counted -------------------------------------------

def test_a_lone_surrogate_is_a_400_and_counted(served):
    url, target = served
    raw = '{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}' % target.name
    error = openai_error(post(url, "chat/completions", raw), 400)
    assert error["param"] == "messages[0].content" and "surrogate" in error["message"]
    raw = '{"model": "%s", "prompt": "a", "stop": ["\\udfff"]}' % target.name
    assert openai_error(post(url, "completions", raw), 400)["param"].startswith("stop")
    metrics = httpx.get(f"{url}/metrics").text
    assert 'blockspec_requests_total{endpoint="/v1/chat/completions",status="400"}' in metrics


def test_an_unexpected_error_is_an_openai_500_and_counted(tiny_target_dir, monkeypatch):
    from blockspec.serve import app as serve_app

    target = load_served_target(tiny_target_dir)
    monkeypatch.setattr(serve_app, "_chat_prompt_ids", lambda target, body: 1 / 0)
    app = create_app(target, None)
    with running_server(app) as url:
        body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}]}
        error = openai_error(post(url, "chat/completions", body), 500)
        assert error["type"] == "server_error" and "Traceback" not in error["message"]
        metrics = httpx.get(f"{url}/metrics").text
    assert 'blockspec_requests_total{endpoint="/v1/chat/completions",status="500"} 1.0' in metrics


def test_other_http_errors_are_openai_json(served):
    url, _ = served
    assert openai_error(httpx.get(f"{url}/v1/chat/completions"), 405)
    assert openai_error(httpx.get(f"{url}/v1/nothing-here"), 404)


# -- 7. values read as something else are refused ----------------------------------------------------------

@pytest.mark.parametrize("endpoint,change,param", [
    ("chat/completions", {"stream": "yes"}, "stream"),
    ("completions", {"prompt": [True, False]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"max_tokens": "5"}, "max_tokens"),
    ("chat/completions", {"temperature": "0.5"}, "temperature"),
    ("chat/completions", {"seed": 1.5}, "seed"),
    ("chat/completions", {"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ("chat/completions", {"min_tokens": -1}, "min_tokens"),
    ("chat/completions", {"ignore_eos": "true"}, "ignore_eos"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
])
def test_values_of_the_wrong_type_are_a_400(served, endpoint, change, param):
    url, target = served
    body = {"model": target.name, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], **change}
    assert openai_error(post(url, endpoint, body), 400)["param"] == param


# -- 9. messages that name what is wrong -------------------------------------------------------------------

@pytest.mark.parametrize("body,message,param", [
    (b"", "the request body is empty", None),
    (b"[1, 2]", "must be a JSON object", None),
    ({"model": "M", "messages": [{"content": "hi"}]}, "'messages[0].role' is a required field", "messages[0].role"),
    ({"model": "M", "messages": [{"role": "user", "content": 5}]}, "expected a string or a list of text parts",
     "messages[0].content"),
])
def test_validation_errors_name_the_field_by_its_path(served, body, message, param):
    url, target = served
    if isinstance(body, dict):
        body = {**body, "model": target.name}
    error = openai_error(post(url, "chat/completions", body), 400)
    assert message in error["message"] and error["param"] == param


def test_a_chat_template_refusing_the_roles_is_a_400(served):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}] * 2, "max_tokens": 2}
    assert post(url, "chat/completions", body).status_code == 200  # this template takes any order
    body["messages"] = [{"role": "x" * 10_000, "content": ""}]
    assert post(url, "chat/completions", body).status_code in (200, 400)


def test_the_api_key_is_checked_before_the_body(tiny_target_dir):
    target = load_served_target(tiny_target_dir)
    with running_server(create_app(target, None, api_keys="sekret")) as url:
        assert openai_error(post(url, "chat/completions", b"{bad json"), 401)["code"] == "invalid_api_key"
        assert openai_error(post(url, "completions", {"wrong": "key"}), 401)
        good = {"Authorization": "Bearer sekret"}
        assert openai_error(post(url, "completions", b"{bad json", headers=good), 400)["code"] == "invalid_json"
        metrics = httpx.get(f"{url}/metrics").text
    assert 'blockspec_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics


def test_an_empty_api_key_is_refused():
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="API key is empty"):
        create_app(None, None, api_keys=" ")


# -- 10. ignore_eos and min_tokens, as vLLM takes them -----------------------------------------------------

def test_ignore_eos_decodes_to_the_token_limit(tiny_target_dir):
    target = load_served_target(tiny_target_dir)
    prompt = "Natalia sold clips"
    ids = target.encode_prompt(prompt, use_chat_template=False)
    target.model.generation_config.eos_token_id = greedy_tokens(target, ids, 3, stop=False)[1]  # the 2nd token
    with running_server(create_app(target, None)) as url:
        body = {"model": target.name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
        stopped = post(url, "completions", body).json()
        full = post(url, "completions", {**body, "ignore_eos": True}).json()
        late = post(url, "completions", {**body, "min_tokens": 5}).json()
    assert (stopped["usage"]["completion_tokens"], stopped["choices"][0]["finish_reason"]) == (2, "stop")
    assert (full["usage"]["completion_tokens"], full["choices"][0]["finish_reason"]) == (12, "length")
    everything = greedy_tokens(target, ids, 12, stop=False)
    eos = everything[1]
    late_stop = next((i for i, t in enumerate(everything) if t == eos and i >= 5), None)
    expected = len(everything) if late_stop is None else late_stop + 1
    assert late["usage"]["completion_tokens"] == expected
    assert late["choices"][0]["finish_reason"] == ("length" if late_stop is None else "stop")


def test_min_tokens_above_the_limit_is_a_400(served):
    url, target = served
    body = {"model": target.name, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}
    assert openai_error(post(url, "completions", body), 400)["param"] == "min_tokens"


# -- the command line: one line of error, exit code 2 -------------------------------------------------------

def cli_error(capsys, *argv) -> str:
    from blockspec.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("blockspec: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_prompt_that_is_not_utf8_is_refused(tiny_target_dir, capsys):
    undecodable = b"\xff\xfe hi".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    assert "not UTF-8" in cli_error(capsys, "generate", "--target", str(tiny_target_dir), undecodable)
    assert "not UTF-8" in cli_error(capsys, "dllm", "generate", "--model", str(tiny_target_dir), "--mask-token-id",
                                    "3", undecodable)


@pytest.mark.parametrize("command", [["generate", "--target", "TARGET"],
                                     ["dllm", "generate", "--model", "TARGET", "--mask-token-id", "3"]])
def test_standard_input_that_is_not_utf8_is_refused(tiny_target_dir, command):
    import subprocess
    import sys

    argv = [str(tiny_target_dir) if part == "TARGET" else part for part in command]
    result = subprocess.run([sys.executable, "-m", "blockspec.cli", *argv, "-"], input=b"\xff\xfe hi",
                            capture_output=True, timeout=120)
    assert result.returncode == 2 and b"Traceback" not in result.stderr
    assert b"standard input is not UTF-8" in result.stderr


def test_a_truncated_model_file_is_named(tiny_target_dir, tmp_path, capsys):
    import shutil

    damaged = shutil.copytree(tiny_target_dir, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    err = cli_error(capsys, "generate", "--target", str(damaged), "hi")
    assert str(weights) in err and "incomplete or damaged" in err
    assert "could not load" in cli_error(capsys, "dllm", "generate", "--model", str(damaged), "--mask-token-id", "3",
                                         "hi")


def test_a_device_this_machine_lacks_is_refused(tiny_target_dir, capsys):
    import torch

    if not torch.cuda.is_available():
        assert "CUDA is not available" in cli_error(capsys, "generate", "--target", str(tiny_target_dir),
                                                    "--device", "cuda", "hi")
    assert "not a device" in cli_error(capsys, "generate", "--target", str(tiny_target_dir), "--device", "gpu0", "hi")


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", str(10**9)], "--max-new-tokens 1000000000 does not fit: the model's context is 512"),
    (["--draft", "DRAFT", "--tree-budget", "100000"], "--tree-budget 100000 is too large"),
    (["--method", "ngram", "--block-size", "100000"], "--block-size 100000 is too large"),
])
def test_generate_refuses_what_would_not_fit(tiny_target_dir, tiny_draft_dir, capsys, args, message):
    args = [str(tiny_draft_dir) if a == "DRAFT" else a for a in args]
    assert message in cli_error(capsys, "generate", "--target", str(tiny_target_dir), *args, "hi")


def test_a_missing_target_directory_is_named(capsys):
    for path in ("/no/such/model", "./no-such-model"):
        assert f"the model directory {path} does not exist" in cli_error(capsys, "generate", "--target", path, "hi")


def test_bench_lists_every_method_for_an_unknown_one(capsys):
    err = cli_error(capsys, "bench", "--methods", "ar,foo")
    assert "unknown benchmark method 'foo'" in err and "dflash" in err and "ngram" in err


def test_an_empty_api_key_is_refused_from_the_option_or_the_environment(tiny_target_dir, capsys, monkeypatch):
    assert "--api-key is empty" in cli_error(capsys, "serve", "--target", str(tiny_target_dir), "--api-key", "")
    monkeypatch.setenv("BLOCKSPEC_API_KEY", " ")
    assert "$BLOCKSPEC_API_KEY is empty" in cli_error(capsys, "serve", "--target", str(tiny_target_dir))


def test_the_api_key_comes_from_the_environment(monkeypatch):
    from blockspec.cli import build_parser
    from blockspec.cli.serve import api_key_of, api_keys_of

    monkeypatch.setenv("BLOCKSPEC_API_KEY", "from-env")
    assert api_keys_of(build_parser().parse_args(["serve"])) == ["from-env"]
    assert api_keys_of(build_parser().parse_args(["serve", "--api-key", "given"])) == ["given"]
    assert api_keys_of(build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])) == ["a", "b"]
    assert api_key_of(build_parser().parse_args(["loadtest"])) == "from-env"
    monkeypatch.setenv("BLOCKSPEC_API_KEY", "one,two")
    assert api_keys_of(build_parser().parse_args(["serve"])) == ["one", "two"]
    monkeypatch.delenv("BLOCKSPEC_API_KEY")
    assert api_keys_of(build_parser().parse_args(["serve"])) == []
    assert api_key_of(build_parser().parse_args(["loadtest"])) is None


@pytest.mark.parametrize("args,message", [
    (["--block-length", "0"], "block_length must be >= 1"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--gen-length", "100000"], "gen_length 100000 does not fit"),
])
def test_dllm_generate_refuses_values_it_cannot_run(tiny_target_dir, capsys, args, message):
    assert message in cli_error(capsys, "dllm", "generate", "--model", str(tiny_target_dir), "--mask-token-id", "3",
                                *args, "hi")


def test_an_empty_dllm_prompt_is_refused(tiny_target_dir, capsys):
    assert "the prompt is empty" in cli_error(capsys, "dllm", "generate", "--model", str(tiny_target_dir),
                                              "--mask-token-id", "3", "  ")


def test_a_seed_out_of_range_is_an_argument_error(capsys):
    from blockspec.cli import main

    with pytest.raises(SystemExit) as raised:
        main(["generate", "--seed", str(2**70), "hi"])
    assert raised.value.code == 2 and "a seed must lie in" in capsys.readouterr().err


# -- train-draft: values, the output directory, resuming ------------------------------------------------------

def train_draft_args(tiny_target_dir, tmp_path, *extra) -> list[str]:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i} things"}) + "\n" for i in range(8)))
    return ["train-draft", "--target", str(tiny_target_dir), "--data", str(data), "--max-new-tokens", "4",
            "--held-out", "1", "--num-layers", "1", "--block-size", "4", *extra]


@pytest.mark.parametrize("args,message", [
    (["--lr", "nan"], "lr must be a number > 0, got nan"),
    (["--lr", "inf"], "lr must be a number > 0, got inf"),
    (["--max-steps", "-1"], "max_steps must be >= 1"),
    (["--max-steps", "0"], "max_steps must be >= 1"),
    (["--keep-last", "-1"], "keep_checkpoints must be a number >= 0"),
    (["--seed", "99999999999"], "seed must lie in [0, 2147483647]"),
])
def test_train_draft_refuses_settings_that_cannot_train(tiny_target_dir, tmp_path, capsys, args, message):
    assert message in cli_error(capsys, *train_draft_args(tiny_target_dir, tmp_path, "--out", str(tmp_path / "o"),
                                                          *args))


def test_train_draft_refuses_an_output_directory_it_cannot_write(tiny_target_dir, tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    args = train_draft_args(tiny_target_dir, tmp_path)
    assert "is a file, not a directory" in cli_error(capsys, *args, "--out", str(a_file))
    assert "cannot write there (Not a directory)" in cli_error(capsys, *args, "--out", str(a_file / "sub"))
    for empty in ("", " "):  # not the working directory
        assert "--out is empty" in cli_error(capsys, *args, "--out", empty)
    for system in ("/proc/blockspec-out", "/sys/blockspec-out"):
        if __import__("os").path.isdir(system.rsplit("/", 1)[0]):
            assert "cannot write there" in cli_error(capsys, *args, "--out", system)


@pytest.fixture
def four_steps(learned_target, training_data, tmp_path):
    """A run stopped after step 4, with checkpoints at steps 2 and 4."""
    from blockspec.training.trainer import Trainer
    from helpers import small_config

    target, _, _ = learned_target
    samples, _ = training_data
    config = small_config(tmp_path, max_steps=8, save_every=2)
    Trainer(config, target, samples).run(until_step=4)
    return lambda: Trainer(config, target, samples, resume=True)


@pytest.mark.parametrize("damage,said", [
    (lambda c: (c / "latest").write_text("step-0000009"), "'latest' names 'step-0000009', which is not there"),
    (lambda c: (c / "latest").write_bytes(b"\x00\xff garbage\n../../etc"), "which is not there"),
    (lambda c: (c / "step-0000004" / "trainer_state.pt").write_bytes(b"PK\x03\x04 cut"), "does not load"),
    (lambda c: (c / "step-0000004" / "trainer_state.pt").write_bytes(b""), "does not load"),
    (lambda c: (c / "step-0000004" / "trainer_state.pt").unlink(), "trainer_state.pt is missing"),
    (lambda c: (c / "step-0000004" / "model.safetensors").write_bytes(b"cut"), "its model does not load"),
], ids=["latest-missing", "latest-garbage", "state-truncated", "state-empty", "state-missing", "weights-cut"])
def test_resume_takes_the_newest_complete_checkpoint_and_says_so(four_steps, tmp_path, capsys, damage, said):
    damage(tmp_path / "checkpoints")
    capsys.readouterr()
    trainer = four_steps()
    err = capsys.readouterr().err
    expected_step = 4 if "latest" in said or "not there" in said else 2
    assert trainer.state.step == expected_step
    assert f"resuming from step-{expected_step:07d}, the newest complete checkpoint" in err and said in err


def test_resume_refuses_when_no_checkpoint_loads(four_steps, tmp_path):
    from blockspec.errors import BlockspecError

    for state in (tmp_path / "checkpoints").glob("step-*/trainer_state.pt"):
        state.write_bytes(b"")
    with pytest.raises(BlockspecError, match="no checkpoint in .* loads .*step-0000004.*step-0000002"):
        four_steps()


def test_resume_with_no_checkpoint_says_it_starts_at_step_0(learned_target, training_data, tmp_path, capsys):
    from blockspec.training.trainer import Trainer
    from helpers import small_config

    target, _, _ = learned_target
    trainer = Trainer(small_config(tmp_path / "new", max_steps=2), target, training_data[0], resume=True)
    assert trainer.state.step == 0 and "no checkpoint" in capsys.readouterr().err


def test_staging_left_by_a_kill_is_removed_and_old_checkpoints_pruned(learned_target, training_data, tmp_path):
    from blockspec.training.trainer import Trainer
    from helpers import small_config

    target, _, _ = learned_target
    samples, _ = training_data
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".step-0000007.x1y2").mkdir(parents=True)
    (checkpoints / ".step-0000007.x1y2" / "model.safetensors").write_bytes(b"0" * 1000)
    (tmp_path / ".draft.abc").mkdir()
    trainer = Trainer(small_config(tmp_path, max_steps=5, save_every=1, keep_checkpoints=2), target, samples)
    assert sorted(p.name for p in checkpoints.iterdir()) == []
    assert not (tmp_path / ".draft.abc").exists()
    trainer.run()
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-0000004", "step-0000005"]


# -- found by the fuzzer ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args,message", [
    (["--timeout", "nan"], "--timeout must be a number of seconds > 0, got nan"),
    (["--api-key", "\udcff\udcfe"], "--api-key must be printable ASCII"),
])
def test_loadtest_refuses_a_timeout_or_key_it_cannot_use(capsys, args, message):
    assert message in cli_error(capsys, "loadtest", "--url", "http://127.0.0.1:9", *args)


def test_a_key_that_cannot_travel_in_a_header_is_refused():
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="printable ASCII"):
        create_app(None, None, api_keys=["ok", "clé"])


def test_a_library_error_over_several_lines_is_one_line(capsys):
    from blockspec.cli import fail

    assert fail("could not load: no network.\nCheck your connection.", 2) == 2
    assert capsys.readouterr().err == "blockspec: error: could not load: no network. Check your connection.\n"


# -- draft configs that cannot describe a network, and a draft given as the target -----------------------------

def broken_draft(tiny_draft_dir, tmp_path, change) -> str:
    directory = tmp_path / "broken-draft"
    shutil.copytree(tiny_draft_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def set_block_size(value):
    return lambda config: config["dflash_config"].update(block_size=value)


@pytest.mark.parametrize("change,message", [
    (lambda c: c.update(num_hidden_layers=-1), "num_hidden_layers must be a whole number >= 1, got -1"),
    (lambda c: c.update(num_hidden_layers=0), "num_hidden_layers must be a whole number >= 1, got 0"),
    (lambda c: c.update(hidden_size="abc"), "hidden_size must be a whole number >= 1, got 'abc'"),
    (lambda c: c.update(num_attention_heads=2.5), "num_attention_heads must be a whole number >= 1, got 2.5"),
    (lambda c: c.update(intermediate_size=True), "intermediate_size must be a whole number >= 1, got True"),
    (set_block_size(0), "dflash_config.block_size must be a whole number >= 2"),
    (set_block_size(-3), "dflash_config.block_size must be a whole number >= 2"),
    (set_block_size(1), "dflash_config.block_size must be a whole number >= 2"),
    (lambda c: c.update(rms_norm_eps="tiny"), "config.json is not a valid config"),
])
def test_a_draft_config_that_describes_no_network_is_refused_in_one_line(tiny_target_dir, tiny_draft_dir, tmp_path,
                                                                         capsys, change, message):
    draft = broken_draft(tiny_draft_dir, tmp_path, change)
    assert message in cli_error(capsys, "generate", "--target", str(tiny_target_dir), "--draft", draft,
                                "--max-new-tokens", "2", "hi")


def test_a_draft_given_as_the_target_is_named_as_a_draft(tiny_draft_dir, capsys):
    err = cli_error(capsys, "generate", "--target", str(tiny_draft_dir), "--max-new-tokens", "2", "hi")
    assert "is a DFlash draft checkpoint, not a model to decode: pass it as --draft" in err


def test_train_draft_refuses_a_draft_as_its_target_and_writes_nothing(tiny_target_dir, tiny_draft_dir, tmp_path,
                                                                      capsys):
    out = tmp_path / "out"
    args = train_draft_args(tiny_target_dir, tmp_path, "--out", str(out))
    args[args.index("--target") + 1] = str(tiny_draft_dir)
    assert "is a DFlash draft checkpoint" in cli_error(capsys, *args)
    assert not out.exists()


# -- request bodies over the size limit -------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_limit(tiny_target_dir):
    app = create_app(load_served_target(tiny_target_dir), max_request_bytes=2000)
    with running_server(app) as url:
        yield url


def test_a_body_over_the_limit_is_a_413_by_its_length(small_limit):
    body = {"model": "x", "prompt": "word " * 1000}
    error = openai_error(post(small_limit, "completions", body), 413)
    assert error["code"] == "request_too_large" and "2000 bytes" in error["message"]
    metrics = httpx.get(f"{small_limit}/metrics").text
    assert 'blockspec_requests_total{endpoint="/v1/completions",status="413"} 1.0' in metrics


def test_a_chunked_body_over_the_limit_is_a_413_as_it_arrives(small_limit):
    def chunks():
        yield b'{"model": "x", "prompt": "'
        for _ in range(50):
            yield b"word " * 20
        yield b'"}'

    response = httpx.post(f"{small_limit}/v1/completions", content=chunks(), timeout=30,
                          headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert openai_error(response, 413)["code"] == "request_too_large"


def test_a_body_under_the_limit_is_answered(small_limit):
    target_name = httpx.get(f"{small_limit}/v1/models").json()["data"][0]["id"]
    body = {"model": target_name, "prompt": "hello", "max_tokens": 2, "temperature": 0}
    assert post(small_limit, "completions", body).status_code == 200


# -- parameters the server does not implement: refused by name, never ignored ------------------------------

@pytest.mark.parametrize("endpoint,param,value", [
    ("completions", "suffix", "end"),
    ("chat/completions", "functions", [{"name": "f"}]),
    ("chat/completions", "function_call", "auto"),
])
def test_a_parameter_the_server_would_ignore_is_refused_by_name(served, endpoint, param, value):
    url, target = served
    body = {"model": target.name, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    error = openai_error(post(url, endpoint, {**body, param: value}), 400)
    assert error["param"] == param and error["code"] == "unsupported_parameter" and param in error["message"]


def test_tools_for_a_template_without_a_place_for_them_are_refused(served):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    error = openai_error(post(url, "chat/completions", body), 400)
    assert error["param"] == "tools" and "template" in error["message"]


def test_neutral_values_of_those_parameters_are_answered(served):
    url, target = served
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "response_format": {"type": "text"},
               "tools": [], "tool_choice": "none", "min_p": 0, "repetition_penalty": 1, "bad_words": [],
               "logprobs": False, "top_logprobs": 0}
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **neutral}
    assert post(url, "chat/completions", body).status_code == 200
    body = {"model": target.name, "prompt": "hi", "max_tokens": 2, "echo": False, "best_of": 1, "logprobs": None}
    assert post(url, "completions", body).status_code == 200


@pytest.mark.parametrize("param,value", [("presence_penalty", 5), ("frequency_penalty", "abc"),
                                         ("repetition_penalty", 0), ("min_p", 2), ("top_logprobs", 50),
                                         ("stop_token_ids", [-1]), ("stop_token_ids", "7"),
                                         ("logit_bias", {"5": 150}), ("logit_bias", {"five": 1}),
                                         ("logit_bias", {"99999999": 1}), ("bad_words", [" "])])
def test_out_of_range_values_of_them_are_a_400(served, param, value):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, param: value}
    assert openai_error(post(url, "chat/completions", body), 400)["param"] == param


def _first_word(tokenizer, free):
    word = tokenizer.decode(free[:2]).strip()
    ids = {tuple(tokenizer.encode(text, add_special_tokens=False)) for text in (word, " " + word)}
    return {"bad_words": [word]}, {"bad_words_ids": sorted(ids)}


@pytest.mark.parametrize("case", [
    lambda tokenizer, free: ({"presence_penalty": 1.5, "frequency_penalty": 1.0},) * 2,
    lambda tokenizer, free: ({"repetition_penalty": 1.5},) * 2,
    lambda tokenizer, free: ({"logit_bias": {str(free[0]): -100}}, {"logit_bias": {free[0]: -100.0}}),
    _first_word,
    # min_p 1 keeps only the most probable token: sampling becomes greedy decoding
    lambda tokenizer, free: ({"min_p": 1.0, "temperature": 1.0, "seed": 3}, {}),
])
def test_penalties_bias_and_banned_words_are_honoured(served, case):
    """The answer equals greedy decoding of the prompt with the same adjustments."""
    url, target = served
    prompt = "Natalia sold clips to 48 of her friends"
    ids = target.encode_prompt(prompt, use_chat_template=False)
    free = greedy_tokens(target, ids, 12, stop=False)
    request, fields = case(target.tokenizer, free)
    body = {"model": target.name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            **request}
    answer = post(url, "completions", body).json()
    config = GenerationConfig(max_new_tokens=12, **{"temperature": 0, **fields})
    stream = speculative_generate(target.model, ids, None, config)
    list(stream)
    assert answer["choices"][0]["text"] == target.tokenizer.decode(stream.token_ids)
    if "logit_bias" in request or "bad_words" in request:
        assert stream.token_ids != free


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.parametrize("structure,valid", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}},
     lambda text: set(json.loads(text)) == {"n", "ok"}),
    ({"guided_json": SCHEMA}, lambda text: set(json.loads(text)) == {"n", "ok"}),
    ({"guided_regex": "[0-9]{2}-[a-c]{3}"}, lambda text: re.fullmatch("[0-9]{2}-[a-c]{3}", text)),
    ({"guided_choice": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ({"guided_grammar": 'root ::= "(" [1-9] ("," [1-9])* ")"'}, lambda text: re.fullmatch(r"\([1-9](,[1-9])*\)", text)),
])
def test_structured_output_follows_its_grammar_and_equals_constrained_decoding(served, structure, valid):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "Answer now."}], "max_tokens": 40,
            "temperature": 0, **structure}
    answer = post(url, "chat/completions", body).json()["choices"][0]
    assert answer["finish_reason"] == "stop" and valid(answer["message"]["content"]), answer
    name, value = next(iter(structure.items()))
    grammar = {"response_format": lambda: Grammar.json_schema(target.tokenizer, SCHEMA),
               "guided_json": lambda: Grammar.json_schema(target.tokenizer, value),
               "guided_regex": lambda: Grammar.regex(target.tokenizer, value),
               "guided_choice": lambda: Grammar.choice(target.tokenizer, value),
               "guided_grammar": lambda: Grammar.lark(target.tokenizer, value)}[name]()
    ids = target.encode_prompt(body["messages"], use_chat_template=True)
    config = GenerationConfig(max_new_tokens=40, grammar=grammar, stop_token_ids=tuple(target.stop_token_ids()))
    stream = speculative_generate(target.model, ids, None, config)
    list(stream)
    assert answer["message"]["content"] == target.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("structure,param", [
    ({"guided_regex": "[0-9", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
])
def test_a_structure_that_cannot_be_followed_is_a_400_naming_it(served, structure, param):
    url, target = served
    body = {"model": target.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **structure}
    assert openai_error(post(url, "chat/completions", body), 400)["param"] == param


def test_stop_token_ids_end_the_answer(served):
    url, target = served
    prompt = "Natalia sold clips"
    ids = target.encode_prompt(prompt, use_chat_template=False)
    free = greedy_tokens(target, ids, 12, stop=False)
    body = {"model": target.name, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "stop_token_ids": [free[3]]}
    answer = post(url, "completions", body).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == free.index(free[3]) + 1
