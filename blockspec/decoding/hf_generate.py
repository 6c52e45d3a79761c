"""blockspec's speculative decoding inside Hugging Face ``model.generate``, through its ``custom_generate`` hook.

    drafter = load_drafter("path/to/draft", model)
    out = model.generate(**inputs, max_new_tokens=128, custom_generate=hf_custom_generate(drafter))

``generate`` prepares the inputs, the generation config, the logits processors and the stopping
criteria as usual, then hands the decoding loop to the callable this module makes, which runs
blockspec's own loop (any drafter of the registry, the one verifier; None: plain decoding) and
returns what ``generate`` would: the prompt and its continuation, rows padded with the pad token.
Every setting of the call is honoured or refused by name: the loop applies temperature, top-k and
top-p (the target's distribution, exactly, as speculative sampling does) and stops at the token
limit and the end-of-sequence tokens; any other logits processor or stopping criterion (a
repetition penalty, stop strings, a time limit) raises a ``ValueError`` naming it rather than
being skipped, as do the outputs speculative decoding does not produce (per-step scores, logits,
attentions, hidden states). transformers hands a ``custom_generate`` loop neither ``streamer`` nor
``synced_gpus`` (it keeps the arguments of its own loops to itself): to stream, use
``blockspec.stream_text`` or ``speculative_generate``, whose steps arrive as they are decoded.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.generation.utils import GenerateDecoderOnlyOutput

from blockspec.decoding.generate import speculative_generate
from blockspec.decoding.policy import AUTO, WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.drafters.base import Drafter

#: Outputs of ``generate`` a speculative loop does not compute step by step, refused when asked for.
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def hf_custom_generate(drafter: Drafter | None = None, *, block_size: int | str | None = None,
                       tree_budget: int | None = None, compile: str = "off",
                       width_policies: WidthPolicies | None = None) -> Callable:
    """A decoding loop for ``model.generate(..., custom_generate=...)``: blockspec's speculative decoding with
    ``drafter`` (None: plain decoding through the same loop), verifying ``block_size`` tokens a step (None or
    ``"auto"``: the cost model chooses each step) or a token tree of ``tree_budget`` nodes, the target's forward as
    ``compile`` says ("off", "auto", "on"). The adaptive width's calibration carries over calls."""
    policies = width_policies if width_policies is not None else WidthPolicies()
    if block_size is None and drafter is not None:
        block_size = AUTO

    def blockspec_decoding(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        _refuse_unsupported_outputs(generation_config)
        rows = _prompt_rows(input_ids, model_kwargs.get("attention_mask"))
        config = generation_config_of(generation_config, logits_processor, stopping_criteria, input_ids.shape[1],
                                      block_size=block_size, tree_budget=tree_budget, compile=compile)
        continuations = []
        for prompt in rows:
            stream = speculative_generate(model, prompt.unsqueeze(0), drafter, config, width_policies=policies)
            for _ in stream:
                pass
            continuations.append(stream.token_ids)
        sequences = _padded(input_ids, continuations, _pad_token_id(generation_config))
        if generation_config.return_dict_in_generate:
            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    return blockspec_decoding


def generation_config_of(hf_config, logits_processor, stopping_criteria, input_length: int, *,
                         block_size=None, tree_budget=None, compile: str = "off") -> GenerationConfig:
    """blockspec's ``GenerationConfig`` for what ``generate`` prepared, refusing what the loop cannot honour."""
    warpers = _sampling_of(logits_processor)  # refuses any other processor, greedy or not
    sampling = warpers if hf_config.do_sample else {}
    _refuse_unsupported_criteria(stopping_criteria)
    eos = getattr(hf_config, "_eos_token_tensor", None)
    stop_ids = tuple(int(token) for token in eos.reshape(-1).tolist()) if eos is not None else ()
    max_new_tokens = hf_config.max_length - input_length
    if max_new_tokens < 1:
        raise ValueError(f"max_length {hf_config.max_length} leaves no room after the {input_length}-token prompt: "
                         "raise max_new_tokens")
    seed = int(torch.randint(0, 2**62, (1,))) if hf_config.do_sample else None  # follows torch.manual_seed
    return GenerationConfig(max_new_tokens=max_new_tokens, block_size=block_size, tree_budget=tree_budget,
                            stop_token_ids=stop_ids, seed=seed, compile=compile, **sampling)


def _sampling_of(logits_processor) -> dict:
    """Temperature, top-k and top-p from ``generate``'s warpers; any other processor is refused by name."""
    sampling = {"temperature": 1.0}
    for processor in logits_processor or []:
        if isinstance(processor, TemperatureLogitsWarper):
            sampling["temperature"] = float(processor.temperature)
        elif isinstance(processor, TopKLogitsWarper):
            sampling["top_k"] = int(processor.top_k)
        elif isinstance(processor, TopPLogitsWarper):
            sampling["top_p"] = float(processor.top_p)
        else:
            raise ValueError(_unsupported(type(processor).__name__))
    return sampling


def _refuse_unsupported_criteria(stopping_criteria) -> None:
    for criterion in stopping_criteria or []:
        if not isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            raise ValueError(_unsupported(type(criterion).__name__))


def _refuse_unsupported_outputs(hf_config) -> None:
    asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(hf_config, name, False)]
    if asked:
        raise ValueError(f"blockspec's decoding does not return {', '.join(asked)} (a speculative step scores a "
                         "whole block at once): leave them off, or decode without custom_generate")


def _unsupported(name: str) -> str:
    return (f"blockspec's decoding applies temperature, top-k and top-p and stops at the token limit and the "
            f"end-of-sequence tokens; it does not apply {name}: leave that setting off, or decode without "
            "custom_generate")


def _prompt_rows(input_ids: torch.LongTensor, attention_mask: torch.Tensor | None) -> list[torch.LongTensor]:
    """Each row's prompt without its padding (left padding, as decoder-only ``generate`` takes)."""
    if attention_mask is None:
        return list(input_ids)
    rows = []
    for ids, mask in zip(input_ids, attention_mask):
        kept = mask.bool()
        if not bool(kept.any()):
            raise ValueError("a row of attention_mask masks its whole prompt: there is nothing to continue")
        first = int(kept.nonzero()[0])
        if not bool(kept[first:].all()):
            raise ValueError("attention_mask has a gap inside a prompt: pad on the left only (padding_side='left')")
        rows.append(ids[first:])
    return rows


def _padded(input_ids: torch.LongTensor, continuations: list[list[int]], pad_id: int) -> torch.LongTensor:
    """The prompts as given, each followed by its continuation, shorter rows padded on the right."""
    longest = max(len(tokens) for tokens in continuations)
    new = torch.full((input_ids.shape[0], longest), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for row, tokens in enumerate(continuations):
        new[row, :len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype)
    return torch.cat([input_ids, new], dim=1)


def _pad_token_id(hf_config) -> int:
    pad = getattr(hf_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.reshape(-1)[0])
    eos = getattr(hf_config, "_eos_token_tensor", None)
    return int(eos.reshape(-1)[0]) if eos is not None else 0
