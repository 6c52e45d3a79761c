"""Request bodies the server accepts, and errors in OpenAI's format.

The models follow OpenAI's completions and chat completions APIs closely enough for its
clients; fields blockspec does not implement (logprobs, tools, penalties...) are ignored
rather than refused, as most OpenAI-compatible servers do, except ``n`` > 1, which would
silently change the shape of the answer. Types are strict, as OpenAI's are: ``"stream":
"yes"`` or ``true`` among token ids is refused rather than read as something else, and
text must be valid Unicode (no lone surrogates, which no tokenizer can encode).
"""

from __future__ import annotations

from typing import Annotated, Literal

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
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    #: vLLM's: decode to the token limit whatever stop tokens come (load generators send it).
    ignore_eos: bool = False
    #: vLLM's: stop tokens do not end the answer before this many tokens.
    min_tokens: int = Field(0, ge=0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


class CompletionRequest(SamplingFields):
    """``prompt`` is text, a list holding one text, or token ids."""

    prompt: Text | list[Text] | list[int]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Text
    content: Text | list[TextPart] | None = None

    def as_template_message(self) -> dict:
        """The message as the chat template takes it (text parts joined)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens`` (the newer name) wins over ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
