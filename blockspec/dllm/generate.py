"""Masked-diffusion generation: one loop for LLaDA, Dream, Fast-dLLM and block diffusion.

The answer region starts as MASK and is split into blocks filled left to right (one block
of the whole length is Dream's setting). Each step runs the model, proposes a token for
every masked position of the current block and commits the ones the ``Scheduler`` picks.
What the model is fed per step is the cache mode:

- ``none``: the whole sequence (bidirectional) or everything up to the current block
  (block-causal attention), every step: exact, the most compute;
- ``prefix`` (Fast-dLLM): a full forward at each block start caches the keys/values left
  of the block; steps feed the block and everything right of it. Approximate: the prefix
  does not see the block change;
- ``dual`` (Fast-dLLM): the same forward also caches the right of the block; steps feed
  the block alone. Approximate on both sides;
- ``exact`` (block diffusion): with block-causal attention a finished block never sees a
  later one, so its keys/values are final: each finished block is fed once, clean, into
  the cache, and steps feed the current block alone. Equal to ``none`` with block-causal
  attention.

Shifted models (initialised from an AR model, like Dream) predict token i from position
i - 1, so every forward reads its logits one position to the left.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from blockspec.dllm.model import BIDIRECTIONAL, BLOCK_CAUSAL, answer_blocks, block_causal_mask
from blockspec.dllm.schedule import Scheduler
from blockspec.errors import BlockspecError
from blockspec.sampling import SamplingConfig, sampling_probs

CACHE_MODES = ("none", "prefix", "dual", "exact")

#: Named settings of the papers' samplers; every field can still be overridden.
SAMPLER_PRESETS: dict[str, dict] = {
    "llada": dict(scheduler=Scheduler(count="linear", score="confidence"), block_length=32, cache="none"),
    "dream": dict(scheduler=Scheduler(count="linear", score="entropy"), block_length=None, cache="none"),
    "fast-dllm": dict(scheduler=Scheduler(count="threshold", score="confidence", threshold=0.9),
                      block_length=32, cache="dual"),
    "block-diffusion": dict(scheduler=Scheduler(count="linear", score="confidence"), block_length=None,
                            cache="exact", attention=BLOCK_CAUSAL),
}


@dataclass
class DiffusionConfig:
    gen_length: int = 128
    #: Semi-autoregressive block length; None = one block of gen_length (or, with
    #: block-causal attention, the block size the model was trained with).
    block_length: int | None = 32
    #: Denoising steps over the whole answer, split evenly over the blocks (None = gen_length).
    steps: int | None = None
    scheduler: Scheduler = field(default_factory=Scheduler)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    #: Classifier-free guidance: logits = u + (scale + 1)(c - u), u with the prompt masked.
    cfg_scale: float = 0.0
    cache: str = "none"
    #: None = the model's own (what it was trained with).
    attention: str | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.gen_length < 1:
            raise BlockspecError(f"gen_length must be >= 1, got {self.gen_length}")
        if self.block_length is not None and self.block_length < 1:
            raise BlockspecError(f"block_length must be >= 1 (or None: one block), got {self.block_length}")
        if self.steps is not None and self.steps < 1:
            raise BlockspecError(f"steps must be >= 1 (or None: one per answer token), got {self.steps}")
        if self.cache not in CACHE_MODES:
            raise BlockspecError(f"unknown cache {self.cache!r}: choose one of {', '.join(CACHE_MODES)}")
        if self.attention not in (None, BIDIRECTIONAL, BLOCK_CAUSAL):
            raise BlockspecError(f"unknown attention {self.attention!r}: {BIDIRECTIONAL} or {BLOCK_CAUSAL}")
        if self.cfg_scale < 0:
            raise BlockspecError(f"cfg_scale must be >= 0, got {self.cfg_scale}")
        if self.cfg_scale > 0 and self.cache != "none":
            raise BlockspecError("classifier-free guidance runs without a cache: pass --cache none")
        SamplingConfig(self.temperature, self.top_p, self.top_k)  # validates them

    @classmethod
    def preset(cls, name: str, **overrides) -> "DiffusionConfig":
        if name not in SAMPLER_PRESETS:
            raise BlockspecError(f"unknown sampler {name!r}: choose one of {', '.join(SAMPLER_PRESETS)}")
        values = dict(SAMPLER_PRESETS[name])
        values.update({key: value for key, value in overrides.items() if value is not None})
        return cls(**values)


@dataclass
class Layout:
    """Where things are in the [B, prompt + gen_length] canvas (prompts left-padded)."""

    prompt_length: int
    gen_length: int
    block_length: int
    steps_per_block: int
    attention: str
    shift: int

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def block(self, index: int) -> tuple[int, int]:
        start = self.prompt_length + index * self.block_length
        return start, start + self.block_length


def make_layout(model, config: DiffusionConfig, prompt_length: int) -> Layout:
    attention = config.attention or getattr(model, "attention", BIDIRECTIONAL)
    block_length = config.block_length
    if block_length is None:
        trained = getattr(model, "block_size", None)
        block_length = int(trained) if attention == BLOCK_CAUSAL and trained else config.gen_length
    block_length = min(block_length, config.gen_length)
    if config.gen_length % block_length:
        raise BlockspecError(f"gen_length {config.gen_length} is not a multiple of block_length {block_length}")
    num_blocks = config.gen_length // block_length
    steps = config.steps or config.gen_length
    if steps % num_blocks:
        raise BlockspecError(f"steps {steps} must be a multiple of the number of blocks ({num_blocks} = "
                             f"gen_length {config.gen_length} / block_length {block_length})")
    if config.cache == "exact" and attention != BLOCK_CAUSAL:
        raise BlockspecError("the exact block cache needs block-causal attention (a model trained with "
                             "--attention block_causal, or --attention block_causal)")
    if config.cache in ("prefix", "dual") and attention == BLOCK_CAUSAL:
        raise BlockspecError("with block-causal attention the exact cache is free of error: use --cache exact")
    shift = 1 if getattr(model, "shifted", False) else 0
    return Layout(prompt_length, config.gen_length, block_length, steps // num_blocks, attention, shift)


# ---------------------------------------------------------------------------
# Candidate tokens
# ---------------------------------------------------------------------------

def candidate_tokens(logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None):
    """A token for every position of logits [B, N, V] and the distribution it came from.

    Sampling is Gumbel-max computed in float64 (LLaDA: float32 Gumbel noise measurably
    lowers the quality of low-temperature samples).
    """
    if sampling.greedy:
        return logits.argmax(dim=-1), torch.softmax(logits.float(), dim=-1)
    probs = sampling_probs(logits, sampling)
    uniform = torch.rand(probs.shape, generator=generator, dtype=torch.float64).to(probs.device)
    gumbel = -torch.log(-torch.log(uniform.clamp(1e-300, 1.0 - 1e-16)))
    tokens = (torch.log(probs.double()) + gumbel).argmax(dim=-1)
    return tokens, probs


# ---------------------------------------------------------------------------
# Stops: the one place that decides where an answer ends
# ---------------------------------------------------------------------------

def answer_end(tokens: list[int], stop_ids: set[int]) -> int | None:
    """Index just past the first stop token of an answer, or None if it has none."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return index + 1
    return None


