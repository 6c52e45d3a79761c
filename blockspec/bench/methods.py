"""The decoding methods the benchmark compares, each behind one small interface.

A method turns prompt token ids into new token ids and the figures of that one decode.
``ar`` and every drafter go through blockspec's own loop and verifier; the ``hf*`` methods
call Hugging Face ``generate`` as users run it, so the comparison includes its overheads.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from blockspec.clock import wall_clock
from blockspec.decoding.generate import speculative_generate, warm_up_fast_path
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.errors import BlockspecError

#: Methods that need no drafter and no second model.
BASELINES = ("ar", "hf", "hf-compiled", "hf-prompt-lookup")
#: HF's prompt lookup drafts this many tokens per step unless a block size is given (its docs' value).
HF_PROMPT_LOOKUP_TOKENS = 10


@dataclass
class Decode:
    """One method's decode of one prompt turn."""

    token_ids: list[int]
    seconds: float
    time_to_first_token: float
    #: Tokens each target forward after the prefill produced (so tau is their mean).
    acceptance_lengths: list[int]
    #: Per decode step, drafts proposed and accepted (empty for methods that do not say).
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    peak_memory_mib: float = 0.0
    finish_reason: str = ""
    #: Per decode step, tokens the verify forward carried (empty for methods that do not say).
    verified: list[int] = field(default_factory=list)
    #: Decode-phase seconds spent drafting and verifying (0 for methods that do not say).
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


class LoopMethod:
    """blockspec's loop: autoregressive without a drafter, speculative with one."""

    def __init__(self, name: str, model, drafter=None, block_size: int | str | None = None,
                 tree_budget: int | None = None):
        self.name = name
        self.model = model
        self.drafter = drafter
        #: This method's own verify width (``dflash@8``, ``dflash@auto``) or tree budget
        #: (``dflash@t32``), over the run's.
        self.block_size = block_size
        self.tree_budget = tree_budget
        #: With an adaptive width: its calibration, carried over this method's prompts.
        self.width_policies = WidthPolicies()

    def decode(self, prompt_ids, config):
        config = self._config(config)
        with MemoryMeter(self.model.device) as memory:
            stream = speculative_generate(self.model, torch.tensor([prompt_ids]), self.drafter, config,
                                          width_policies=self.width_policies)
            for _ in stream:
                pass
        stats = stream.stats
        return Decode(list(stream.token_ids), stats.total_time, stats.time_to_first_token,
                      list(stats.acceptance_lengths), list(stats.drafted), list(stats.accepted),
                      memory.peak_mib, stats.finish_reason, list(stats.verified), stats.draft_seconds,
                      stats.verify_seconds)


    def warm_up(self, longest: int, config: GenerationConfig) -> None:
        """The fast path's graphs for sequences of up to ``longest`` positions (nothing without it)."""
        config = self._config(config)
        warm_up_fast_path(self.model, self.drafter, config, longest - config.max_new_tokens)

    def _config(self, config: GenerationConfig) -> GenerationConfig:
        """The run's config with this method's own verify width or tree budget."""
        if self.block_size is not None:
            config = dataclasses.replace(config, block_size=self.block_size)
        if self.tree_budget is not None:
            config = dataclasses.replace(config, tree_budget=self.tree_budget)
        return config


