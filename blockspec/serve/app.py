"""The OpenAI-compatible HTTP server: completions, chat completions, models, health, metrics.

``create_app`` wires one loaded target (and optional drafter) to one ``ServingEngine``;
the engine thread starts and stops with the app's lifespan.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.decoding.adjust import bad_words_ids
from blockspec.decoding.grammar import Grammar
from blockspec.decoding.sequence import GenerationConfig, TokenLogprob, check_tree_drafter, resolve_block_size
from blockspec.errors import BlockspecError
from blockspec.models.target import Target
from blockspec.serve.auth import APIKeyGuard, api_key_list
from blockspec.serve.engine import DEFAULT_MAX_BATCH_SIZE, DEFAULT_PREFILL_CHUNK, DecodingOptions, ServingEngine
from blockspec.serve.generation import Generation, PreparedRequest
from blockspec.serve.limits import MAX_REQUEST_BYTES, BodySizeLimit, check_verify_size, usable_sampling
from blockspec.serve.metrics import RequestCounter, ServerMetrics
from blockspec.serve.schemas import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, bad_request
from blockspec.serve.tools import ToolCallStream, ToolUse, parse_tool_calls, template_message_calls, tool_use

log = logging.getLogger("blockspec.serve")

#: Completion length when a chat request gives none and the model states no context.
_DEFAULT_CHAT_TOKENS = 4096


def create_app(target: Target, drafter=None, *, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, max_queue: int = 64,
               api_keys: str | Sequence[str] | None = None, decoding: DecodingOptions | None = None,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK, kv_budget: int | None = None) -> FastAPI:
    """An app serving ``target`` under its name; ``api_keys`` (one or several) turn on Bearer
    authentication of /v1. Each key is a tenant of its own: a drafter that copies earlier answers
    (suffix) copies only from answers given under the same key.

    ``decoding`` sets the verify width and token tree of every request (naming neither: what ``blockspec
    generate`` uses, for a one-pass drafter the adaptive width over a token tree, chosen per step for the
    whole batch); with a batch of one, requests are decoded one at a time through the ``generate`` loop.
    A request body over ``max_request_bytes`` is answered 413 without being read further. A step of the batch
    prefills at most ``prefill_chunk`` prompt tokens (None: new prompts whole). The batch's KV cache takes at most
    ``kv_budget`` token slots (rows x columns; None: no bound): a request waits until the rows decoding leave it
    room for its prompt and longest answer, and one that the budget could not hold alone is a 400.
    """
    if max_queue < 1:
        raise BlockspecError(f"max_queue must be >= 1, got {max_queue}")
    if max_request_bytes < 1:
        raise BlockspecError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    api_keys = api_key_list(api_keys)
    decoding = (decoding or DecodingOptions()).for_drafter(drafter)
    check_decoding(target.model, drafter, decoding)
    metrics = ServerMetrics()
    engine = ServingEngine(target.model, drafter, max_batch_size=max_batch_size, max_queue=max_queue,
                           metrics=metrics, per_sequence=one_at_a_time(max_batch_size),
                           compile=decoding.compile, prefill_chunk=prefill_chunk, kv_budget=kv_budget)
    metrics.kv_budget.set(kv_budget or 0)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(engine.stop)

    app = FastAPI(title="blockspec", lifespan=lifespan)
    app.state.engine = engine
    app.state.target = target
    app.state.created = int(time.time())
    # The last added runs first: every answer is counted, a key is checked before the body is read,
    # a body too large is refused while it arrives, and an unexpected error still answers in OpenAI's format.
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_keys:
        app.add_middleware(APIKeyGuard, api_keys=api_keys)
    app.add_middleware(RequestCounter, metrics=metrics)
    _add_error_handlers(app)
    _add_routes(app, target, engine, metrics, decoding)
    return app


def one_at_a_time(max_batch_size: int) -> bool:
    """Whether requests go through the ``generate`` loop one after another: with no batch to share, the
    loop's compiled graphs serve best."""
    return max_batch_size == 1


