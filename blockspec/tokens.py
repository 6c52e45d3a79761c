"""A tokenizer's special tokens and the one way a prompt becomes token ids.

Every part of blockspec that stops a response, ends a training response, picks a mask
token or encodes a prompt asks this module, so generation, training, benchmarks and the
converted hub models agree on them.
"""

from __future__ import annotations

import json

from blockspec.errors import BlockspecError

#: Tokens that end an assistant turn in the chat templates of common model families: ChatML
#: (Qwen, SmolLM), Llama 3, Gemma, Phi-3, and EXAONE. A template's end-of-turn token is the
#: first of these that the template names and the vocabulary holds.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endofturn|>")

#: Dedicated mask tokens, tried in this order before any spare special token.
MASK_TOKENS = ("<|MASK|>", "<|mask|>", "<mask>", "[MASK]")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def end_of_turn_ids(tokenizer) -> list[int]:
    """Ids of the END_OF_TURN_TOKENS that the tokenizer's chat template names, in that order."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # several named templates
        template = json.dumps(template)
    ids = [_token_id(tokenizer, token) for token in END_OF_TURN_TOKENS if token in template]
    return [token_id for token_id in ids if token_id is not None]


def response_end_id(tokenizer, *, use_chat_template: bool = True) -> int | None:
    """The token that ends a response: the chat template's end of turn, else the eos token."""
    if use_chat_template and (ends := end_of_turn_ids(tokenizer)):
        return ends[0]
    return getattr(tokenizer, "eos_token_id", None)


def stop_token_ids(tokenizer, generation_config=None, *, end_of_turn: bool = True) -> list[int]:
    """Ids that end a response, sorted: the generation config's eos ids, the tokenizer's eos,
    and (with ``end_of_turn``, for prompts written with the chat template) the template's
    end-of-turn tokens."""
    ids = id_list(getattr(generation_config, "eos_token_id", None))
    ids += id_list(getattr(tokenizer, "eos_token_id", None))
    if end_of_turn:
        ids += end_of_turn_ids(tokenizer)
    return sorted(set(ids))


def pick_mask_token(tokenizer, vocab_size: int) -> int:
    """A token whose frozen embedding serves as the mask.

    A dedicated mask token when the tokenizer has one; else an added special token that
    neither the chat template nor bos/eos/pad use.
    """
    for name in MASK_TOKENS:
        token_id = _token_id(tokenizer, name)
        if token_id is not None and 0 <= token_id < vocab_size:
            return token_id
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    template = tokenizer.chat_template or ""
    candidates = [
        token_id for token_id, token in sorted(tokenizer.added_tokens_decoder.items())
        if token.special and token_id not in reserved and token.content not in template and token_id < vocab_size
    ]
    if not candidates:
        raise BlockspecError("the tokenizer has no spare special token to use as the mask: pass --mask-token-id")
    return candidates[-1]


def is_chat(prompt) -> bool:
    """Whether a prompt is a list of chat messages (not a string, not token ids)."""
    return isinstance(prompt, (list, tuple)) and not all(isinstance(t, int) for t in prompt)


def encode_prompt(tokenizer, prompt, *, use_chat_template: bool = True, tools: list[dict] | None = None) -> list[int]:
    """Token ids of a prompt, ready for the assistant's answer (or the text's continuation).

    ``prompt`` is token ids (returned as they are), a list of chat messages, or a string (one
    user message). With a chat template and ``use_chat_template``: the template with the
    generation prompt (and ``tools``, the functions the model may call, where given). Otherwise plain
    text, the messages' contents joined by blank lines, with the tokenizer's own special tokens
    (e.g. BOS). An empty prompt gives no ids.
    """
    if isinstance(prompt, (list, tuple)) and not is_chat(prompt):
        return [int(t) for t in prompt]
    if not isinstance(prompt, (str, list, tuple)):
        raise BlockspecError(f"a prompt must be a string, chat messages or token ids, not {type(prompt).__name__}")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if use_chat_template and has_chat_template(tokenizer):
        return _apply_chat_template(tokenizer, messages, tools)
    if tools:
        raise BlockspecError("tools go into the prompt through the chat template: use the chat template")
    text = "\n\n".join(message["content"] for message in messages)
    return [int(t) for t in tokenizer(text, add_special_tokens=True)["input_ids"]]


def _apply_chat_template(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _token_id(tokenizer, token: str) -> int | None:
    """The id of ``token``, or None when the vocabulary lacks it (tokenizers answer with unk)."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id == getattr(tokenizer, "unk_token_id", None):
        return None
    return token_id


def id_list(value) -> list[int]:
    """Token ids given as None, one id or several, as a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
