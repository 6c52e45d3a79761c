"""Property-based fuzzing of the HTTP API and the command line: whatever arrives, the answer is a 4xx
with an OpenAI-style error body or a well-formed success, never a 5xx, a traceback or a hang; a
command line ends in a one-line error or its work.

The suite runs a bounded number of examples; BLOCKSPEC_FUZZ_REQUESTS and BLOCKSPEC_FUZZ_COMMANDS
raise them (`make fuzz` runs 2000 requests and 500 command lines).
"""

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from blockspec.drafters.registry import build_drafter
from blockspec.serve.app import create_app
from helpers import load_served_target, running_server

REQUESTS = int(os.environ.get("BLOCKSPEC_FUZZ_REQUESTS", "300"))
COMMANDS = int(os.environ.get("BLOCKSPEC_FUZZ_COMMANDS", "60"))
API_KEY = "fuzz-key"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(max(600, REQUESTS + 6 * COMMANDS))]


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, derandomize=True, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])


# -- values ----------------------------------------------------------------------------------------------------

TEXTS = st.one_of(
    st.text(max_size=24),
    st.sampled_from(["", " ", "hi \ud800 there", "\udfff", "\x00", "<|im_end|>", "<pad>", "a" * 2000, "é漢🙂",
                     "</s>", "{{ raise_exception('x') }}"]),
)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, -1, 0.5, 1e-300, 1e-40, 1e-5, 2.0000001, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]),
)
JUNK = st.recursive(st.none() | st.booleans() | NUMBERS | TEXTS,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXTS, inner, max_size=3),
                    max_leaves=6)
SMALL_TOKEN_COUNTS = st.one_of(st.integers(min_value=1, max_value=8), st.sampled_from([0, -1, 600, 10**9, None]))


def message(model_text):
    role = st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), TEXTS, JUNK)
    content = st.one_of(model_text, st.none(), st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                               "text": model_text}), max_size=2), JUNK)
    return st.fixed_dictionaries({}, optional={"role": role, "content": content, "name": TEXTS})


def fields(model: str) -> dict:
    """For each request field: the values a fuzzed request may carry (valid ones among the hostile)."""
    return {
        "model": st.one_of(st.just(model), JUNK),
        "prompt": st.one_of(TEXTS, st.lists(TEXTS, max_size=2), st.lists(st.integers(-3, 330), max_size=40), JUNK),
        "messages": st.one_of(st.lists(message(TEXTS), max_size=3), JUNK),
        "max_tokens": st.one_of(SMALL_TOKEN_COUNTS, JUNK),
        "max_completion_tokens": SMALL_TOKEN_COUNTS,
        "temperature": st.one_of(st.floats(0, 2), NUMBERS, JUNK),
        "top_p": st.one_of(st.floats(0, 1), NUMBERS),
        "top_k": st.one_of(st.integers(0, 400), NUMBERS),
        "seed": st.one_of(st.integers(-(2**64), 2**65), JUNK),
        "stop": st.one_of(TEXTS, st.lists(TEXTS, max_size=3), JUNK),
        "n": st.one_of(st.integers(-2, 3), JUNK),
        "stream": st.one_of(st.booleans(), JUNK),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), JUNK),
        "ignore_eos": st.one_of(st.booleans(), JUNK),
        "min_tokens": st.one_of(st.integers(-1, 10), JUNK),
        "logprobs": JUNK,
        "tools": JUNK,
    }


@st.composite
def requests(draw, model: str):
    """(method, path, headers, body bytes): mostly well-aimed requests with a few hostile fields, some junk."""
    endpoint = draw(st.sampled_from(["completions", "chat/completions"] * 4 + ["models", "models/X", "nothing"]))
    path = f"/v1/{endpoint}".replace("X", draw(st.sampled_from([model, "other", "%ED%A0%80", "%FF", "a/b"])))
    if draw(st.integers(0, 19)) == 0:
        path = draw(st.sampled_from(["/health", "/metrics", "/", "/v1", "/v2/x", "/v1/models/../health"]))
    method = "POST" if endpoint not in ("models", "models/X") else "GET"
    if draw(st.integers(0, 19)) == 0:
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST"]))
    headers = {"content-type": "application/json", "authorization": f"Bearer {API_KEY}"}
    if draw(st.integers(0, 9)) == 0:  # a wrong, missing or misspelt key now and then
        key = draw(st.sampled_from(["wrong", "", API_KEY.upper(), API_KEY + "x", None]))
        scheme = draw(st.sampled_from(["Bearer ", "bearer ", "Basic ", "Bearer  ", ""]))
        headers.pop("authorization")
        if key is not None:
            headers["authorization"] = (scheme + key).strip()  # a header value cannot end in a space
    if draw(st.integers(0, 9)) == 0:
        return method, path, headers, draw(raw_bodies())
    base = {"model": model, "max_tokens": 4, "temperature": 0}
    base.update({"prompt": "The quick brown"} if endpoint == "completions" else
                {"messages": [{"role": "user", "content": "What is 12 times 7?"}]})
    choices = fields(model)
    for name in draw(st.lists(st.sampled_from(sorted(choices)), max_size=4, unique=True)):
        value = draw(choices[name])
        if value is None and draw(st.booleans()):
            base.pop(name, None)
        else:
            base[name] = value
    if draw(st.integers(0, 14)) == 0:
        base[draw(TEXTS)] = draw(JUNK)
    return method, path, headers, json.dumps(base, allow_nan=True).encode()