def check_decoding(model, drafter, decoding: DecodingOptions) -> None:
    """Refuse options no request could use, at start-up rather than on every request."""
    config = GenerationConfig(**decoding.config_fields())
    resolve_block_size(drafter, config.block_size)
    check_tree_drafter(drafter, config.tree_budget)
    check_verify_size(model, drafter, config)


# -- errors -------------------------------------------------------------------------------------

def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        return validation_error(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        if error.status_code == 400:  # FastAPI's only own 400: a body that does not parse
            return bad_request("the request body could not be read as JSON: send a UTF-8 JSON object",
                               code="invalid_json").response()
        code = {404: "not_found", 413: "request_too_large"}.get(error.status_code)
        return APIError(error.status_code, str(error.detail), code=code).response()


#: What a field with several accepted forms takes, for the error when a value has none of them.
_FORMS = {"prompt": "a string, a list of token ids, or several prompts: a list of strings or of token-id lists",
          "content": "a string or a list of text parts ({'type': 'text', 'text': ...})",
          "stop": "a string or a list of strings"}


def validation_error(errors) -> APIError:
    """FastAPI's validation errors as one OpenAI-style 400 naming the first bad field by its path."""
    errors = list(errors) or [{"type": "", "loc": (), "msg": "invalid request"}]
    # A value our own validators refused says more than the union branches it did not match.
    first = next((error for error in errors if error.get("type") == "value_error"), errors[0])
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return bad_request(f"the request body is not valid JSON: {detail}", code="invalid_json")
    loc = list(first.get("loc", ()))[1:] if first.get("loc", ())[:1] == ("body",) else list(first.get("loc", ()))
    path = [part for part in loc if not _is_union_branch(part)]
    if not path:
        if first.get("type") == "missing":
            return bad_request("the request body is empty: send a JSON object with 'model' and 'messages' "
                               "(chat) or 'prompt' (completions)", code="missing_body")
        return bad_request(f"the request body must be a JSON object: {first['msg']}", code="invalid_value")
    param = _param_path(path)
    if first.get("type") == "missing":
        return bad_request(f"'{param}' is a required field", param=param, code="missing_required_field")
    field = next((part for part in reversed(path) if isinstance(part, str)), "")
    detail = first["msg"].removeprefix("Value error, ")
    if first.get("type") != "value_error" and len(path) < len(loc) and field in _FORMS:
        detail = f"expected {_FORMS[field]}"
    return bad_request(f"invalid value for '{param}': {detail}", param=param, code="invalid_value")


def _is_union_branch(part) -> bool:
    """A union field reports each branch it tried as a location step (prompt.str, prompt.list[int])."""
    return isinstance(part, str) and (not part.isidentifier() or part[:1].isupper()
                                      or part in ("str", "int", "float", "bool", "list", "dict", "none"))


def _param_path(path: list) -> str:
    """messages[0].role, as OpenAI names a nested parameter."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


class UnexpectedErrors:
    """ASGI middleware answering an unexpected exception with an OpenAI-style 500 (and logging it),
    inside the request counter, so that the answer is counted like any other."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                error = APIError(500, "the server failed to answer this request: see its log", type="server_error",
                                 code="internal_error")
                await error.response()(scope, receive, send)


# -- routes -------------------------------------------------------------------------------------