# ---------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------

@dataclass
class DiffusionStep:
    block: int
    step: int
    #: Positions (into the answer) each row committed at this step.
    committed: list[list[int]]
    canvas: torch.LongTensor  # [B, gen_length], MASK where not yet committed


@dataclass
class DiffusionStats:
    forwards: int = 0
    #: Positions fed through the model, summed over forwards and rows (the compute the caches save).
    fed_positions: int = 0
    steps: int = 0
    seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)  # per row, after the stop
    commits_per_step: list[list[int]] = field(default_factory=list)  # per step, per row
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards_per_token(self) -> float:
        total = sum(self.tokens)
        return self.forwards * len(self.tokens) / total if total else float("nan")

    def to_dict(self) -> dict:
        return {"forwards": self.forwards, "fed_positions": self.fed_positions, "steps": self.steps,
                "seconds": round(self.seconds, 4),
                "tokens": self.tokens, "tokens_per_s": round(self.tokens_per_s, 2),
                "forwards_per_token": round(self.forwards_per_token, 4), "finish_reasons": self.finish_reasons}


class DiffusionStream:
    """Iterate to run: yields a ``DiffusionStep`` per denoising step; then read ``token_ids``."""

    def __init__(self, model, prompts: list[list[int]], config: DiffusionConfig,
                 eos_token_ids: tuple[int, ...] = ()):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise BlockspecError("every prompt needs at least one token")
        self.model, self.config = model, config
        self.mask_id = int(model.mask_token_id)
        self.stop_ids = set(eos_token_ids) | set(config.stop_token_ids)
        self.layout = make_layout(model, config, max(len(p) for p in prompts))
        _check_context(model, self.layout)
        self.sampling = SamplingConfig(config.temperature, config.top_p, config.top_k)
        self.generator = torch.Generator().manual_seed(config.seed if config.seed is not None else 0)
        if config.seed is None:
            self.generator.seed()
        self._build_canvas(prompts)
        self.stats = DiffusionStats()
        self.token_ids: list[list[int]] = []

    def _build_canvas(self, prompts):
        layout, device = self.layout, self.model.device
        total = layout.prompt_length + layout.gen_length
        self.ids = torch.full((len(prompts), total), self.mask_id, dtype=torch.long, device=device)
        self.valid = torch.ones_like(self.ids, dtype=torch.bool)
        self.prompt_mask = torch.zeros_like(self.valid)
        for row, prompt in enumerate(prompts):
            pad = layout.prompt_length - len(prompt)
            self.ids[row, pad:layout.prompt_length] = torch.tensor(prompt, device=device)
            self.valid[row, :pad] = False
            self.prompt_mask[row, pad:layout.prompt_length] = True
        self.positions = (self.valid.long().cumsum(dim=1) - 1).clamp(min=0)
        self.active = torch.ones(len(prompts), dtype=torch.bool, device=device)
        # Which block each position belongs to, for block-causal attention: the prompt is block 0.
        prompt_end = torch.tensor([layout.prompt_length], device=device)
        self.block_of = answer_blocks(prompt_end, total, layout.block_length)[0]

    # --- running -----------------------------------------------------------------------

    def __iter__(self):
        started = time.perf_counter()
        with torch.inference_mode():
            self.cache = None
            if self.config.cache == "exact":
                self._start_exact_cache()
            for block in range(self.layout.num_blocks):
                yield from self._denoise_block(block)
                if self.config.cache == "exact":
                    self._cache_finished_block(block)
                self._apply_stops(last_block=block == self.layout.num_blocks - 1)
                if not bool(self.active.any()):
                    break
        self.stats.seconds = time.perf_counter() - started
        self._collect_answers()

    def _denoise_block(self, block: int):
        layout, scheduler = self.layout, self.config.scheduler
        start, end = layout.block(block)
        masked = (self.ids[:, start:end] == self.mask_id) & self.active[:, None]
        planned = scheduler.planned_counts(masked.sum(dim=1), layout.steps_per_block)
        step = 0
        while bool(masked.any()):
            logits = self._block_logits(block, step)
            tokens, probs = candidate_tokens(logits, self.sampling, self.generator)
            commit = scheduler.choose(probs, tokens, masked, step=step, steps=layout.steps_per_block,
                                      planned=planned, generator=self.generator)
            self.ids[:, start:end] = torch.where(commit, tokens, self.ids[:, start:end])
            masked &= ~commit
            self.stats.steps += 1
            self.stats.commits_per_step.append(commit.sum(dim=1).tolist())
            offset = start - layout.prompt_length
            committed = [(row.nonzero().flatten() + offset).tolist() for row in commit]
            yield DiffusionStep(block, step, committed, self.ids[:, layout.prompt_length:].clone())
            step += 1

    def _apply_stops(self, last_block: bool) -> None:
        """Rows whose finished blocks hold a stop token are done; their remaining blocks are skipped."""
        for row in self.active.nonzero().flatten().tolist():
            answer = self.ids[row, self.layout.prompt_length:].tolist()
            done_upto = self._finished_length(row)
            if answer_end(answer[:done_upto], self.stop_ids) is not None:
                self.active[row] = False
                self.ids[row, self.layout.prompt_length + done_upto:] = self._filler()
        if last_block:
            self.active[:] = False

    def _finished_length(self, row: int) -> int:
        answer = self.ids[row, self.layout.prompt_length:]
        still_masked = (answer == self.mask_id).nonzero()
        return int(still_masked[0]) if len(still_masked) else answer.numel()

    def _filler(self) -> int:
        return min(self.stop_ids) if self.stop_ids else self.mask_id

    def _collect_answers(self) -> None:
        self.token_ids, self.stats.tokens, self.stats.finish_reasons = [], [], []
        for row in range(self.ids.shape[0]):
            answer = self.ids[row, self.layout.prompt_length:].tolist()
            end = answer_end(answer, self.stop_ids)
            kept = answer if end is None else answer[:end]
            self.token_ids.append(kept)
            self.stats.tokens.append(len(kept))
            self.stats.finish_reasons.append("length" if end is None else "stop")

    # --- forwards ------------------------------------------------------------------------

    def _block_logits(self, block: int, step: int) -> torch.Tensor:
        """Logits [B, block_length, V] for the current block's positions."""
        mode = self.config.cache
        if mode == "none":
            return self._uncached_logits(block)
        if mode == "exact":
            return self._exact_cached_logits(block)
        if step == 0:
            return self._refresh_block_cache(block)
        return self._approximate_cached_logits(block)

    def _forward(self, start: int, end: int, keep: torch.Tensor, cache=None, visible=None,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
        """Feed canvas positions [start, end) after ``cache``; logits at the ``keep`` fed positions."""
        ids = self.ids[:, start:end] if ids is None else ids
        if visible is None:
            visible = self._key_visibility(start, end, cache)
        self.stats.forwards += 1
        self.stats.fed_positions += ids.numel()
        return self.model.logits(ids, position_ids=self.positions[:, start:end], attention_mask=visible,
                                 cache=cache, keep=keep)

    def _key_visibility(self, start: int, end: int, cache) -> torch.Tensor:
        """[B, 1, Q, K]: every fed query sees every non-padding key (cache first, then the fed ones)."""
        keys = self.valid[:, start:end] if cache is None else torch.cat([self.cache_valid, self.valid[:, start:end]], 1)
        queries = self.valid[:, start:end]
        # A padding query sees everything, so that no attention row is empty; its output is never read.
        return (keys[:, None, :] | ~queries[:, :, None])[:, None]

    def _read_window(self, block: int, fed_start: int) -> torch.Tensor:
        start, end = self.layout.block(block)
        shift = self.layout.shift
        return torch.arange(start - shift - fed_start, end - shift - fed_start, device=self.ids.device)

    def _uncached_logits(self, block: int) -> torch.Tensor:
        _, end = self.layout.block(block)
        if self.layout.attention == BLOCK_CAUSAL:
            keep = self._read_window(block, 0)
            return self._forward(0, end, keep, visible=self._block_causal_visibility(end))
        total = self.ids.shape[1]
        keep = self._read_window(block, 0)
        if self.config.cfg_scale > 0:
            return self._guided_logits(total, keep)
        return self._forward(0, total, keep)

    def _block_causal_visibility(self, end: int) -> torch.Tensor:
        blocks = self.block_of[:end]
        causal = block_causal_mask(blocks, blocks)
        valid = self.valid[:, :end]
        return ((causal[None] & valid[:, None, :]) | ~valid[:, :, None])[:, None]

    def _guided_logits(self, total: int, keep: torch.Tensor) -> torch.Tensor:
        """LLaDA's classifier-free guidance: the unconditional branch has its prompt masked."""
        unconditional = self.ids.masked_fill(self.prompt_mask, self.mask_id)
        both = torch.cat([self.ids, unconditional])
        visible = self._key_visibility(0, total, None)
        self.stats.forwards += 1
        self.stats.fed_positions += both.numel()
        logits = self.model.logits(both, position_ids=self.positions.repeat(2, 1),
                                   attention_mask=visible.repeat(2, 1, 1, 1), cache=None, keep=keep)
        conditional, unconditional_logits = logits.chunk(2)
        scale = self.config.cfg_scale
        return unconditional_logits + (scale + 1) * (conditional - unconditional_logits)

    # --- Fast-dLLM's approximate caches -------------------------------------------------

    def _refresh_block_cache(self, block: int) -> torch.Tensor:
        """A full forward that also fills the cache for the rest of this block's steps."""
        start, end = self.layout.block(block)
        shift = self.layout.shift
        total = self.ids.shape[1]
        full = self._new_cache()
        logits = self._forward(0, total, self._read_window(block, 0), cache=full,
                               visible=self._key_visibility(0, total, None))
        # Fed each step: the block, and for a shifted model the position left of it, which
        # predicts the block's first token.
        left, right = start - shift, end
        if self.config.cache == "prefix":
            full.crop(-(total - left))
            self.cache, self.cache_valid = full, self.valid[:, :left]
        else:
            self.cache = self._cache_without(full, left, right)
            self.cache_valid = torch.cat([self.valid[:, :left], self.valid[:, right:]], dim=1)
        return logits

    def _approximate_cached_logits(self, block: int) -> torch.Tensor:
        start, end = self.layout.block(block)
        shift = self.layout.shift
        fed_end = self.ids.shape[1] if self.config.cache == "prefix" else end
        fed_start = start - shift
        logits = self._forward(fed_start, fed_end, self._read_window(block, fed_start), cache=self.cache)
        self.cache.crop(-(fed_end - fed_start))
        return logits

    def _new_cache(self) -> DynamicCache:
        return self.model.new_cache()

    def _cache_without(self, cache: DynamicCache, left: int, right: int) -> DynamicCache:
        """A cache of the positions outside [left, right) (key order: left part, then right part)."""
        kept = self._new_cache()
        for index, layer in enumerate(cache.layers):
            keys = torch.cat([layer.keys[:, :, :left], layer.keys[:, :, right:]], dim=2)
            values = torch.cat([layer.values[:, :, :left], layer.values[:, :, right:]], dim=2)
            kept.update(keys, values, index)
        return kept

    # --- block diffusion's exact cache -----------------------------------------------------

    def _start_exact_cache(self) -> None:
        """Feed the prompt (block 0) into the cache; for a shifted model keep its last logits."""
        length = self.layout.prompt_length
        self.cache, self.cache_valid = self._new_cache(), self.valid[:, :0]
        self.head_logits = self._forward(0, length, torch.tensor([length - 1], device=self.ids.device),
                                         cache=self.cache)
        self.cache_valid = self.valid[:, :length]

    def _cache_finished_block(self, block: int) -> None:
        start, end = self.layout.block(block)
        keep = torch.tensor([end - start - 1], device=self.ids.device)
        self.head_logits = self._forward(start, end, keep, cache=self.cache)
        self.cache_valid = self.valid[:, :end]

    def _exact_cached_logits(self, block: int) -> torch.Tensor:
        start, end = self.layout.block(block)
        shift = self.layout.shift
        logits = self._forward(start, end, torch.arange(end - start - shift, device=self.ids.device),
                               cache=self.cache)
        self.cache.crop(-(end - start))
        if shift:  # the block's first token is predicted from the last clean position before it
            logits = torch.cat([self.head_logits, logits], dim=1)
        return logits

def _check_context(model, layout: Layout) -> None:
    """The prompt and the whole answer are one canvas: it must fit the model's positions."""
    config = getattr(getattr(model, "model", None), "config", None)
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(context, int) and layout.prompt_length + layout.gen_length > context:
        raise BlockspecError(f"gen_length {layout.gen_length} does not fit: the model's context is {context} tokens "
                             f"and the prompt has {layout.prompt_length}, so at most "
                             f"{max(context - layout.prompt_length, 0)} can be generated")


def diffusion_generate(model, prompts: list[list[int]], config: DiffusionConfig | None = None,
                       eos_token_ids: tuple[int, ...] = ()) -> DiffusionStream:
    """A stream that denoises answers to ``prompts`` (lists of token ids) when iterated."""
    return DiffusionStream(model, prompts, config or DiffusionConfig(), eos_token_ids)
