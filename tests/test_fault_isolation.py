"""One request's failure never reaches another: a row that fails is finished with an error, the others
complete with the tokens they would have had alone."""

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from blockspec.drafters.dflash import DFlashDrafter
from blockspec.models.dflash.checkpoint import load_dflash_model
from blockspec.serve.app import create_app
from blockspec.serve.engine import DecodingOptions
from helpers import load_served_target, running_server

pytestmark = pytest.mark.timeout(300)

#: Prompt tokens that make the drafter fail: in its start (the row's prefill) or in its first proposal.
FAILS_AT_PREFILL, FAILS_AT_DECODE = 301, 302


class PoisonedDrafter(DFlashDrafter):
    """A DFlash drafter that raises for prompts holding a poison token, as a bug or a bad value would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.poisoned_states = []

    def start(self, prompt_ids, features):
        state = super().start(prompt_ids, features)
        ids = prompt_ids[0].tolist()
        if FAILS_AT_PREFILL in ids:
            raise RuntimeError("poisoned at prefill")
        if FAILS_AT_DECODE in ids:
            self.poisoned_states.append(state)
        return state

    def propose(self, state, last_token, num_tokens, sampling, generator):
        if any(state is poisoned for poisoned in self.poisoned_states):
            raise RuntimeError("poisoned at decode")
        return super().propose(state, last_token, num_tokens, sampling, generator)


@pytest.fixture(scope="module")
def server(tiny_target_dir, tiny_draft_dir):
    target = load_served_target(tiny_target_dir)
    drafter = PoisonedDrafter(load_dflash_model(tiny_draft_dir), target.model)
    # a fixed width, so that every step drafts (the adaptive width may pause a drafter that does not pay)
    app = create_app(target, drafter, max_batch_size=8, max_queue=80, decoding=DecodingOptions(block_size=8))
    with running_server(app) as url:
        yield url, target.name


def prompt_ids(i: int) -> list[int]:
    """Distinct token-id prompts of a few lengths, free of the poison tokens."""
    return [10 + (i * 7 + k * 13) % 280 for k in range(3 + i % 9)]


def stream_completion(url: str, model: str, prompt: list[int], **extra) -> tuple[list[str], str | None]:
    """The text pieces of a streamed completion, and the error message if it ended with one."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True, **extra}
    pieces, error = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                error = chunk["error"]["message"]
            else:
                pieces.append(chunk["choices"][0]["text"])
    return pieces, error


def text_of(url: str, model: str, prompt: list[int]) -> str:
    pieces, error = stream_completion(url, model, prompt)
    assert error is None, error
    return "".join(pieces)


@pytest.mark.parametrize("poison", [FAILS_AT_PREFILL, FAILS_AT_DECODE], ids=["prefill", "decode"])
def test_a_failing_row_amid_concurrent_streams_fails_alone(server, poison):
    url, model = server
    prompts = [prompt_ids(i) for i in range(12)]
    alone = [text_of(url, model, p) for p in prompts]
    poisoned = [5, 6, poison, 7]
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        bad = pool.submit(stream_completion, url, model, poisoned)
        together = list(pool.map(lambda p: text_of(url, model, p), prompts))
        _, error = bad.result()
    assert error is not None and "poisoned" in error
    assert together == alone


def test_sixty_four_streams_with_one_poisoned_request(server):
    url, model = server
    prompts = [prompt_ids(i) for i in range(63)]
    alone = [text_of(url, model, p) for p in prompts]
    with ThreadPoolExecutor(64) as pool:
        futures = [pool.submit(stream_completion, url, model, p) for p in prompts[:31]]
        bad = pool.submit(stream_completion, url, model, [5, FAILS_AT_DECODE, 6])
        futures += [pool.submit(stream_completion, url, model, p) for p in prompts[31:]]
        results = [future.result() for future in futures]
    assert bad.result()[1] is not None
    assert [error for _, error in results] == [None] * 63
    assert ["".join(pieces) for pieces, _ in results] == alone
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"


def test_a_request_refused_before_it_joins_leaves_the_batch_alone(server):
    url, model = server
    prompts = [prompt_ids(i) for i in range(8)]
    alone = [text_of(url, model, p) for p in prompts]
    with ThreadPoolExecutor(9) as pool:
        together = pool.map(lambda p: text_of(url, model, p), prompts)
        refused = pool.submit(httpx.post, f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "seed": 2**70})
        assert list(together) == alone
    assert refused.result().status_code == 400
    assert refused.result().json()["error"]["param"] == "seed"