def _add_routes(app: FastAPI, target: Target, engine: ServingEngine, metrics: ServerMetrics,
                decoding: DecodingOptions) -> None:
    @app.get("/health")
    async def health():
        body = {"status": "ok" if engine.alive else "engine stopped", "in_flight": engine.in_flight,
                "active_rows": len(engine.engine.rows), "waiting": len(engine.engine.waiting)}
        return JSONResponse(body, status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card(app, target)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        _check_model(target, model_id)
        return _model_card(app, target)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        candidates = _best_of(body)
        prepared = []
        for prompt, ids in _completion_prompts(target, body):
            one = _prepare(target, body, "/v1/completions", ids, decoding, _tenant(request))
            if body.echo:
                one = await _echoed(engine, target, body, prompt, one)
            prepared += _choices(_ranked(one, candidates, body), candidates)
        if len(prepared) == 1:
            generation = Generation(engine, target.tokenizer, prepared[0]).start()
            return await _respond(generation, body, request, TextCompletion(target))
        return await _collect_choices(_start_all(engine, target, prepared), TextCompletion(target), request,
                                      body.n, candidates)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        _check_model(target, body.model)
        tools = tool_use(target.tokenizer, body.tools, body.tool_choice, body.parallel_tool_calls)
        grammar = tools.grammar(target.tokenizer) if tools is not None else None
        prepared = _choices(_prepare(target, body, "/v1/chat/completions", _chat_prompt_ids(target, body, tools),
                                     decoding, _tenant(request), grammar), body.n)
        if len(prepared) == 1:
            generation = Generation(engine, target.tokenizer, prepared[0]).start()
            return await _respond(generation, body, request, ChatCompletion(target, tools))
        return await _collect_choices(_start_all(engine, target, prepared), ChatCompletion(target, tools), request,
                                      body.n, body.n)


def _model_card(app: FastAPI, target: Target) -> dict:
    return {"id": target.name, "object": "model", "created": app.state.created, "owned_by": "blockspec"}


def _check_model(target: Target, model: str) -> None:
    if model != target.name:
        raise APIError(404, f"the model '{model}' does not exist: this server serves '{target.name}'",
                       param="model", code="model_not_found")


# -- turning a request into engine input ------------------------------------------------------

def _completion_prompts(target: Target, body: CompletionRequest) -> list[tuple[str | list[int], list[int]]]:
    """Each prompt as given, and its ids: plain text (no chat template), as OpenAI's completions endpoint takes
    it, or token ids; a list of texts or of token-id lists is several prompts, each answered as its own choice."""
    _check_model(target, body.model)
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(t, int) for t in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if len(prompts) > 1 and body.stream:
        raise bad_request(f"{len(prompts)} prompts are answered in one body: send stream false, or one request "
                          "per prompt to stream each", param="prompt", code="unsupported_value")
    return [(one, _prompt_ids(target, one, f"prompt[{i}]" if len(prompts) > 1 else "prompt"))
            for i, one in enumerate(prompts)]


def _prompt_ids(target: Target, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str):
        return _encode(target, prompt, use_chat_template=False, param=param)
    if not prompt:
        raise bad_request("the prompt is empty: give some text or token ids", param=param)
    vocab = target.model.config.vocab_size
    if any(t < 0 or t >= vocab for t in prompt):
        raise bad_request(f"prompt token ids must lie in [0, {vocab})", param=param)
    return list(prompt)


def _chat_prompt_ids(target: Target, body: ChatCompletionRequest, tools: ToolUse | None) -> list[int]:
    messages = [message.as_template_message() for message in body.messages]
    for i, message in enumerate(messages):
        if "tool_calls" in message:
            message["tool_calls"] = template_message_calls(message["tool_calls"], f"messages[{i}].tool_calls")
    return _encode(target, messages, use_chat_template=True, param="messages",
                   tools=tools.tools if tools is not None else None)


def _encode(target: Target, prompt, *, use_chat_template: bool, param: str, tools: list[dict] | None = None):
    try:
        return target.encode_prompt(prompt, use_chat_template, tools)
    except BlockspecError as error:
        raise bad_request(str(error), param=param) from error
    except TemplateError as error:  # e.g. a template that insists on alternating roles
        raise bad_request(f"the model's chat template refused these messages: {error}", param=param) from error


def _tenant(request: Request) -> str | None:
    """The API key's tenant the guard set (None when the server has no keys)."""
    return getattr(request.state, "tenant", None)


def _prepare(target: Target, body: SamplingFields, endpoint: str, prompt_ids: list[int],
             decoding: DecodingOptions, tenant: str | None = None, tool_grammar: Grammar | None = None
             ) -> PreparedRequest:
    """The request as the engine runs it, every value checked before it joins the batch (``tool_grammar``:
    the calls the request's ``tool_choice`` requires)."""
    if body.n > 1 and body.stream:
        raise bad_request(f"n={body.n} choices are answered in one body: send stream false, or n requests to "
                          "stream each", param="n", code="unsupported_value")
    unsupported = body.not_implemented()
    if unsupported is not None:
        raise bad_request(f"'{unsupported}' is not supported by this server: leave it out (or send its neutral "
                          "value) rather than have it ignored", param=unsupported, code="unsupported_parameter")
    max_new_tokens = _token_limit(target, body, len(prompt_ids))
    echo_only = max_new_tokens == 0
    if echo_only and not getattr(body, "echo", False):
        raise bad_request("max_tokens 0 generates nothing: ask for at least 1 token, or send echo true to score "
                          "the prompt alone", param="max_tokens", code="invalid_value")
    if body.min_tokens > max_new_tokens:
        raise bad_request(f"min_tokens {body.min_tokens} is more than the {max_new_tokens} tokens this request may "
                          "generate: lower it or raise max_tokens", param="min_tokens", code="invalid_value")
    stop_ids = (() if body.ignore_eos else tuple(target.stop_token_ids())) + _stop_token_ids(target, body)
    temperature, top_p, top_k = usable_sampling(body.temperature, body.top_p, body.top_k)
    try:
        # With min_tokens the rows decode past stop tokens; the request itself ends at the first one after.
        config = GenerationConfig(max_new_tokens=max(max_new_tokens, 1), temperature=temperature, top_p=top_p,
                                  top_k=top_k, seed=body.seed, stop_token_ids=() if body.min_tokens else stop_ids,
                                  logprobs=body.logprobs_asked(),
                                  grammar=_grammar(target, body, tool_grammar), **_adjustments(target, body),
                                  **decoding.config_fields())
    except BlockspecError as error:  # sampling values GenerationConfig refuses
        raise bad_request(str(error), code="invalid_value") from error
    return PreparedRequest(endpoint, prompt_ids, config, body.stop_strings(), min_tokens=body.min_tokens,
                           stop_token_ids=stop_ids, namespace=tenant, decodes=not echo_only)


def _adjustments(target: Target, body: SamplingFields) -> dict:
    """The request's logit adjustments as ``GenerationConfig`` fields, token ids checked against the vocabulary."""
    vocab = target.model.config.get_text_config(decoder=True).vocab_size
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().isdigit() or int(key) >= vocab:
            raise bad_request(f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", param="logit_bias",
                              code="invalid_value")
        bias[int(key)] = value
    return {"presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
            "repetition_penalty": body.repetition_penalty, "min_p": body.min_p, "logit_bias": bias,
            "bad_words_ids": _bad_words_ids(target.tokenizer, body.bad_words or [])}


#: The request fields that constrain the answer to a grammar (one at a time).
STRUCTURED_OUTPUT = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _grammar(target: Target, body: SamplingFields, tool_grammar: Grammar | None = None) -> Grammar | None:
    """The grammar the answer must follow: OpenAI's ``response_format``, one of vLLM's ``guided_*``, or the
    calls ``tool_choice`` requires (None: free text)."""
    given = [name for name in STRUCTURED_OUTPUT if _asks_for_structure(name, getattr(body, name))]
    given = (["tool_choice"] if tool_grammar is not None else []) + given
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} both constrain the answer: send one of them", param=given[1],
                          code="invalid_value")
    if tool_grammar is not None:
        return tool_grammar
    if not given:
        return None
    name, value, tokenizer = given[0], getattr(body, given[0]), target.tokenizer
    try:
        if name == "response_format":
            return Grammar.json_schema(tokenizer, _response_schema(value))
        if name == "guided_json":
            return Grammar.json_schema(tokenizer, value)
        if name == "guided_regex":
            return Grammar.regex(tokenizer, value)
        if name == "guided_choice":
            return Grammar.choice(tokenizer, value)
        return Grammar.lark(tokenizer, value)
    except BlockspecError as error:
        raise bad_request(f"{name}: {error}", param=name, code="invalid_value") from error


