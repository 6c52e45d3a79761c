"""The OpenAI-compatible server: the official client, dynamic batching, disconnects, errors, metrics."""

import ctypes.util
import json
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest

from blockspec.drafters.registry import build_drafter
from blockspec.models.target import Target
from blockspec.serve import engine as serve_engine
from blockspec.serve import generation as serve_generation
from blockspec.serve.app import create_app
from blockspec.serve.generation import StopStrings
from helpers import load_served_target, running_server

pytestmark = pytest.mark.timeout(120)


@dataclass
class Served:
    url: str
    app: object
    target: Target

    @property
    def model(self) -> str:
        return self.target.name

    @property
    def engine(self):
        return self.app.state.engine

    def client(self, **options) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=options.pop("api_key", "unused"), max_retries=0,
                             **options)


@pytest.fixture(scope="module")
def served(tiny_target_dir, tiny_draft_dir):
    """The tiny target with its DFlash drafter, so the requests go through speculative decoding."""
    target = load_served_target(tiny_target_dir)
    drafter = build_drafter("dflash", target, str(tiny_draft_dir))
    app = create_app(target, drafter, max_batch_size=8, max_queue=64)
    with running_server(app) as url:
        yield Served(url, app, target)


@pytest.fixture(scope="module")
def guarded(tiny_target_dir):
    """An AR server with an API key and room for one request in flight."""
    target = load_served_target(tiny_target_dir)
    app = create_app(target, None, max_batch_size=2, max_queue=1, api_keys="sekret")
    with running_server(app) as url:
        yield Served(url, app, target)


