"""Bounds on what one request or one command may ask of the decoder, checked before any decoding.

The decoding library takes any value its types allow; these are the values that would crash it
or exhaust the machine part-way through, refused (or, where the limit has a clear meaning,
mapped to it) up front: by ``blockspec generate`` and ``serve`` at start-up, and by the server
for every request before it joins the batch.
"""

from __future__ import annotations

from blockspec.decoding.fast import WIDTH_BUCKETS
from blockspec.decoding.sequence import GenerationConfig, widest_verify
from blockspec.errors import BlockspecError
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

