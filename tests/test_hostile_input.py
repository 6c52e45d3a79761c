"""Hostile and careless input, case by case: each gets a one-line error (OpenAI-style JSON from the
server) or the right behaviour, never a traceback, a 5xx or someone else's failure."""

import json

import httpx
import pytest

from blockspec.decoding.generate import speculative_generate
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
    with running_server(create_app(target, None, api_key="sekret")) as url:
        assert openai_error(post(url, "chat/completions", b"{bad json"), 401)["code"] == "invalid_api_key"
        assert openai_error(post(url, "completions", {"wrong": "key"}), 401)
        good = {"Authorization": "Bearer sekret"}
        assert openai_error(post(url, "completions", b"{bad json", headers=good), 400)["code"] == "invalid_json"
        metrics = httpx.get(f"{url}/metrics").text
    assert 'blockspec_requests_total{endpoint="/v1/completions",status="401"} 1.0' in metrics


def test_an_empty_api_key_is_refused():
    from blockspec.errors import BlockspecError

    with pytest.raises(BlockspecError, match="API key is empty"):
        create_app(None, None, api_key=" ")


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
