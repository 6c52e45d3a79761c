"""Tiny models and tokenizers built inside the tests (no network, milliseconds)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts several tokens and verifies them in one forward pass.",
    "What is 12 times 7? Let's think step by step. 12 * 7 = 84. The answer is 84.",
    "Write a function that returns the sum of a list of numbers.",
] * 4


def make_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with chat special tokens and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str, vocab_size: int, **overrides):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 16)
        return Qwen3Config(**common)
    raise ValueError(arch)


def make_causal_lm(arch: str = "llama", vocab_size: int = 320, seed: int = 0, **overrides):
    """A randomly initialised tiny causal LM in eval mode.

    initializer_range is raised so that logits are far from ties: greedy comparisons
    then test the algorithm rather than floating-point noise.
    """
    torch.manual_seed(seed)
    overrides.setdefault("initializer_range", 0.2)
    config = tiny_config(arch, vocab_size, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def save_tiny_target(directory: Path, arch: str = "llama", seed: int = 0) -> Path:
    """A target checkpoint directory (model + tokenizer) as a user would have one."""
    tokenizer = make_tokenizer()
    model = make_causal_lm(arch, vocab_size=len(tokenizer), seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)