class HFGenerateMethod:
    """Hugging Face ``generate``: plain, assisted by a draft model, or with prompt lookup."""

    #: It runs the target through Hugging Face's own forward, not blockspec's: its greedy tokens may part
    #: from ar's where float rounding flips a near tie.
    cross_path = True

    def __init__(self, name: str, model, *, pad_token_id: int, assistant=None, prompt_lookup_tokens=None,
                 assistant_tokens=None, compiled: bool = False):
        self.name = name
        self.model = model
        #: HF's own compiled decoding: a static cache and its torch.compile'd forward, the cache sized once
        #: for the run's longest sequence (``warm_up``) so that no prompt compiles again.
        self.compiled = compiled
        self.max_cache_len: int | None = None
        self.pad_token_id = pad_token_id
        self.assistant = assistant
        self.prompt_lookup_tokens = prompt_lookup_tokens
        self.assistant_tokens = assistant_tokens

    def decode(self, prompt_ids, config):
        ids = torch.tensor([prompt_ids], device=self.model.device)
        recorder = StepRecorder(self.model.device)
        with MemoryMeter(self.model.device) as memory, torch.inference_mode():
            recorder.start()
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=recorder,
                                      generation_config=self._generation_config(config),
                                      **self._drafting_options())
            seconds = recorder.elapsed()
        tokens = out[0, ids.shape[1]:].tolist()
        finish = "stop" if tokens and tokens[-1] in config.stop_token_ids else "length"
        # Plain decoding's first step is the prefill's token, which the loop's tau leaves out too;
        # assisted decoding verifies its first draft in the prefill forward itself.
        steps = recorder.step_lengths if self._drafts else recorder.step_lengths[1:]
        return Decode(tokens, seconds, recorder.time_to_first_token, steps,
                      peak_memory_mib=memory.peak_mib, finish_reason=finish)

    def warm_up(self, longest: int, config: GenerationConfig) -> None:
        """Compiled: size the static cache for the run's longest sequence and compile for it now."""
        if self.compiled:
            self.max_cache_len = longest + 1
            self.decode([0] * 8, dataclasses.replace(config, max_new_tokens=4))

    @property
    def _drafts(self) -> bool:
        return self.assistant is not None or self.prompt_lookup_tokens is not None

    def _generation_config(self, config: GenerationConfig):
        from transformers import GenerationConfig as HFGenerationConfig

        sampling = config.sampling
        options = dict(max_new_tokens=config.max_new_tokens, do_sample=not sampling.greedy,
                       eos_token_id=list(config.stop_token_ids) or None, pad_token_id=self.pad_token_id)
        if not sampling.greedy:
            options.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
        if self.assistant_tokens is not None:
            options.update(num_assistant_tokens=self.assistant_tokens, num_assistant_tokens_schedule="constant")
        if self.prompt_lookup_tokens is not None:
            options.update(prompt_lookup_num_tokens=self.prompt_lookup_tokens)
        if self.compiled:
            options.update(cache_implementation="static", compile_config=_compile_everywhere(),
                           max_cache_len=self.max_cache_len)
        return HFGenerationConfig(**options)

    def _drafting_options(self) -> dict:
        return {"assistant_model": self.assistant} if self.assistant is not None else {}


def _compile_everywhere():
    """HF's compile settings for generate, on any device (HF compiles by itself on GPUs only)."""
    from transformers.generation.configuration_utils import CompileConfig

    from blockspec.decoding.compile_policy import configure_inductor

    configure_inductor()  # its compiled graphs are cached beside the fast path's
    config = CompileConfig(mode="default" if not torch.cuda.is_available() else "reduce-overhead", dynamic=False)
    config._compile_all_devices = True
    return config


class StepRecorder:
    """A ``generate`` streamer that records when tokens arrive and how many each step brings.

    ``generate`` first puts the prompt, then the tokens of each step: one per forward when
    decoding plainly, the accepted drafts plus one in assisted generation.
    """

    def __init__(self, device):
        self.device = device
        self.step_lengths: list[int] = []
        self.time_to_first_token = 0.0
        self._start = 0.0
        self._seen_prompt = False

    def start(self) -> None:
        self._start = wall_clock(self.device)

    def elapsed(self) -> float:
        return wall_clock(self.device) - self._start

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        if not self.step_lengths:
            self.time_to_first_token = self.elapsed()
        self.step_lengths.append(int(value.numel()))

    def end(self) -> None:
        pass


