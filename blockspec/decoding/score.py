"""The target's log-probability of each token of a given text: what a completions request with ``echo`` and
``logprobs`` answers for its prompt, and what scoring harnesses (lm-eval's loglikelihood) ask a server for."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from blockspec.decoding.sequence import TokenLogprob
from blockspec.models.target import forward_options

#: Tokens a forward scores at most: the logits of a chunk ([chunk, vocabulary] floats) bound the memory.
SCORE_CHUNK = 256


@torch.inference_mode()
def text_logprobs(model, ids: list[int], top: int, chunk: int = SCORE_CHUNK) -> list[TokenLogprob]:
    """Per token of ``ids``, its log-probability given the tokens before it and the ``top`` most likely tokens'
    there; the first token, which nothing predicts, has no log-probability (None)."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    cache = DynamicCache(config=model.config)
    scored = [TokenLogprob(ids[0], None)]
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        logits = model(tokens[:, start:end], cache=cache, use_cache=True, **forward_options(model)).logits
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        following = tokens[0, start + 1:end + 1]
        chosen = logprobs.gather(-1, following[:, None])[:, 0].tolist()
        best = logprobs.topk(top, dim=-1) if top else None
        for i, (token, value) in enumerate(zip(following.tolist(), chosen)):
            alternatives = () if best is None else tuple(zip(best.indices[i].tolist(), best.values[i].tolist()))
            scored.append(TokenLogprob(token, value, alternatives))
    return scored