def raw_bodies():
    return st.one_of(
        st.binary(max_size=64),
        st.sampled_from([b"", b"{", b"[1,2]", b"null", b"\"text\"", b"{\"model\": NaN}", b"[" * 50_000,
                         b"{\"a\":" * 20_000 + b"1" + b"}" * 20_000, b"\xff\xfe{}", "{\"model\": \"\u00e9\"}".encode(),
                         b"{\"prompt\": \"\\ud800\"}", b"{\"messages\": [{\"role\": \"user\"}]}"]),
    )


# -- the HTTP API ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzzed_server(tiny_target_dir, tiny_draft_dir):
    target = load_served_target(tiny_target_dir)
    app = create_app(target, build_drafter("dflash", target, str(tiny_draft_dir)), max_batch_size=4, api_keys=API_KEY)
    with running_server(app) as url:
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client, target.name


def check_answer(response: httpx.Response, method: str, path: str) -> None:
    status = response.status_code
    assert status < 500, f"{method} {path} -> {status}: {response.text[:300]}"
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        for line in lines[:-1]:
            chunk = json.loads(line.removeprefix("data: "))
            assert "error" not in chunk, chunk
        return
    if path.startswith("/v1/") and method == "POST":
        body = response.json()
        assert body["choices"] and body["usage"]["completion_tokens"] >= 0


def test_fuzzed_requests_get_a_4xx_or_a_well_formed_answer(fuzzed_server):
    client, model = fuzzed_server
    sent = []

    @fuzz_settings(REQUESTS)
    @given(request=requests(model))
    def send(request):
        method, path, headers, body = request
        sent.append(path)
        check_answer(client.request(method, path, headers=headers, content=body), method, path)

    send()
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["in_flight"] == 0 and health["active_rows"] == 0
    metrics = client.get("/metrics").text
    assert not [line for line in metrics.splitlines() if 'status="5' in line]
    assert len(sent) >= min(REQUESTS, 100)


# -- the command line --------------------------------------------------------------------------------------------

#: Values for any option: out of range, not numbers, not text, paths that cannot be written, names of nothing.
HOSTILE = ["", " ", "abc", "\udcff\udcfe", "/proc/blockspec", "/sys/blockspec", "/nonexistent/dir", "auto", "on",
           "off", "cpu", "cuda", "meta", "bfloat16", "float64", "1,2", "-5,3", "t32", "dflash@t9999", "foo", "llada"]
INTS = ["0", "1", "2", "3", "-1", "8", "64", "255", "256", str(2**31), str(2**63), str(2**64), str(2**70),
        "-" + str(2**70)]
FLOATS = ["0", "0.5", "0.9", "1", "2", "-1", "nan", "inf", "-inf", "1e-300", "1e-5", "1e309"]
#: Options whose valid values set how long a command runs: only small or invalid values for them.
BOUNDED = {"--max-steps": ["-1", "0", "1", "2", "nan", "abc", "1e309"],
           "--steps": ["-1", "0", "1", "2", "4", "nan"], "--epochs": ["-1", "0", "0.01", "nan", "inf"],
           "--gen-length": ["-1", "0", "4", "8", str(10**9), "nan"],
           "--max-new-tokens": ["-1", "0", "1", "4", str(10**9), "abc"],
           "--requests": ["-1", "0", "1", "2", "abc"], "--concurrency": ["-1", "0", "1", "3"],
           "--timeout": ["-1", "0", "nan", "inf", "0.5", "abc"], "--num-prompts": ["-1", "0", "1", "4", "nan"],
           "--save-every": ["-1", "0", "1", "nan"], "--eval-every": ["-1", "0", "1"], "--ttt-steps": ["0", "1"],
           "--anchors-per-sequence": ["0", "1", "4"], "--max-length": ["-1", "0", "1", "8", "64"],
           "--batch-size": ["-1", "0", "1", "2"], "--generation-batch-size": ["-1", "0", "1", "8"],
           "--draft-vocab-size": ["-1", "0", "1", "16"], "--grad-accum": ["-1", "0", "1", "2"],
           "--tree-budget": ["-1", "0", "1", "8", "255", "256", str(10**6)], "--num-layers": ["-1", "0", "1", "2"],
           "--intermediate-size": ["-1", "0", "1", "8", "abc"], "--max-batch-size": ["-1", "0", "1", "4"],
           "--max-queue": ["-1", "0", "1", "4"], "--denoise-steps": ["-1", "0", "1", "2", "99"]}