class MemoryMeter:
    """Peak memory during a block: CUDA's allocator peak, or on a CPU the process's peak resident set.

    On Linux the kernel's own high-water mark is reset at the start (``/proc/self/clear_refs``) and read
    at the end, so nothing runs beside the decode; elsewhere a thread samples the resident set.
    """

    INTERVAL_S = 0.02
    _STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")

    def __init__(self, device):
        self.device = torch.device(device)
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif not self._reset_high_water_mark():
            import psutil

            self._process = psutil.Process()
            self._peak = self._process.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info):
        if self.device.type == "cuda":
            self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self._thread is None:
            self.peak_mib = self._high_water_mark_kib() / 2**10
        else:
            self._stop.set()
            self._thread.join()
            self.peak_mib = max(self._peak, self._process.memory_info().rss) / 2**20
        return False

    def _reset_high_water_mark(self) -> bool:
        try:
            self._CLEAR.write_text("5")
            return self._high_water_mark_kib() > 0
        except (OSError, ValueError):
            return False

    def _high_water_mark_kib(self) -> int:
        for line in self._STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise ValueError("no VmHWM in /proc/self/status")

    def _sample(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            self._peak = max(self._peak, self._process.memory_info().rss)


@dataclass(frozen=True)
class MethodName:
    """A benchmark method's name taken apart: METHOD[@WIDTH][/dK][/vK]."""

    base: str
    #: After '@': a verify width, 'auto', or t and a tree budget, with '-auto' when the cost model
    #: chooses how many of its nodes to verify (None: the run's width).
    width: str | None = None
    #: After '/d': the dflash drafter's denoising passes.
    denoise_steps: int = 1
    #: After '/v': the dflash drafter drafts over this many tokens only (counted in --draft-vocab-data).
    draft_vocab: int | None = None

    @property
    def drafter(self) -> str:
        """The drafter it runs: METHOD, with /dK when it denoises in K passes and /vK over a K-token vocabulary."""
        return (self.base + ("" if self.denoise_steps == 1 else f"/d{self.denoise_steps}")
                + ("" if self.draft_vocab is None else f"/v{self.draft_vocab}"))


def parse_method_name(name: str) -> MethodName:
    head, *suffixes = name.split("/")
    base, at, width = head.partition("@")
    settings = {}
    for suffix in suffixes:
        key = {"d": "denoise_steps", "v": "draft_vocab"}.get(suffix[:1])
        if key is None or not suffix[1:].isdigit() or int(suffix[1:]) < 1 or key in settings:
            raise BlockspecError(f"benchmark method {name!r}: after '/' give d and the denoising passes >= 1 "
                                 "(dflash/d2) or v and a draft vocabulary size (dflash/v8192), each once")
        settings[key] = int(suffix[1:])
    if settings and base != "dflash":
        raise BlockspecError(f"benchmark method {name!r}: only dflash denoises in passes (/dK) or drafts over a "
                             "reduced vocabulary (/vK)")
    return MethodName(base, width if at else None, **settings)


def parse_width(name: str, width: str) -> int | str:
    """The WIDTH of a METHOD@WIDTH benchmark method: a whole number >= 1 or 'auto'."""
    if width == "auto":
        return width
    if not width.isdigit() or int(width) < 1:
        raise BlockspecError(f"benchmark method {name!r}: after '@' give a verify width >= 1, 'auto', "
                             "or t and a tree budget (dflash@t32)")
    return int(width)


def drafter_method(name: str, width: str | None, model, drafter) -> LoopMethod:
    """A drafter's method with its own verify width or tree budget, if its name gives one."""
    if width is None:
        return LoopMethod(name, model, drafter)
    if width.startswith("t") and width[1:] != "auto":
        budget, _, auto = width[1:].partition("-")
        if auto not in ("", "auto"):
            raise BlockspecError(f"benchmark method {name!r}: a tree is dflash@tN, or dflash@tN-auto for the "
                                 "cost model to choose how many of its N nodes to verify")
        return LoopMethod(name, model, drafter, tree_budget=parse_width(name, budget), block_size=auto or None)
    return LoopMethod(name, model, drafter, block_size=parse_width(name, width))


def build_methods(names, target, *, drafters: dict | None = None, assistant=None,
                  block_size: int | None = None) -> list:
    """Methods by name: the baselines, ``hf-assisted`` (needs ``assistant``, a draft LM), and
    METHOD[@WIDTH][/dK] for any ``MethodName.drafter`` in ``drafters`` (name -> Drafter) through
    blockspec's loop."""
    drafters = drafters or {}
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else (target.stop_token_ids() or [0])[0]
    draft_tokens = block_size - 1 if isinstance(block_size, int) else None  # HF's own default with "auto"
    methods = []
    for name in names:
        if name == "ar":
            methods.append(LoopMethod("ar", target.model))
        elif name == "hf":
            methods.append(HFGenerateMethod("hf", target.model, pad_token_id=pad))
        elif name == "hf-compiled":
            methods.append(HFGenerateMethod(name, target.model, pad_token_id=pad, compiled=True))
        elif name == "hf-prompt-lookup":
            methods.append(HFGenerateMethod(name, target.model, pad_token_id=pad,
                                            prompt_lookup_tokens=draft_tokens or HF_PROMPT_LOOKUP_TOKENS))
        elif name == "hf-assisted":
            if assistant is None:
                raise BlockspecError("hf-assisted needs a draft model: pass --assistant MODEL "
                                     "(a smaller causal LM with the target's tokenizer)")
            methods.append(HFGenerateMethod(name, target.model, pad_token_id=pad, assistant=assistant,
                                            assistant_tokens=draft_tokens))
        elif (spec := parse_method_name(name)).drafter in drafters:
            methods.append(drafter_method(name, spec.width, target.model, drafters[spec.drafter]))
        else:
            known = list(BASELINES) + ["hf-assisted"] + list(drafters)
            raise BlockspecError(f"unknown benchmark method {name!r}: choose from {', '.join(known)}")
    return methods

