"""Text in, text out: prompts through the tokenizer, token steps back into streamed text.

This is what the CLI, the benchmark and the server drive.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from blockspec.decoding.generate import TokenStream, speculative_generate
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig, GenerationStats
from blockspec.drafters.base import Drafter
from blockspec.models.target import Target


@dataclass
class TextChunk:
    text: str
    token_ids: list[int]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "acceptance_lengths": self.stats.acceptance_lengths,
            "tau": self.stats.tau,
            "tokens_per_s": self.stats.tokens_per_s,
            "time_to_first_token": self.stats.time_to_first_token,
            "draft_seconds": self.stats.draft_seconds,
            "verify_seconds": self.stats.verify_seconds,
            "draft_ms_per_step": self.stats.draft_ms_per_step,
            "verify_ms_per_step": self.stats.verify_ms_per_step,
            "draft_share": self.stats.draft_share,
            "stats": self.stats.to_dict(),
        }


class Detokenizer:
    """Turns a growing list of ids into text increments, holding back half-decoded characters."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.text
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new


class TextStream:
    """Iterate for ``TextChunk``s; ``result`` is complete once the iteration ends."""

    def __init__(self, target: Target, tokens: TokenStream):
        self.tokens = tokens
        self.detokenizer = Detokenizer(target.tokenizer)

    def __iter__(self):
        for step in self.tokens:
            yield TextChunk(self.detokenizer.add(step.tokens), step.tokens)

    @property
    def result(self) -> GenerationResult:
        return GenerationResult(self.detokenizer.text, list(self.tokens.token_ids),
                                self.tokens.sequence.input_ids[0].tolist(), self.tokens.stats)


def stream_text(target: Target, prompt, drafter: Drafter | None = None, config: GenerationConfig | None = None,
                *, use_chat_template: bool = True, width_policies: WidthPolicies | None = None) -> TextStream:
    """Stream the continuation of ``prompt`` (text, chat messages or token ids).

    ``width_policies``: the adaptive width's calibration, to carry it over prompts (see ``TokenStream``).
    """
    config = config or GenerationConfig()
    if not config.stop_token_ids:
        config = replace(config, stop_token_ids=target.stop_token_ids())
    ids = target.encode_prompt(prompt, use_chat_template)
    return TextStream(target, speculative_generate(target.model, ids, drafter, config,
                                                    width_policies=width_policies))


def generate_text(target: Target, prompt, drafter: Drafter | None = None, config: GenerationConfig | None = None,
                  *, use_chat_template: bool = True, width_policies: WidthPolicies | None = None) -> GenerationResult:
    stream = stream_text(target, prompt, drafter, config, use_chat_template=use_chat_template,
                         width_policies=width_policies)
    for _ in stream:
        pass
    return stream.result