def wait_until_idle(served: Served, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{served.url}/health").json()
        if health["in_flight"] == 0 and health["active_rows"] == 0 and health["waiting"] == 0:
            return health
        assert time.monotonic() < deadline, f"the server stayed busy: {health}"
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


# -- the official client -----------------------------------------------------------------------

def test_openai_client_completions_streaming_and_not(served):
    client = served.client()
    full = client.completions.create(model=served.model, prompt="The quick brown fox", max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.model == served.model
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.completion_tokens == (12 if choice.finish_reason == "length" else full.usage.completion_tokens)
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(model=served.model, prompt="The quick brown fox", max_tokens=12,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_client_chat_streaming_and_not(served):
    client = served.client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 times 7?"}]
    full = client.chat.completions.create(model=served.model, messages=messages, max_completion_tokens=10,
                                          temperature=0)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == len(served.target.encode_prompt(messages))

    stream = client.chat.completions.create(model=served.model, messages=messages, max_tokens=10, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_models_listing_and_unknown_model(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.model]
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}])
    assert raised.value.body["code"] == "model_not_found"
    assert_openai_error(httpx.post(f"{served.url}/v1/completions", json={"model": "nope", "prompt": "a"}), 404,
                        "model")


def test_stop_strings_cut_the_text_and_finish_with_stop(served):
    client = served.client()
    free = client.completions.create(model=served.model, prompt="Natalia sold clips", max_tokens=16,
                                     temperature=0).choices[0].text
    assert len(free) >= 6, "the tiny model's output is too short to pick a stop string from"
    stop = free[4:6]
    expected = free[:free.find(stop)]
    cut = client.completions.create(model=served.model, prompt="Natalia sold clips", max_tokens=16, temperature=0,
                                    stop=[stop, "never-appears"]).choices[0]
    assert (cut.text, cut.finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(model=served.model, prompt="Natalia sold clips", max_tokens=16,
                                              temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"
    wait_until_idle(served)


def test_stop_strings_hold_back_a_possible_start():
    stops = StopStrings(["END"])
    assert stops.feed("abcE") == ("abc", False)
    assert stops.feed("N") == ("", False)
    assert stops.feed("x") == ("ENx", False)
    assert stops.feed("yyEND zz") == ("yy", True)


# -- concurrency -----------------------------------------------------------------------------------

PROMPTS = [f"Prompt number {i}: " + "the quick brown fox " * (i % 5) for i in range(16)]


def complete(served: Served, prompt: str) -> tuple[str, int]:
    body = {"model": served.model, "prompt": prompt, "max_tokens": 10, "temperature": 0}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


def batch_size_figures(served: Served) -> tuple[float, float]:
    text = httpx.get(f"{served.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("blockspec_batch_size_")}
    return values["blockspec_batch_size_sum"], values["blockspec_batch_size_count"]


def test_concurrent_requests_are_batched_and_equal_requests_sent_one_by_one(served):
    one_by_one = [complete(served, p) for p in PROMPTS]
    rows_before, forwards_before = batch_size_figures(served)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: complete(served, p), PROMPTS))
    rows, forwards = batch_size_figures(served)
    assert together == one_by_one
    assert (rows - rows_before) / (forwards - forwards_before) > 1.5, "the concurrent requests were not batched"
    wait_until_idle(served)


def test_a_client_leaving_mid_stream_frees_its_row(served, monkeypatch):
    cancelled = []
    cancel = served.engine.engine.cancel
    monkeypatch.setattr(served.engine.engine, "cancel", lambda row: (cancelled.append(row), cancel(row)))
    body = {"model": served.model, "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.Client(base_url=served.url, timeout=30) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            data = (json.loads(line[len("data: "):]) for line in response.iter_lines() if line.startswith("data: "))
            opening, first_text = next(data), next(data)  # the second chunk comes once the row has decoded
            assert opening["choices"][0]["delta"]["role"] == "assistant"
            assert first_text["choices"][0]["delta"]["content"]
    health = wait_until_idle(served)
    assert health["status"] == "ok"
    assert served.engine.engine.rows == [] and not served.engine.engine.waiting
    assert [row.stats.finish_reason for row in cancelled] == ["cancelled"], [(r.stats, r.token_ids) for r in cancelled]
    assert len(cancelled[0].token_ids) < 400, "the row ran to its end instead of being cancelled"
    assert complete(served, "after the disconnect")[1] > 0


def test_a_client_giving_up_on_a_non_streamed_request_frees_its_row(served, monkeypatch):
    monkeypatch.setattr(serve_generation, "_DISCONNECT_POLL_S", 0.05)
    cancelled = []
    cancel = served.engine.engine.cancel
    monkeypatch.setattr(served.engine.engine, "cancel", lambda row: (cancelled.append(row), cancel(row)))
    body = {"model": served.model, "prompt": "Tell me everything.", "max_tokens": 480, "temperature": 0}
    before = completion_counts(served)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.4))
    wait_until_idle(served)
    assert [row.stats.finish_reason for row in cancelled] == ["cancelled"]
    assert len(cancelled[0].token_ids) < 480
    deadline = time.monotonic() + 10
    while completion_counts(served)["disconnected"] == before["disconnected"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = completion_counts(served)
    assert after["disconnected"] == before["disconnected"] + 1 and after["200"] == before["200"]


def completion_counts(served) -> dict[str, float]:
    """/metrics' count of /v1/completions answers by status."""
    text = httpx.get(f"{served.url}/metrics").text
    counts = {"200": 0.0, "disconnected": 0.0}
    for status in counts:
        line = f'blockspec_requests_total{{endpoint="/v1/completions",status="{status}"}} '
        counts[status] = next((float(row[len(line):]) for row in text.splitlines() if row.startswith(line)), 0.0)
    return counts


# -- bad requests ------------------------------------------------------------------------------------

def bad_requests(model):
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    text = {"model": model, "prompt": "hi"}
    return [
        ("completions", b"{not json", 400, None),
        ("completions", {"model": model}, 400, "prompt"),
        ("chat/completions", {"model": model}, 400, "messages"),
        ("chat/completions", {"messages": chat["messages"]}, 400, "model"),
        ("chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("completions", {**text, "max_tokens": 0}, 400, "max_tokens"),
        ("completions", {**text, "max_tokens": 100_000}, 400, "max_tokens"),
        ("chat/completions", {**chat, "max_completion_tokens": 100_000}, 400, "max_completion_tokens"),
        ("completions", {**text, "prompt": [5] * 600}, 400, "prompt"),
        ("completions", {**text, "prompt": "   "}, 400, "prompt"),
        ("completions", {**text, "prompt": ["a", "b"], "stream": True}, 400, "prompt"),
        ("completions", {**text, "prompt": ["a", "   "]}, 400, "prompt[1]"),
        ("completions", {**text, "prompt": [[5, 6], [-1]]}, 400, "prompt[1]"),
        ("chat/completions", {**chat, "temperature": -0.5}, 400, "temperature"),
        ("chat/completions", {**chat, "top_p": 0}, 400, "top_p"),
        ("chat/completions", {**chat, "top_p": 1.5}, 400, "top_p"),
        ("completions", {**text, "n": 2, "stream": True}, 400, "n"),
        ("chat/completions", {**chat, "n": 17}, 400, "n"),
        ("chat/completions", {**chat, "model": "other-model"}, 404, "model"),
    ]


def test_bad_requests_get_4xx_with_openai_error_bodies(served):
    with httpx.Client(base_url=f"{served.url}/v1", timeout=30) as client:
        for endpoint, body, status, param in bad_requests(served.model):
            if isinstance(body, bytes):
                response = client.post(endpoint, content=body, headers={"content-type": "application/json"})
            else:
                response = client.post(endpoint, json=body)
            assert_openai_error(response, status, param)
        assert_openai_error(client.get("/no-such-endpoint"), 404)
    wait_until_idle(served)


def test_several_prompts_are_answered_as_choices_of_one_body(served):
    """A list of texts or of token-id lists: each prompt decodes in the batch and answers as its own choice,
    as the same prompt sent alone does."""
    texts = PROMPTS[:3]
    body = {"model": served.model, "prompt": texts, "max_tokens": 10, "temperature": 0}
    answer = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60).json()
    alone = [complete(served, text) for text in texts]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [text for text, _ in alone]
    assert answer["usage"]["completion_tokens"] == sum(tokens for _, tokens in alone)
    ids = [served.target.encode_prompt(text, use_chat_template=False) for text in texts[:2]]
    by_ids = httpx.post(f"{served.url}/v1/completions", json={**body, "prompt": ids}, timeout=60).json()
    assert [c["text"] for c in by_ids["choices"]] == [text for text, _ in alone[:2]]
    wait_until_idle(served)  # nothing of the body's prompts stays in flight (released just after the answer)


def test_prompts_past_the_queue_are_refused_together(guarded):
    """Room for one request in flight: two prompts in one body get a 503 and leave nothing running."""
    body = {"model": guarded.model, "prompt": ["one", "two"], "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{guarded.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sekret"})
    assert_openai_error(response, 503, None)
    deadline = time.monotonic() + 10
    while guarded.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guarded.engine.in_flight == 0


# -- capacity, authentication, metrics -------------------------------------------------------------------

def test_a_full_queue_answers_503_and_recovers(guarded, monkeypatch):
    # Hold the engine in its step, so the first request stays in flight however fast it would decode.
    gate = threading.Event()
    step = guarded.engine.engine.step
    monkeypatch.setattr(guarded.engine.engine, "step", lambda: (gate.wait(20), step())[1])
    headers = {"Authorization": "Bearer sekret"}
    short = {"model": guarded.model, "prompt": "hi", "max_tokens": 2}
    with httpx.Client(base_url=guarded.url, headers=headers, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json={**short, "stream": True}) as holding:
            assert holding.status_code == 200  # headers come once the request is queued
            error = assert_openai_error(client.post("/v1/completions", json=short), 503)
            assert error["type"] == "server_error"
            gate.set()
            assert "data: [DONE]" in list(holding.iter_lines())
        wait_until_idle(guarded)
        assert client.post("/v1/completions", json=short).status_code == 200


def test_the_api_key_is_required_when_set(guarded):
    url = f"{guarded.url}/v1/models"
    assert_openai_error(httpx.get(url), 401)
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401)
    assert httpx.get(url, headers={"Authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        guarded.client(api_key="wrong").completions.create(model=guarded.model, prompt="hi", max_tokens=2)
    reply = guarded.client(api_key="sekret").completions.create(model=guarded.model, prompt="hi", max_tokens=2)
    assert reply.usage.completion_tokens >= 1
    assert httpx.get(f"{guarded.url}/health").status_code == 200  # health and metrics stay open


def test_metrics_expose_requests_tokens_tau_batching_and_latency(served):
    complete(served, "count me")
    text = httpx.get(f"{served.url}/metrics").text
    for name in ["blockspec_requests_total", "blockspec_prompt_tokens_total", "blockspec_generated_tokens_total",
                 "blockspec_tau_bucket", "blockspec_batch_size_bucket", "blockspec_queue_depth",
                 "blockspec_active_rows", "blockspec_request_latency_seconds_bucket",
                 "blockspec_time_to_first_token_seconds_bucket"]:
        assert name in text, name
    assert 'blockspec_requests_total{endpoint="/v1/completions",status="200"}' in text


def test_a_seeded_sampled_request_repeats(served):
    client = served.client()
    ask = dict(model=served.model, prompt="Write a function", max_tokens=8, temperature=0.9, top_p=0.95, seed=7)
    assert client.completions.create(**ask).choices[0].text == client.completions.create(**ask).choices[0].text


def test_serve_options_are_checked(tiny_target_dir, capsys):
    from blockspec.cli import main
    from blockspec.errors import BlockspecError

    assert main(["serve", "--target", str(tiny_target_dir), "--method", "ar", "--port", "0"]) == 2
    assert "--port" in capsys.readouterr().err
    assert main(["serve", "--target", str(tiny_target_dir), "--method", "ar", "--kv-budget", "lots"]) == 2
    assert "--kv-budget takes a number of token slots" in capsys.readouterr().err
    with pytest.raises(BlockspecError, match="max_queue"):
        create_app(load_served_target(tiny_target_dir), None, max_queue=0)


def test_a_request_past_the_kv_budget_is_a_400_and_the_others_wait_for_room(tiny_target_dir):
    from blockspec.decoding.batch import BatchEngine

    target = load_served_target(tiny_target_dir)
    reach = len(target.encode_prompt("Natalia sold clips", use_chat_template=False)) + 8
    budget = BatchEngine(target.model, None, max_batch_size=4).target.kv_slots(2, reach)  # two rows, not three
    app = create_app(target, None, max_batch_size=4, kv_budget=budget)
    with running_server(app) as url:
        body = {"model": target.name, "prompt": "Natalia sold clips", "temperature": 0}
        refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 200})
        assert assert_openai_error(refused, 400, param="max_tokens")["code"] == "kv_budget_exceeded"
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 8},
                                                         timeout=60).json(), range(4)))
        assert len({answer["choices"][0]["text"] for answer in answers}) == 1
        metrics = httpx.get(f"{url}/metrics").text
        assert f"blockspec_kv_budget {float(budget)}" in metrics
        histogram = {line.split("le=")[1].split("}")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                     if line.startswith("blockspec_batch_size_bucket")}
        assert histogram['"2.0"'] == histogram['"+Inf"']  # two rows at a time at most, never four
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 4, "stream": True}) as stream:
            assert stream.headers["x-queue-position"] == "0"