def _asks_for_structure(name: str, value) -> bool:
    return value is not None and not (name == "response_format" and value.get("type") == "text")


def _response_schema(response_format: dict) -> dict:
    """The JSON schema of OpenAI's ``response_format``: any object for json_object, the given one for json_schema."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise BlockspecError("a json_schema response_format needs its schema: "
                                 '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        return schema
    raise BlockspecError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def _bad_words_ids(tokenizer, words: list[str]) -> tuple[tuple[int, ...], ...]:
    try:
        return bad_words_ids(tokenizer, words)
    except BlockspecError as error:
        raise bad_request(f"bad_words: {error}", param="bad_words", code="invalid_value") from error


def _choices(request: PreparedRequest, count: int) -> list[PreparedRequest]:
    """``count`` choices of one prompt, decoded together in the batch: with a seed, choice i samples from seed + i
    (its own draws, repeatable); without one, each draws its own; greedy choices are alike."""
    seed = request.config.seed
    return [request if i == 0 or seed is None else
            replace(request, config=replace(request.config, seed=(seed + i) % 2**64)) for i in range(count)]


def _best_of(body: CompletionRequest) -> int:
    """How many completions of each prompt are decoded: ``best_of`` (at least ``n``), or ``n``. Greedy
    completions are all alike, so ``n`` of them are the best ``n`` of any number."""
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise bad_request(f"best_of {best_of} is fewer than the n={body.n} choices it picks from: raise best_of",
                          param="best_of", code="invalid_value")
    if best_of > body.n and body.stream:
        raise bad_request("best_of picks among finished completions, so it cannot stream: send stream false",
                          param="best_of", code="unsupported_value")
    if best_of > 16:
        raise bad_request(f"best_of {best_of} is more than 16 completions of one prompt", param="best_of",
                          code="invalid_value")
    return body.n if usable_sampling(body.temperature, body.top_p, body.top_k)[0] == 0 else best_of


def _ranked(request: PreparedRequest, candidates: int, body: CompletionRequest) -> PreparedRequest:
    """With more candidates than choices, each decodes with its tokens' log-probabilities (its rank), shown only
    where the request asked for them."""
    if candidates == body.n or request.config.logprobs is not None:
        return request
    return replace(request, config=replace(request.config, logprobs=0), show_logprobs=False)


async def _echoed(engine: ServingEngine, target: Target, body: CompletionRequest, prompt: str | list[int],
                  request: PreparedRequest) -> PreparedRequest:
    """The request answering its prompt before the completion, with the prompt tokens' log-probabilities where
    asked for (the target scores the prompt, between two steps of the batch)."""
    text = prompt if isinstance(prompt, str) else target.tokenizer.decode(prompt)
    scored = await engine.score(request.prompt_ids, body.logprobs) if body.logprobs is not None else None
    return replace(request, echo=text, echo_logprobs=scored)


def _stop_token_ids(target: Target, body: SamplingFields) -> tuple[int, ...]:
    """The request's own stop tokens (vLLM's ``stop_token_ids``), checked against the vocabulary."""
    ids = tuple(body.stop_token_ids or ())
    vocab = target.model.config.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise bad_request(f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids", code="invalid_value")
    return ids


def _token_limit(target: Target, body: SamplingFields, prompt_tokens: int) -> int:
    """The completion length: as asked when it fits the context, what is left of it when not asked."""
    context = target.context_length
    asked = body.token_limit if _limit_was_given(body) else None
    if context is not None and prompt_tokens >= context:
        prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
        raise bad_request(f"the prompt has {prompt_tokens} tokens but the model's context is {context}: "
                          "shorten the prompt", param=prompt_param, code="context_length_exceeded")
    room = context - prompt_tokens if context is not None else None
    if asked is not None:
        if room is not None and asked > room:
            param = _limit_param(body)
            raise bad_request(f"{param} {asked} does not fit: the model's context is {context} tokens and the "
                              f"prompt has {prompt_tokens}, so at most {room} can be generated",
                              param=param, code="context_length_exceeded")
        return asked
    default = body.token_limit or _DEFAULT_CHAT_TOKENS
    return min(default, room) if room is not None else default


def _limit_was_given(body: SamplingFields) -> bool:
    return bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)


def _limit_param(body: SamplingFields) -> str:
    return "max_completion_tokens" if "max_completion_tokens" in body.model_fields_set else "max_tokens"


# -- responses ------------------------------------------------------------------------------------

class TextCompletion:
    """The shapes of /v1/completions answers."""

    object = "text_completion"
    chunk_object = "text_completion"
    prefix = "cmpl"

    def __init__(self, target: Target):
        self.model = target.name
        self.tokenizer = target.tokenizer

    def envelope(self, id: str, created: int, object: str | None = None) -> dict:
        return {"id": id, "object": object or self.object, "created": created, "model": self.model}

    def full_choice(self, text: str, finish_reason: str, logprobs: list[TokenLogprob] | None = None) -> dict:
        return {"index": 0, "text": text, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def opening_delta(self) -> dict | None:
        return None

    def delta_choice(self, text: str | None, finish_reason: str | None = None,
                     logprobs: list[TokenLogprob] | None = None, offset: int = 0) -> dict:
        return {"index": 0, "text": text or "", "logprobs": self.logprobs(logprobs, offset),
                "finish_reason": finish_reason}

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """The legacy completions layout: token texts, their log-probabilities, the top ones, text offsets (an echoed
        prompt's first token has neither log-probability nor top ones: null)."""
        if entries is None:
            return None
        texts = [self.token_text(entry.token) for entry in entries]
        starts = [offset + sum(len(text) for text in texts[:i]) for i in range(len(texts))]
        tops = [None if entry.logprob is None else
                {**{self.token_text(t): v for t, v in entry.top}, text: entry.logprob}
                for entry, text in zip(entries, texts)]
        return {"tokens": texts, "token_logprobs": [entry.logprob for entry in entries], "top_logprobs": tops,
                "text_offset": starts}

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])