#: Models and drafters: local paths only (a name that is not one would be looked up on the hub, offline here).
PATHS = ["/nonexistent/dir", "./no-such-model", "/proc/blockspec", "/sys/blockspec", "", " ", "/"]
PATH_OPTIONS = ("--target", "--draft", "--model", "--init", "--assistant", "--ar-target", "--data", "--out")
#: Options never fuzzed: they read standard input, reach the network or run code from a checkpoint.
SKIPPED = {"--help", "--url", "--host", "--trust-remote-code", "--init-from", "--data-dir", "--source"}


def command_parser(command: list[str]):
    from blockspec.cli import build_parser

    parser = build_parser()
    for word in command:
        parser = next(action for action in parser._actions if action.choices and word in action.choices).choices[word]
    return parser


def option_actions(command: list[str]) -> dict:
    """The command's --options and their argparse actions."""
    return {option: action for action in command_parser(command)._actions for option in action.option_strings
            if option.startswith("--") and option not in SKIPPED}


def option_values(option: str, action) -> list[str] | None:
    """Values of an option's type for it (None: a flag)."""
    if action.nargs == 0:
        return None
    if option in BOUNDED:
        return BOUNDED[option]
    if option in PATH_OPTIONS:
        return PATHS
    if action.choices:
        return [str(choice) for choice in action.choices]
    return {int: INTS, float: FLOATS}.get(action.type, INTS + FLOATS)


@st.composite
def command_lines(draw, base: dict[str, list[str]], prompt_commands: set[str]):
    name = draw(st.sampled_from(sorted(base)))
    command = name.split()
    argv = list(base[name])
    actions = option_actions(command)
    for option in draw(st.lists(st.sampled_from(sorted(actions)), max_size=3, unique=True)) if actions else []:
        values = option_values(option, actions[option])
        if values is None:
            argv.append(option)
        elif draw(st.integers(0, 19)) == 0:
            argv.append(option)  # its value left out
        else:
            hostile = draw(st.integers(0, 7)) == 0 and option not in PATH_OPTIONS
            argv += [option, draw(st.sampled_from(HOSTILE if hostile else values))]
    if name.strip() in prompt_commands:
        argv.append(draw(st.sampled_from(["hi", "What is 12 times 7?", "", "   ", "\udcff hi", "a " * 300, "-x"])))
    return command + argv


def test_fuzzed_command_lines_end_in_one_line_of_error_or_their_work(tiny_target_dir, tiny_draft_dir, tmp_path,
                                                                      capfd, monkeypatch):
    from blockspec.cli import main
    from blockspec.cli import serve as serve_command

    # serve checks everything, then returns instead of serving
    monkeypatch.setattr(serve_command, "serve_from_main_thread", lambda app, config: 0)
    monkeypatch.chdir(tmp_path)  # a number or a name given to a path option is a relative directory
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "response": f"{i} {i}"}) + "\n" for i in range(6)))
    target = str(tiny_target_dir)
    base = {
        "generate": ["--target", target, "--compile", "off", "--max-new-tokens", "6"],
        "generate ": ["--target", target, "--draft", str(tiny_draft_dir), "--compile", "off", "--max-new-tokens", "6"],
        "dllm generate": ["--model", target, "--mask-token-id", "3", "--gen-length", "8"],
        "serve": ["--target", target, "--compile", "off", "--method", "ar"],
        "loadtest": ["--url", "http://127.0.0.1:9", "--requests", "1", "--timeout", "5"],
        "models": ["list"],
        "train-draft": ["--target", target, "--data", str(data), "--max-steps", "1", "--max-new-tokens", "4",
                        "--held-out", "1", "--num-layers", "1", "--block-size", "4", "--batch-size", "2"],
        "dllm train": ["--init", target, "--data", str(data), "--steps", "1", "--batch-size", "2",
                       "--max-length", "64", "--save-every", "0"],
    }
    runs = iter(range(10**9))

    @fuzz_settings(COMMANDS)
    @given(argv=command_lines(base, {"generate", "dllm generate"}))
    def run(argv):
        if (argv[0] == "train-draft" or argv[:2] == ["dllm", "train"]) and "--out" not in argv:
            argv += ["--out", str(tmp_path / f"out-{next(runs)}")]
        capfd.readouterr()
        try:
            code = main(argv)
        except SystemExit as exit:  # argparse: usage and one line of error, code 2
            code = exit.code
            assert code in (0, 2), argv
        out, err = capfd.readouterr()
        assert "Traceback" not in err, (argv, err[-2000:])
        assert code in (0, 1, 2), (argv, code, err[-500:])
        if code == 1 and argv[0] == "loadtest":
            assert "errors" in out  # a run whose requests failed: its report, and exit code 1
        elif code:
            last = [line for line in err.splitlines() if line.strip()][-1]
            assert last.startswith(("blockspec: error: ", "blockspec ")) and ": error: " in last, (argv, err)

    run()