# -- trees, the adaptive width and batches of one ------------------------------------------------

@pytest.mark.parametrize("options,batch,engine", [({"tree_budget": 8}, 8, "BatchEngine"),
                                                  ({"block_size": "auto"}, 8, "BatchEngine"),
                                                  ({}, 8, "BatchEngine"),
                                                  ({"tree_budget": 8}, 1, "SequentialEngine")],
                         ids=["tree", "auto", "default", "tree-alone"])
def test_trees_and_adaptive_widths_serve_the_greedy_tokens_of_generate(tiny_target_dir, tiny_draft_dir, options,
                                                                       batch, engine):
    from blockspec.decoding.generate import speculative_generate
    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.serve.engine import DecodingOptions

    target = load_served_target(tiny_target_dir)
    drafter = build_drafter("dflash", target, str(tiny_draft_dir))
    app = create_app(target, drafter, max_batch_size=batch, decoding=DecodingOptions(**options))
    assert type(app.state.engine.engine).__name__ == engine
    prompts = PROMPTS[:6]
    with running_server(app) as url:
        server = Served(url, app, target)
        with ThreadPoolExecutor(len(prompts)) as pool:
            served_texts = list(pool.map(lambda p: complete(server, p)[0], prompts))
        wait_until_idle(server)
        metrics = httpx.get(f"{url}/metrics").text
    assert "blockspec_verify_width_count" in metrics and "blockspec_batch_size_count" in metrics
    if not options:  # the default: as `blockspec generate`, the adaptive width over a token tree, batched
        policies = app.state.engine.engine.width_policies.policies
        assert [key[0] for key in policies] == ["tree"]
    for prompt, text in zip(prompts, served_texts):
        ids = target.encode_prompt(prompt, use_chat_template=False)
        stream = speculative_generate(target.model, ids, None, GenerationConfig(max_new_tokens=10))
        for _ in stream:
            pass
        assert text == target.tokenizer.decode(stream.token_ids, skip_special_tokens=True), prompt


