"""Speculative decoding of one sequence: a stream of steps, with its statistics at the end.

    sequence = new_sequence(...)                       # settings checked, nothing run yet
    target = SequenceTarget(model, ...)                # the target's cache for this sequence
    yield prefill_step(target, sequence)               # the prompt, the first token
    while not sequence.finished:
        yield decode_step(target, [sequence])[0]       # draft -> verify -> accept -> commit

Without a drafter the same loop decodes one token per forward (plain autoregressive).
"""

from __future__ import annotations

from functools import partial

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.compile_policy import compile_choice
from blockspec.decoding.fast import FastForward, fast_forward
from blockspec.decoding.forward import SequenceTarget
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import (
    GenerationConfig,
    Sequence,
    SequenceView,
    adapts_width,
    new_sequence,
    widest_verify,
)
from blockspec.decoding.static_targets import StaticTarget, sequence_cost_model
from blockspec.decoding.step import decode_step, end_sequence, prefill_step
from blockspec.drafters.base import Drafter


class TokenStream(SequenceView):
    """Iterate for ``Step``s as they are decoded; ``stats`` and ``token_ids`` fill in as it runs.

    ``width_policies``: where an adaptive width ("auto") keeps its calibration; pass the same
    store to every stream of a drafter so it carries over prompts (default: a new one).
    """

    def __init__(self, target_model, input_ids, drafter: Drafter | None, config: GenerationConfig, *,
                 width_policies: WidthPolicies | None = None, fast: FastForward | None = None):
        self.model = target_model
        self.sequence: Sequence = new_sequence(target_model, input_ids, drafter, config)
        self.fast = fast if fast is not None else _fast_forward_for(target_model, drafter, config)
        if adapts_width(config):
            store = width_policies if width_policies is not None else WidthPolicies()
            timing = {} if self.fast is None else {"path": self.fast.path,
                                                   "measure": partial(sequence_cost_model, self.fast)}
            self.sequence.width_policy = store.get(target_model, widest_verify(drafter, config),
                                                   tree=bool(config.tree_budget), **timing)

    @property
    def widths(self) -> list[int]:
        """The verify widths an adaptive policy chose, step by step."""
        return self.sequence.widths

    def __iter__(self):
        with torch.inference_mode():
            yield from self._run()

    def _run(self):
        sequence, device = self.sequence, self.model.device
        target = self._target()
        started = wall_clock(device)
        try:
            step = prefill_step(target, sequence)
            sequence.stats.time_to_first_token = sequence.stats.total_time = wall_clock(device) - started
            yield step
            while not sequence.finished:
                (step,) = decode_step(target, [sequence])
                sequence.stats.total_time = wall_clock(device) - started
                yield step
        finally:  # also when the caller stops early (a cancelled request)
            end_sequence(sequence)

    def _target(self):
        """This sequence's target forwards: the fast path's static cache, or a dynamic cache of its own."""
        sequence = self.sequence
        if self.fast is not None:
            return StaticTarget(self.fast, sequence.input_ids.shape[1] + sequence.max_new_tokens + 1)
        drafter = sequence.drafter
        return SequenceTarget(self.model, drafter.feature_layers if drafter is not None else None)


def warm_up_fast_path(model, drafter: Drafter | None, config: GenerationConfig, prompt_length: int) -> None:
    """Compile (or load) the fast path's graphs a decode under ``config`` will use, ahead of timing it."""
    fast = _fast_forward_for(model, drafter, config)
    if fast is not None:
        fast.warm_up(widest_verify(drafter, config), prompt_length + config.max_new_tokens + 1)


def _fast_forward_for(model, drafter: Drafter | None, config: GenerationConfig) -> FastForward | None:
    compiled, _ = compile_choice(model, config.compile)
    if not compiled:
        return None
    return fast_forward(model, drafter.feature_layers if drafter is not None else None)


def speculative_generate(target_model, input_ids, drafter: Drafter | None = None,
                         config: GenerationConfig | None = None, *,
                         width_policies: WidthPolicies | None = None,
                         fast: FastForward | None = None) -> TokenStream:
    """A lazy stream of decoding steps; without a drafter, plain autoregressive decoding.

    ``fast``: run the target through the fast path (a static cache and compiled forwards).
    """
    return TokenStream(target_model, input_ids, drafter, config or GenerationConfig(),
                       width_policies=width_policies, fast=fast)
