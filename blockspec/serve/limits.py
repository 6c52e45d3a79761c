"""Bounds on what one request or one command may ask of the decoder, checked before any decoding.

The decoding library takes any value its types allow; these are the values that would crash it
or exhaust the machine part-way through, refused (or, where the limit has a clear meaning,
mapped to it) up front: by ``blockspec generate`` and ``serve`` at start-up, and by the server
for every request before it joins the batch.
"""

from __future__ import annotations

import torch
from starlette.exceptions import HTTPException

from blockspec.decoding.fast import WIDTH_BUCKETS
from blockspec.decoding.sequence import GenerationConfig, widest_verify
from blockspec.decoding.static_cache import capacity_for, kv_slot_bytes
from blockspec.errors import BlockspecError
from blockspec.serve.schemas import APIError
from blockspec.training.memory import available_memory

#: Below this a temperature counts as 0 (greedy), as in vLLM: logits divided by less overflow float32.
MIN_TEMPERATURE = 1e-5
#: A nucleus narrower than this keeps the most probable token alone, its limit as top_p -> 0
#: (in float32 a far smaller top_p rounds to 0 and keeps nothing).
MIN_TOP_P = 1e-5

#: The most tokens one verify forward may carry: 4x the fast path's widest compiled width. Wider trees
#: cost more per step than they gain: a 1000-node tree decoded SmolLM2-135M at 0.2 tokens/s on a CPU.
MAX_VERIFY_TOKENS = 4 * WIDTH_BUCKETS[-1]
#: The share of the available memory one verify forward's logits, mask and features may take.
VERIFY_MEMORY_SHARE = 0.5
#: The share of the memory available at start-up the batch's KV cache may take by default (--kv-budget auto).
KV_MEMORY_SHARE = 0.4
#: The largest request body read (--max-request-bytes): a whole 128k-token prompt as JSON is about 1 MB.
MAX_REQUEST_BYTES = 8 * 2**20


def usable_sampling(temperature: float, top_p: float, top_k: int) -> tuple[float, float, int]:
    """(temperature, top_p, top_k) as the sampler can run them: a temperature below ``MIN_TEMPERATURE``
    is greedy, a top_p below ``MIN_TOP_P`` keeps the most probable token alone (top_k 1)."""
    if 0 < temperature < MIN_TEMPERATURE:
        return 0.0, top_p, top_k
    if 0 < top_p < MIN_TOP_P:
        return temperature, 1.0, 1
    return temperature, top_p, top_k


def verify_bytes_per_token(model) -> int:
    """About the memory one verify token takes: its logits and their probabilities (fp32, the whole
    vocabulary, three copies at the peak), its hidden states in every layer, its row of the attention mask."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", 1) + 1
    context = getattr(config, "max_position_embeddings", None) or 0
    return 4 * (3 * config.vocab_size + layers * config.hidden_size + context)


def max_verify_tokens(model) -> tuple[int, str]:
    """The widest verify forward allowed on this machine, and what sets it."""
    by_memory = int(VERIFY_MEMORY_SHARE * available_memory() // verify_bytes_per_token(model))
    if by_memory < MAX_VERIFY_TOKENS:
        return by_memory, f"what fits in half the memory available here ({available_memory() / 2**30:.1f} GiB)"
    return MAX_VERIFY_TOKENS, f"4x the fast path's widest verify ({WIDTH_BUCKETS[-1]} tokens)"


def check_verify_size(model, drafter, config: GenerationConfig) -> None:
    """Refuse a tree budget or block size whose verify forward would not fit (or would crawl)."""
    widest = widest_verify(drafter, config)
    limit, why = max_verify_tokens(model)
    if widest <= limit:
        return
    if config.tree_budget:
        raise BlockspecError(f"--tree-budget {config.tree_budget} is too large: a step would verify {widest} tokens, "
                             f"and at most {limit} are allowed ({why}): give --tree-budget {limit - 1} or less")
    raise BlockspecError(f"--block-size {widest} is too large: at most {limit} tokens are verified per step "
                         f"({why}): give --block-size {limit} or less")



class BodyTooLarge(HTTPException):
    def __init__(self, max_bytes: int):
        super().__init__(413, f"the request body is larger than this server's limit of {max_bytes} bytes: "
                              "send a shorter prompt (the server's --max-request-bytes sets the limit)")


class BodySizeLimit:
    """ASGI middleware refusing a body over ``max_bytes`` with a 413: by its Content-Length before reading it,
    or, sent in chunks, as soon as the bytes read pass the limit (raised as an HTTP error the app answers)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            error = BodyTooLarge(self.max_bytes)
            return await APIError(413, error.detail, code="request_too_large").response()(scope, receive, send)
        received = 0

        async def counted_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted_receive, send)


def default_kv_budget(model, max_batch_size: int) -> int | None:
    """The KV budget (token slots) the server admits rows within by default: what ``KV_MEMORY_SHARE`` of the
    memory available now holds, or None (no bound) when that holds ``max_batch_size`` rows of the whole
    context anyway."""
    config = model.config.get_text_config(decoder=True)
    free = torch.cuda.mem_get_info(model.device)[0] if model.device.type == "cuda" else available_memory()
    slots = int(KV_MEMORY_SHARE * free / kv_slot_bytes(config, model.dtype))
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and slots >= max_batch_size * capacity_for(context + WIDTH_BUCKETS[-1]):
        return None
    return slots