def test_the_sequential_engine_cancels_queued_and_running_rows(tiny_target_dir, tiny_draft_dir):
    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.decoding.sequential import SequentialEngine

    target = load_served_target(tiny_target_dir)
    engine = SequentialEngine(target.model, build_drafter("dflash", target, str(tiny_draft_dir)))
    config = GenerationConfig(max_new_tokens=30, tree_budget=6)
    running, queued, last = (engine.add(target.encode_prompt(p, use_chat_template=False), config)
                             for p in PROMPTS[:3])
    engine.step()
    engine.step()
    assert engine.rows == [running] and list(engine.waiting) == [queued, last]
    engine.cancel(running)
    engine.cancel(queued)
    events = list(engine.run())
    assert {event.row.id for event in events} == {last.id}
    assert running.stats.finish_reason == queued.stats.finish_reason == "cancelled"
    assert last.finished and len(last.token_ids) == 30 and not engine.has_work


def test_serve_refuses_a_tree_without_a_dflash_drafter(tiny_target_dir):
    from blockspec.errors import BlockspecError
    from blockspec.serve.engine import DecodingOptions

    with pytest.raises(BlockspecError, match="tree-budget"):
        create_app(load_served_target(tiny_target_dir), None, decoding=DecodingOptions(tree_budget=8))