class ChatCompletion(TextCompletion):
    """The shapes of /v1/chat/completions answers; with ``tools``, the answer's calls as ``tool_calls``."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    prefix = "chatcmpl"

    def __init__(self, target: Target, tools: ToolUse | None = None):
        super().__init__(target)
        self.tools = tools
        self._calls_stream = ToolCallStream(tools.parallel) if tools is not None else None

    def full_choice(self, text: str, finish_reason: str, logprobs: list[TokenLogprob] | None = None) -> dict:
        message = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = parse_tool_calls(text, self.tools.parallel)
            if calls:
                message, finish_reason = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"index": 0, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def opening_delta(self) -> dict | None:
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta_choice(self, text: str | None, finish_reason: str | None = None,
                     logprobs: list[TokenLogprob] | None = None, offset: int = 0) -> dict:
        calls = []
        if self._calls_stream is not None:  # content up to a call streams; the calls come whole at the end
            text = self._calls_stream.feed(text or "")
            if finish_reason is not None:
                rest, calls = self._calls_stream.finish()
                text += rest
            text = text or None
        delta = {} if text is None else {"content": text}
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
            finish_reason = "tool_calls"
        return {"index": 0, "delta": delta, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
        """The chat layout: per token its text, log-probability, bytes and the top tokens'."""
        if entries is None:
            return None
        return {"content": [{**self._token(entry.token, entry.logprob),
                             "top_logprobs": [self._token(t, v) for t, v in entry.top]} for entry in entries],
                "refusal": None}

    def _token(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


async def _respond(generation: Generation, body: SamplingFields, request: Request, shape: TextCompletion):
    if body.stream:
        events = _stream_events(generation, shape, body.include_usage)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        if generation.submission is not None:
            headers["X-Queue-Position"] = str(generation.submission.queue_position)
        return CancellingStream(events, on_close=generation.close, media_type="text/event-stream", headers=headers)
    return await _collect_choices([generation], shape, request)


def _start_all(engine: ServingEngine, target: Target, prepared: list[PreparedRequest]) -> list[Generation]:
    """Every prompt's generation, submitted together (a full queue refuses them all: none is left running)."""
    started = []
    try:
        for request in prepared:
            started.append(Generation(engine, target.tokenizer, request).start())
    except APIError:
        for generation in started:
            generation.close()
        raise
    return started


async def _collect_choices(generations: list[Generation], shape: TextCompletion, request: Request,
                           n: int = 1, candidates: int = 1) -> JSONResponse:
    """One body with the generations' texts as choices (decoded together, in the batch). Each prompt has
    ``candidates`` consecutive generations, counted once in the usage; the ``n`` of them whose tokens are the
    most likely on average (OpenAI's ``best_of``) are its choices."""
    created = int(time.time())

    async def text(generation: Generation) -> str:
        return "".join([piece async for piece in generation.pieces(request.is_disconnected)])

    try:
        texts = await asyncio.gather(*(text(generation) for generation in generations))
    finally:
        for generation in generations:
            generation.close()
    if any(generation.finish_reason is None for generation in generations):  # the client left: nobody to answer
        return ClientLeft()
    body = shape.envelope(f"{shape.prefix}-{uuid.uuid4().hex}", created)
    answers = list(zip(texts, generations))
    if candidates > n:
        answers = [answer for start in range(0, len(answers), candidates)
                   for answer in sorted(answers[start:start + candidates], key=lambda a: -a[1].mean_logprob())[:n]]
    choices = [shape.full_choice(text, generation.finish_reason, generation.take_logprobs())
               for text, generation in answers]
    for index, choice in enumerate(choices):
        choice["index"] = index
    prompt_tokens = sum(generation.prompt_tokens for generation in generations[::candidates])
    completion_tokens = sum(generation.completion_tokens for generation in generations)
    body.update(choices=choices, usage={"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                        "total_tokens": prompt_tokens + completion_tokens})
    return JSONResponse(body)


async def _stream_events(generation: Generation, shape: TextCompletion, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``."""
    id, created = f"{shape.prefix}-{uuid.uuid4().hex}", int(time.time())

    def chunk(choices: list[dict], **extra) -> str:
        body = shape.envelope(id, created, shape.chunk_object)
        body["choices"] = choices
        if include_usage:
            body["usage"] = extra.get("usage")
        return f"data: {json.dumps(body)}\n\n"

    opening = shape.opening_delta()
    if opening is not None:
        yield chunk([opening])
    offset = 0  # where the next token's text starts in the answer (the completions layout's text_offset)

    def choice(text: str | None, finish_reason: str | None = None) -> dict:
        nonlocal offset
        logprobs = generation.take_logprobs()
        made = shape.delta_choice(text, finish_reason, logprobs, offset)
        offset += sum(len(shape.token_text(entry.token)) for entry in logprobs or [])
        return made

    try:
        async for piece in generation.pieces():
            yield chunk([choice(piece)])
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"
        return
    yield chunk([choice(None, generation.finish_reason or "stop")])
    if include_usage:
        yield chunk([], usage=generation.usage())
    yield "data: [DONE]\n\n"


class ClientLeft(Response):
    """What a request whose client has gone answers: nothing (the counter records it as a disconnect)."""

    async def __call__(self, scope, receive, send):
        return None


class CancellingStream(StreamingResponse):
    """A streamed response that notices a client leaving at once, and always runs ``on_close``.

    Starlette (for ASGI 2.4 servers) only finds out about a disconnect at the next write,
    and may leave the body generator unfinished; here a task listens for
    ``http.disconnect`` while streaming, and ``on_close`` cancels the request's row
    whatever ended the stream, so its batch slot is freed.
    """

    def __init__(self, content, *, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            async with anyio.create_task_group() as group:
                async def stream_then_stop():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self.on_close()
            await self.body_iterator.aclose()
