"""Tool calling through the server: tools in the prompt by the chat template, calls parsed into tool_calls,
tool_choice "required" or named constrained by a grammar and equal to constrained plain decoding."""

import json

import httpx
import pytest

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.registry import build_drafter
from blockspec.serve.app import create_app
from blockspec.serve.tools import ToolCallStream, ToolUse, parse_tool_calls
from helpers import TOOL_CHAT_TEMPLATE, load_served_target, running_server

pytestmark = pytest.mark.timeout(120)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "now", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tiny_target_dir, tiny_draft_dir):
    target = load_served_target(tiny_target_dir)
    target.tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    app = create_app(target, build_drafter("dflash", target, str(tiny_draft_dir)), max_batch_size=4)
    with running_server(app) as url:
        yield url, target


def chat(url, target, **body) -> httpx.Response:
    body = {"model": target.name, "messages": MESSAGES, "max_tokens": 90, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def constrained_answer(target, tools: ToolUse, messages=MESSAGES, **sampling) -> str:
    """The answer of plain decoding of the same prompt under the same calls grammar."""
    ids = target.encode_prompt(messages, tools=tools.tools)
    config = GenerationConfig(max_new_tokens=90, grammar=tools.grammar(target.tokenizer),
                              stop_token_ids=tuple(target.stop_token_ids()), **sampling)
    stream = speculative_generate(target.model, ids, None, config)
    list(stream)
    return target.tokenizer.decode(stream.token_ids, skip_special_tokens=True)


# -- parsing ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,content,calls", [
    ("Just text.", "Just text.", []),
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>', None, [("f", {"a": 1})]),
    ('Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call>', "Let me look.", [("f", {})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {"b": "x"}}'
     '</tool_call>', None, [("f", {"a": 1}), ("g", {"b": "x"})]),
    # an answer cut before its closing tag still holds a whole call
    ('<tool_call>{"name": "f", "arguments": {"a": 1}}', None, [("f", {"a": 1})]),
    # Llama-style "parameters" for "arguments"
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", {"a": 1})]),
    # malformed calls are text, not calls
    ('<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>{"name": "f", "arguments": {"a": '
     '</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
])
def test_calls_are_parsed_from_the_hermes_format(text, content, calls):
    parsed_content, parsed = parse_tool_calls(text)
    assert parsed_content == content
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in parsed] == calls
    assert all(call["type"] == "function" and call["id"].startswith("call_") for call in parsed)
    assert len({call["id"] for call in parsed}) == len(parsed)


def test_without_parallel_calls_only_the_first_is_kept():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert [call["function"]["name"] for call in parse_tool_calls(text, parallel=False)[1]] == ["f"]


@pytest.mark.parametrize("pieces,sent,rest,names", [
    (["Hello", " there"], "Hello there", "", []),
    # a possible start of a call is held until it is clear
    (["Look: <to", "ol"], "Look: ", "<tool", []),
    (["Look: <to", "p> ok"], "Look: <top> ok", "", []),
    (["Sure. <tool_", 'call>{"name": "f", ', '"arguments": {}}</tool_call>'], "Sure. ", "", ["f"]),
    (["<tool_call>{not json", "</tool_call>"], "", "<tool_call>{not json</tool_call>", []),
])
def test_a_stream_sends_content_and_keeps_calls_whole(pieces, sent, rest, names):
    stream = ToolCallStream()
    assert "".join(stream.feed(piece) for piece in pieces) == sent
    tail, calls = stream.finish()
    assert tail == rest and [call["function"]["name"] for call in calls] == names


# -- the server ---------------------------------------------------------------------------------------

def test_tools_enter_the_prompt_through_the_chat_template(served):
    url, target = served
    with_tools = chat(url, target, tools=[WEATHER], max_tokens=2).json()
    assert with_tools["usage"]["prompt_tokens"] == len(target.encode_prompt(MESSAGES, tools=[WEATHER]))
    # tool_choice "none": the model is not offered the tools at all
    without = chat(url, target, tools=[WEATHER], tool_choice="none", max_tokens=2).json()
    assert without["usage"]["prompt_tokens"] == len(target.encode_prompt(MESSAGES))
    assert without["usage"]["prompt_tokens"] < with_tools["usage"]["prompt_tokens"]


@pytest.mark.parametrize("tool_choice,tools", [
    ({"type": "function", "function": {"name": "get_weather"}}, [CLOCK, WEATHER]),
    ("required", [WEATHER, CLOCK]),
])
def test_a_required_call_is_valid_and_equals_constrained_plain_decoding(served, tool_choice, tools):
    url, target = served
    answer = chat(url, target, tools=tools, tool_choice=tool_choice).json()["choices"][0]
    assert answer["finish_reason"] == "tool_calls", answer
    message = answer["message"]
    assert message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        arguments = json.loads(call["function"]["arguments"])
        if call["function"]["name"] == "get_weather":
            assert set(arguments) == {"city", "days"} and 1 <= arguments["days"] <= 9
        else:
            assert call["function"]["name"] == "now" and arguments == {}
    if isinstance(tool_choice, dict):
        assert [call["function"]["name"] for call in message["tool_calls"]] == ["get_weather"]
    use = ToolUse(tools, "function" if isinstance(tool_choice, dict) else "required",
                  tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None)
    expected = parse_tool_calls(constrained_answer(target, use))[1]
    assert [call["function"] for call in message["tool_calls"]] == [call["function"] for call in expected]


def test_sampled_calls_follow_the_schema(served):
    url, target = served
    for seed in range(4):
        answer = chat(url, target, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=seed,
                      parallel_tool_calls=False).json()["choices"][0]
        (call,) = answer["message"]["tool_calls"]
        assert set(json.loads(call["function"]["arguments"])) == {"city", "days"}


def test_streamed_calls_come_whole_in_the_last_delta(served):
    url, target = served
    body = {"model": target.name, "messages": MESSAGES, "max_tokens": 90, "temperature": 0, "stream": True,
            "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [event["choices"][0] for event in events]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == ""
    calls = [call for d in deltas for call in d["delta"].get("tool_calls", [])]
    assert deltas[-1]["finish_reason"] == "tool_calls" and len(calls) == 1
    whole = chat(url, target, **{k: v for k, v in body.items() if k != "stream"}).json()
    assert calls[0]["function"] == whole["choices"][0]["message"]["tool_calls"][0]["function"]
    assert calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")


def test_earlier_calls_and_their_results_enter_the_prompt(served):
    url, target = served
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    answer = chat(url, target, messages=messages, tools=[WEATHER], max_tokens=2).json()
    templated = [dict(m) for m in messages]
    templated[1] = {**templated[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Paris", "days": 1}}}]}
    assert answer["usage"]["prompt_tokens"] == len(target.encode_prompt(templated, tools=[WEATHER]))


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]}],
      "tools": [WEATHER]}, "messages[1].tool_calls[0].function.arguments"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_tool_requests_that_cannot_be_honoured_are_a_400_naming_the_field(served, body, param):
    url, target = served
    response = chat(url, target, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