def test_each_api_key_copies_only_from_its_own_answers(tiny_target_dir):
    from blockspec.serve.auth import tenant_of

    target = load_served_target(tiny_target_dir)
    drafter = build_drafter("suffix", target, None)
    app = create_app(target, drafter, max_batch_size=4, api_keys=["alice-key", "bob-key"])
    prompts = {"alice-key": [5, 6, 7, 8, 9, 10], "bob-key": [20, 21, 22, 23]}
    with running_server(app) as url:
        served = Served(url, app, target)
        for key, prompt in prompts.items():
            for _ in range(2):
                served.client(api_key=key).completions.create(model=served.model, prompt=prompt, max_tokens=12,
                                                              temperature=0)
    store = drafter.store
    assert set(store.indexes) == {tenant_of(key) for key in prompts}  # digests: no key is kept
    for key, prompt in prompts.items():
        index = store.indexes[tenant_of(key)]
        kept = [index.sequence(sequence) for sequence in range(4) if sequence in index]
        assert len(kept) == 2 and all(answer[:len(prompt)] == prompt for answer in kept)


def test_the_serve_command_decodes_in_its_main_thread_and_stops_on_sigterm(tiny_target_dir, tiny_draft_dir,
                                                                           tmp_path):
    """`blockspec serve` runs the engine in the process's main thread and uvicorn beside it: it answers with the
    greedy tokens of `generate`, says what it verifies, and SIGTERM ends it cleanly."""
    import os
    import signal
    import subprocess
    import sys

    from blockspec.decoding.generate import speculative_generate
    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.models.target import load_target
    from helpers import free_port

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    env = {**os.environ, "BLOCKSPEC_HOME": str(tmp_path / "home")}
    process = subprocess.Popen([sys.executable, "-m", "blockspec.cli", "serve", "--target", str(tiny_target_dir),
                                "--draft", str(tiny_draft_dir), "--port", str(port), "--log-level", "warning"],
                               stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        log.close()
    said = (tmp_path / "serve.log").read_text()
    assert "the adaptive width over a 16-node token tree, batches of up to 16" in said
    target = load_target(str(tiny_target_dir))
    stream = speculative_generate(target.model, target.encode_prompt(PROMPTS[0], use_chat_template=False), None,
                                  GenerationConfig(max_new_tokens=10, stop_token_ids=target.stop_token_ids()))
    list(stream)
    assert text == target.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


def test_an_emptied_batch_gives_its_freed_memory_back(served, monkeypatch):
    """glibc keeps what a burst's peak freed resident; the engine trims it whenever its batch empties."""
    trims = []
    monkeypatch.setattr(serve_engine, "return_freed_memory", lambda: trims.append(1) or True)
    wait_until_idle(served)
    complete(served, PROMPTS[0])
    wait_until_idle(served)
    assert trims


def test_freed_memory_goes_back_where_there_is_glibc():
    assert serve_engine.return_freed_memory() == (ctypes.util.find_library("c") is not None and
                                                 platform.libc_ver()[0] == "glibc")


# -- log-probabilities ----------------------------------------------------------------------------------------

def reference_logprobs(target: Target, prompt, top: int, chat: bool = True):
    """The greedy answer's log-probabilities, decoded alone without a drafter."""
    from blockspec.decoding.generate import speculative_generate
    from blockspec.decoding.sequence import GenerationConfig

    config = GenerationConfig(max_new_tokens=12, logprobs=top, stop_token_ids=tuple(target.stop_token_ids()))
    stream = speculative_generate(target.model, target.encode_prompt(prompt, use_chat_template=chat), None, config)
    list(stream)
    return stream.sequence.logprobs


def test_chat_logprobs_come_from_the_target_streamed_or_not(served):
    messages = [{"role": "user", "content": "Natalia sold clips to her friends"}]
    expected = reference_logprobs(served.target, messages, 2)
    tokenizer = served.target.tokenizer
    client = served.client()
    answer = client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert [entry.token for entry in content] == [tokenizer.decode([lp.token]) for lp in expected]
    assert [entry.logprob for entry in content] == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert [[top.token for top in entry.top_logprobs] for entry in content] == \
        [[tokenizer.decode([t]) for t, _ in lp.top] for lp in expected]
    assert content[0].bytes == list(content[0].token.encode("utf-8"))
    chunks = client.chat.completions.create(model=served.model, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [entry for chunk in chunks if chunk.choices and chunk.choices[0].logprobs
                for entry in chunk.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    plain = client.chat.completions.create(model=served.model, messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_in_the_legacy_layout(served):
    prompt = "Natalia sold clips to her friends"
    expected = reference_logprobs(served.target, prompt, 1, chat=False)
    tokenizer = served.target.tokenizer
    answer = served.client().completions.create(model=served.model, prompt=prompt, max_tokens=12, temperature=0,
                                                logprobs=1)
    logprobs = answer.choices[0].logprobs
    assert logprobs.tokens == [tokenizer.decode([lp.token]) for lp in expected]
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected], abs=1e-4)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    assert all(token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


def test_top_logprobs_without_logprobs_is_refused(served):
    response = httpx.post(f"{served.url}/v1/chat/completions", json={
        "model": served.model, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    assert assert_openai_error(response, 400)["param"] == "top_logprobs"


# -- echo and best_of -----------------------------------------------------------------------------------------

def full_forward_logprobs(target: Target, ids: list[int]):
    """log-softmax of one uncached forward over the whole text: [T, V]."""
    import torch

    with torch.inference_mode():
        return torch.log_softmax(target.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_echo_answers_the_prompt_before_the_completion(served):
    client = served.client()
    prompt = "Natalia sold clips to her friends"
    plain = client.completions.create(model=served.model, prompt=prompt, max_tokens=6, temperature=0)
    echoed = client.completions.create(model=served.model, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    ids = served.target.encode_prompt(prompt, use_chat_template=False)
    by_ids = client.completions.create(model=served.model, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == served.target.tokenizer.decode(ids) + plain.choices[0].text
    chunks = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=6, temperature=0,
                                            echo=True, stream=True))
    assert chunks[0].choices[0].text == prompt
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(served):
    """max_tokens 0, echo, logprobs: the prompt tokens' log-probabilities, the first one null."""
    tokenizer = served.target.tokenizer
    ids = served.target.encode_prompt("Natalia sold clips to 48 of her friends in April", use_chat_template=False)
    answer = served.client().completions.create(model=served.model, prompt=ids, max_tokens=0, echo=True, logprobs=2,
                                                temperature=0)
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 0
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    reference = full_forward_logprobs(served.target, ids)
    expected = [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-6)
    best = reference[:-1].topk(2, dim=-1).indices
    for i, top in enumerate(logprobs.top_logprobs[1:]):
        assert set(top) == {tokenizer.decode([t]) for t in best[i].tolist()} | {logprobs.tokens[i + 1]}
    # with a completion: the prompt's entries, then the completion's as without echo
    more = served.client().completions.create(model=served.model, prompt=ids, max_tokens=5, echo=True, logprobs=2,
                                              temperature=0).choices[0].logprobs
    alone = served.client().completions.create(model=served.model, prompt=ids, max_tokens=5, logprobs=2,
                                               temperature=0).choices[0].logprobs
    assert more.tokens == logprobs.tokens + alone.tokens
    assert more.token_logprobs[len(ids):] == pytest.approx(alone.token_logprobs, abs=1e-4)
    assert more.text_offset == [sum(len(t) for t in more.tokens[:i]) for i in range(len(more.tokens))]


def test_the_scorer_reads_a_long_text_in_chunks_as_in_one_forward(served):
    from blockspec.decoding.score import text_logprobs

    ids = served.target.encode_prompt(" ".join(["Natalia sold clips"] * 12), use_chat_template=False)
    reference = full_forward_logprobs(served.target, ids)
    scored = text_logprobs(served.target.model, ids, top=3, chunk=5)
    assert [entry.token for entry in scored] == ids and scored[0].logprob is None
    assert [entry.logprob for entry in scored[1:]] == pytest.approx(
        [reference[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-6)
    assert [[t for t, _ in entry.top] for entry in scored[1:]] == reference[:-1].topk(3, dim=-1).indices.tolist()


def test_best_of_answers_the_most_likely_of_its_candidates(served):
    client = served.client()
    prompt = "Natalia sold clips"
    options = dict(model=served.model, prompt=prompt, max_tokens=6, temperature=1.0, seed=11)
    candidates = client.completions.create(**options, n=4, logprobs=0).choices
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    ranked = [candidates[i].text for i in sorted(range(4), key=lambda i: -mean[i])]
    best = client.completions.create(**options, n=2, best_of=4)
    assert [c.text for c in best.choices] == ranked[:2]
    assert all(c.logprobs is None for c in best.choices)
    all_four = client.completions.create(**options, n=4)
    assert best.usage.completion_tokens == all_four.usage.completion_tokens  # every candidate is decoded
    greedy = dict(model=served.model, prompt=prompt, max_tokens=6, temperature=0)
    assert client.completions.create(**greedy, best_of=3).choices[0].text == \
        client.completions.create(**greedy).choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True, "temperature": 1.0}, "best_of"),
    ({"best_of": 17, "temperature": 1.0}, "best_of"),
])
def test_echo_and_best_of_values_that_cannot_be_honoured_are_a_400(served, body, param):
    response = httpx.post(f"{served.url}/v1/completions", json={"model": served.model, "prompt": "hi", **body})
    assert assert_openai_error(response, 400)["param"] == param


# -- several choices ------------------------------------------------------------------------------------------

def test_n_choices_decode_together_each_as_it_would_alone(served):
    client = served.client()
    messages = [{"role": "user", "content": "Name a colour"}]

    def ask(**options):
        return client.chat.completions.create(model=served.model, messages=messages, max_tokens=8, **options)

    greedy = ask(temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    alone = ask(temperature=0).choices[0].message.content
    assert all(c.message.content == alone for c in greedy.choices)
    sampled = ask(temperature=1.0, seed=5, n=3)
    for i, choice in enumerate(sampled.choices):
        assert choice.message.content == ask(temperature=1.0, seed=5 + i).choices[0].message.content
    one = ask(temperature=1.0, seed=5).usage
    assert sampled.usage.prompt_tokens == one.prompt_tokens  # the prompt is counted once for its n choices
    both = client.completions.create(model=served.model, prompt=["One two", "Three four"], max_tokens=6,
                                     temperature=0, n=2)
    texts = [c.text for c in both.choices]
    singles = [client.completions.create(model=served.model, prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in ("One two", "Three four")]
    assert texts == [singles[0], singles[0], singles[1], singles[1]]
    wait_until_idle(served)


# -- chunked prefill ------------------------------------------------------------------------------------------

def test_long_prompts_entering_in_chunks_answer_as_they_would_whole(tiny_target_dir, tiny_draft_dir):
    """A server prefilling 8 prompt tokens a step: concurrent requests with prompts of many chunks each get the
    answer of the same request to a server prefilling whole prompts."""
    target = load_served_target(tiny_target_dir)
    drafter = build_drafter("dflash", target, str(tiny_draft_dir))
    prompts = [" ".join(["Natalia sold clips to 48 of her friends in April"] * n) for n in (1, 4, 7, 3)]

    def answers(prefill_chunk):
        app = create_app(target, drafter, max_batch_size=4, prefill_chunk=prefill_chunk)
        with running_server(app) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            with ThreadPoolExecutor(len(prompts)) as pool:
                return list(pool.map(lambda p: client.completions.create(
                    model=target.name, prompt=p, max_tokens=10, temperature=0).choices[0].text, prompts))

    assert answers(8) == answers(None)
