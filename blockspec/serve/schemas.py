"""Request bodies the server accepts, and errors in OpenAI's format.

The models follow OpenAI's completions and chat completions APIs closely enough for its
clients. Every OpenAI (and vLLM) parameter is typed and range-checked. The penalties, ``logit_bias``,
``min_p``, ``bad_words``, structured output (``response_format``, ``guided_*``), tools, ``echo``, ``best_of``
and log-probabilities are honoured; one blockspec does not implement (``suffix``, the deprecated ``functions``)
is accepted only at its neutral value and refused by name otherwise
(``NOT_IMPLEMENTED``): a request is never answered as if it had been honoured. Types are strict,
as OpenAI's are: ``"stream": "yes"`` or ``true`` among token ids is refused rather than read as
something else, and text must be valid Unicode (no lone surrogates, which no tokenizer can encode).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

#: The seeds a torch generator takes (its 64-bit state, signed or not).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"the text holds a lone surrogate ({text[error.start]!a} at character {error.start}): "
                         "send valid Unicode") from None
    return text


#: Any text of a request.
Text = Annotated[str, AfterValidator(_valid_unicode)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class SamplingFields(BaseModel):
    """What both endpoints share. Defaults are OpenAI's (temperature 1); 0 is greedy."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: Text
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    #: Not OpenAI's, but common in compatible servers; 0 keeps every token.
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: Text | list[Text] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    #: vLLM's: decode to the token limit whatever stop tokens come (load generators send it).
    ignore_eos: bool = False
    #: vLLM's: stop tokens do not end the answer before this many tokens.
    min_tokens: int = Field(0, ge=0)
    #: vLLM's: token ids that end the answer (as the model's own stop tokens do).
    stop_token_ids: list[int] | None = None
    # Logit adjustments, applied to the target's scores at every verified position (``decoding.adjust``).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    #: OpenAI's: {token id (as a string): bias in [-100, 100]}.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    #: vLLM's: words never generated (each with and without a leading space).
    bad_words: list[Text] | None = None
    # Structured output: at most one of them constrains the answer (``decoding.grammar``).
    #: OpenAI's: {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}.
    response_format: dict[str, Any] | None = None
    #: vLLM's: a JSON schema, a regex, a list of choices, a Lark or GBNF grammar.
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    def logprobs_asked(self) -> int | None:
        return None

    def not_implemented(self) -> str | None:
        """The first parameter given a value this server would have to ignore (None: none)."""
        for name, neutral in NOT_IMPLEMENTED.items():
            value = getattr(self, name, None)
            if value is not None and not neutral(value):
                return name
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(SamplingFields):
    """``prompt`` is text, token ids, or several prompts: a list of texts or of token-id lists (one choice each)."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    #: 0 only with ``echo``: the prompt scored, nothing generated.
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    #: Completions decoded per prompt, of which the ``n`` most likely are answered.
    best_of: int | None = Field(None, ge=1)
    # Not implemented: only its neutral value is accepted (``not_implemented``).
    suffix: Text | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def logprobs_asked(self) -> int | None:
        """How many top tokens each position's log-probabilities list (None: no log-probabilities)."""
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: Text
    #: JSON text, as OpenAI sends it.
    arguments: Text


class ToolCall(BaseModel):
    """A call an earlier assistant message made."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Text
    content: Text | list[TextPart] | None = None
    #: An assistant message's calls, and a tool message's answer to one of them.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None
    name: Text | None = None

    def as_template_message(self) -> dict:
        """The message as the chat template takes it (text parts joined; calls and call ids where given)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: Text | dict[str, Any] | None = None

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_asked(self) -> int | None:
        """How many top tokens each position's log-probabilities list (None: no log-probabilities)."""
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return (self.top_logprobs or 0) if self.logprobs else None


#: Parameters blockspec does not implement, each with the test of its neutral value (what the request
#: means without it); any other value is refused with a 400 naming the parameter.
NOT_IMPLEMENTED = {
    "suffix": lambda v: v == "",
    "functions": lambda v: not v,
    "function_call": lambda v: v == "none",
}
