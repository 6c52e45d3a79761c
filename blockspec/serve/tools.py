"""Tool calling: the functions a chat request offers enter the prompt through the model's chat template,
and the calls in the answer come back as OpenAI's ``tool_calls``.

Each template places tools its own way and its model answers a call in its own format. blockspec reads
the Hermes format, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, which the Qwen2.5, Qwen3
and Hermes templates define. Tools are refused for a template that takes none or names no such format.
``tool_choice: "required"`` or a named function constrains the answer, by a grammar, to calls of the
offered functions with arguments valid under their schemas. Speculation stays lossless under that
grammar as under any other.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from blockspec.decoding.grammar import Grammar
from blockspec.errors import BlockspecError
from blockspec.serve.schemas import bad_request

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALLS = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolUse:
    """The functions a request offers and what it asks of them."""

    #: As the chat template takes them: OpenAI's ``{"type": "function", "function": {...}}``.
    tools: list[dict]
    #: "auto", "required", or "function" (``function`` names the one to call).
    choice: str
    function: str | None = None
    parallel: bool = True

    def grammar(self, tokenizer) -> Grammar | None:
        """What the answer must match: calls only, with "required" or a named function (None: free text).
        The envelope of a call is written as the template shows it; only the arguments are the model's."""
        if self.choice == "auto":
            return None
        functions = [tool["function"] for tool in self.tools
                     if self.function is None or tool["function"]["name"] == self.function]
        bodies = " | ".join(f"call_{i}" for i in range(len(functions)))
        more_calls = ' ("\\n" call)*' if self.parallel else ""
        rules = [f"start: call{more_calls}", f'call: "{CALL_OPEN}\\n" ({bodies}) "\\n{CALL_CLOSE}"']
        for i, function in enumerate(functions):
            envelope = json.dumps('{"name": ' + json.dumps(function["name"]) + ', "arguments": ')
            rules += [f'call_{i}: {envelope} arguments_{i} "}}"',
                      f"arguments_{i}: %json{json.dumps(_arguments_schema(function))}"]
        try:
            return Grammar.lark(tokenizer, "\n".join(rules) + "\n")
        except BlockspecError as error:
            raise bad_request(f"the tools' parameters cannot constrain the answer: {error}", param="tools",
                              code="invalid_value") from error


def _arguments_schema(function: dict) -> dict:
    """The schema of a call's arguments: the function's parameters, written as ``json.dumps`` writes JSON (what
    Hermes-format models learnt) unless the schema asks for other whitespace."""
    schema = dict(function.get("parameters") or {"type": "object"})
    schema.setdefault("x-guidance", {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
    return schema


def tool_use(tokenizer, tools: list[dict] | None, tool_choice, parallel: bool = True) -> ToolUse | None:
    """The request's tools, checked against each other and the chat template (None: no tools, or
    ``tool_choice: "none"``, which leaves them out of the prompt)."""
    if tool_choice not in (None, "none") and not tools:
        raise bad_request("tool_choice needs tools: list the functions the model may call", param="tool_choice",
                          code="invalid_value")
    if not tools:
        return None
    functions = [_checked_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [function["name"] for function in functions]
    if len(set(names)) < len(names):
        raise bad_request("two tools share a name: give each function its own", param="tools", code="invalid_value")
    choice, function = _checked_choice(tool_choice, names)
    if choice == "none":
        return None
    _check_template(tokenizer)
    return ToolUse([{"type": "function", "function": f} for f in functions], choice, function, parallel)


def _checked_tool(tool, param: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(f"{param} must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                          param=param, code="invalid_value")
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name):
        raise bad_request(f"{param}.function.name must be 1 to 64 letters, digits, '_', '.' or '-'",
                          param=f"{param}.function.name", code="invalid_value")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise bad_request(f"{param}.function.parameters must be a JSON schema object",
                          param=f"{param}.function.parameters", code="invalid_value")
    return function


def _checked_choice(tool_choice, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(named, str):
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                          "{'name': ...}}", param="tool_choice", code="invalid_value")
    if named not in names:
        raise bad_request(f"tool_choice names '{named}', which is not among the tools ({', '.join(names)})",
                          param="tool_choice", code="invalid_value")
    return "function", named


def _check_template(tokenizer) -> None:
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    if "tools" not in template:
        raise bad_request("this model's chat template has no place for tools: leave tools out, or serve a model "
                          "whose template takes them", param="tools", code="unsupported_value")
    if CALL_OPEN not in template:
        raise bad_request(f"this model's chat template takes tools but not in the {CALL_OPEN} format blockspec "
                          "reads calls in: leave tools out", param="tools", code="unsupported_value")


def template_message_calls(calls: list[dict], param: str) -> list[dict]:
    """An assistant message's earlier calls as templates take them: arguments as an object, not JSON text."""
    out = []
    for i, call in enumerate(calls):
        arguments = call["function"]["arguments"]
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request(f"{param}[{i}].function.arguments must be a JSON object as text",
                              param=f"{param}[{i}].function.arguments", code="invalid_value")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": parsed}})
    return out


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str | None, list[dict]]:
    """The answer's content before its first call, and its calls in OpenAI's layout. Text that does not
    hold well-formed calls is all content, with no calls."""
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for body in _CALLS.findall(text, start):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        arguments = call.get("arguments", call.get("parameters", {})) if isinstance(call, dict) else None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
            return text, []
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(arguments)}})
    content = text[:start].strip()
    return content or None, calls[:1] if not parallel else calls


class ToolCallStream:
    """Streamed content up to the first call; what may begin a call is held back, and a call is kept whole
    until the answer ends (then ``finish`` gives the calls, or the held text when it holds none)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.sent = ""
        self.pending = ""
        self.in_call = False

    def feed(self, text: str) -> str:
        """The content safe to send now."""
        self.pending += text
        if self.in_call:
            return ""
        start = self.pending.find(CALL_OPEN)
        if start >= 0:
            self.in_call = True
            return self._send(start)
        hold = next((size for size in range(min(len(self.pending), len(CALL_OPEN) - 1), 0, -1)
                     if CALL_OPEN.startswith(self.pending[-size:])), 0)
        return self._send(len(self.pending) - hold)

    def finish(self) -> tuple[str, list[dict]]:
        """The content still to send and the answer's calls."""
        _, calls = parse_tool_calls(self.sent + self.pending, self.parallel)
        return ("", calls) if calls else (self.pending, [])

    def _send(self, cut: int) -> str:
        out, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += out
        return out
