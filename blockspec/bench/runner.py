"""The benchmark loop: every method on every prompt, interleaved, after a warm-up.

Methods run one after another on the same prompt (their order rotated from prompt to
prompt, so no method always runs first), so that slow drifts of the machine hit them all
alike. Multi-turn prompts (MT-Bench) are decoded turn by turn, each method continuing its
own conversation. In greedy runs every method's tokens are compared with ``ar``'s.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from blockspec.decoding.sequence import GenerationConfig
from blockspec.errors import BlockspecError
from blockspec.tokens import encode_prompt

REFERENCE_METHOD = "ar"


@dataclass(frozen=True)
class BenchConfig:
    #: How every method decodes (its block size goes to the drafting methods only; None: each
    #: drafter's default); the stop ids are the target's.
    generation: GenerationConfig = GenerationConfig(max_new_tokens=128, seed=0)
    #: New tokens per method in the warm-up decode (0: no warm-up).
    warmup_tokens: int = 16
    use_chat_template: bool = True
    #: Decode at most this many turns of a multi-turn prompt (None: all).
    max_turns: int | None = None

    def __post_init__(self):
        if self.warmup_tokens < 0:
            raise BlockspecError(f"warmup_tokens must be >= 0, got {self.warmup_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise BlockspecError(f"max_turns must be >= 1, got {self.max_turns}")

    @property
    def greedy(self) -> bool:
        return self.generation.sampling.greedy

    def generation_config(self, stop_token_ids, *, drafting: bool = True) -> GenerationConfig:
        return replace(self.generation, block_size=self.generation.block_size if drafting else None,
                       stop_token_ids=tuple(stop_token_ids))

    def to_dict(self) -> dict:
        """Flat, as results.json records it: the decoding settings beside the benchmark's own."""
        settings = asdict(self)
        return {**settings.pop("generation"), **settings}


@dataclass
class BenchRun:
    """Everything a run measured: one record per (prompt, method), in the order decoded."""

    config: BenchConfig
    methods: list[str]
    target: str
    environment: dict
    records: list[dict] = field(default_factory=list)
    interrupted: bool = False
    started: str = ""
    seconds: float = 0.0

    @property
    def mismatches(self) -> list[dict]:
        """Decodes whose tokens differ from ar's through the same forward: a loss of losslessness."""
        return [r for r in self.records if r.get("matches_reference") is False and not r.get("cross_path")]

    @property
    def cross_path_differences(self) -> list[dict]:
        """Decodes through another forward (HF's) whose tokens differ from ar's, each with the target's logit
        margin where they part: float rounding across kernels can flip a near tie."""
        return [r for r in self.records if r.get("matches_reference") is False and r.get("cross_path")]

    def to_dict(self) -> dict:
        return {"target": self.target, "methods": self.methods, "config": self.config.to_dict(),
                "environment": self.environment, "started": self.started, "seconds": self.seconds,
                "interrupted": self.interrupted, "mismatches": len(self.mismatches),
                "cross_path_differences": len(self.cross_path_differences), "records": self.records}


def run_benchmark(target, methods, prompts: list[dict], config: BenchConfig, *, progress: bool = True) -> BenchRun:
    """Decode every prompt with every method. Ctrl-C stops early and returns what was done
    (``interrupted`` set), so that the caller can still write it out."""
    from tqdm.auto import tqdm

    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise BlockspecError(f"a method is listed twice: {names}")
    if not prompts:
        raise BlockspecError("the benchmark has no prompts: check --datasets / --prompts / --num-prompts")
    run = BenchRun(config=config, methods=names, target=target.name, environment=environment(target),
                   started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    start = time.perf_counter()
    bar = tqdm(prompts, desc="bench", unit="prompt", disable=not progress, dynamic_ncols=True)
    try:
        if config.warmup_tokens:
            _warm_up(target, methods, prompts, config)
        for index, row in enumerate(bar):
            order = methods[index % len(methods):] + methods[: index % len(methods)]
            decoded = {m.name: _decode_conversation(target, m, row, config) for m in order}
            reference = decoded.get(REFERENCE_METHOD)
            records = [_record(target, row, m, decoded[m.name], reference, config) for m in methods]
            run.records.extend(records)
            bar.set_postfix_str(_postfix(run.records, names))
    except KeyboardInterrupt:
        run.interrupted = True
    finally:
        bar.close()
        run.seconds = time.perf_counter() - start
    return run


def _warm_up(target, methods, prompts: list[dict], config: BenchConfig) -> None:
    """A short decode per method, and the fast path's graphs for the longest sequence of the run, so that
    first-call costs do not land on the first prompts."""
    short = replace(config, generation=replace(config.generation, max_new_tokens=config.warmup_tokens), max_turns=1)
    for method in methods:
        _decode_conversation(target, method, prompts[0], short)
    longest = max(_longest_sequence(target, row, config) for row in prompts)
    for method in methods:
        if hasattr(method, "warm_up"):
            method.warm_up(longest, config.generation_config(target.stop_token_ids()))


def _longest_sequence(target, row: dict, config: BenchConfig) -> int:
    """Positions a row's conversation can reach: its user turns and a full answer to each."""
    turns = row["turns"][: config.max_turns] if config.max_turns else row["turns"]
    history = [{"role": "user", "content": turn} for turn in turns]
    prompt = encode_prompt(target.tokenizer, history, use_chat_template=config.use_chat_template)
    return len(prompt) + len(turns) * config.generation.max_new_tokens


def _decode_conversation(target, method, row: dict, config: BenchConfig) -> list[dict]:
    """Decode the row's turns one after another; each turn continues this method's own replies."""
    # The block size goes to blockspec's drafters; HF's drafting methods take theirs when built.
    drafting = getattr(method, "drafter", None) is not None
    generation = config.generation_config(target.stop_token_ids(), drafting=drafting)
    turns = row["turns"][: config.max_turns] if config.max_turns else row["turns"]
    history: list[dict] = []
    results = []
    for turn in turns:
        history.append({"role": "user", "content": turn})
        prompt_ids = encode_prompt(target.tokenizer, history, use_chat_template=config.use_chat_template)
        decode = method.decode(prompt_ids, generation)
        reply = target.tokenizer.decode(decode.token_ids, skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        results.append({"prompt_ids": prompt_ids, "decode": decode})
    return results


def _record(target, row: dict, method, turns: list[dict], reference: list[dict] | None,
            config: BenchConfig) -> dict:
    decodes = [t["decode"] for t in turns]
    new_tokens = sum(len(d.token_ids) for d in decodes)
    seconds = sum(d.seconds for d in decodes)
    steps = [n for d in decodes for n in d.acceptance_lengths]
    record = {
        "id": row.get("id"),
        "dataset": row.get("dataset"),
        "method": method.name,
        "turns": len(turns),
        "prompt_tokens": [len(t["prompt_ids"]) for t in turns],
        "prompt_ids": [list(t["prompt_ids"]) for t in turns],
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_s": new_tokens / seconds if seconds > 0 else 0.0,
        "time_to_first_token": decodes[0].time_to_first_token,
        "tau": sum(steps) / len(steps) if steps else 0.0,
        "acceptance_lengths": steps,
        "drafted": [n for d in decodes for n in d.drafted],
        "accepted": [n for d in decodes for n in d.accepted],
        "verified": [n for d in decodes for n in d.verified],
        "draft_seconds": sum(d.draft_seconds for d in decodes),
        "verify_seconds": sum(d.verify_seconds for d in decodes),
        "peak_memory_mib": max(d.peak_memory_mib for d in decodes),
        "finish_reasons": [d.finish_reason for d in decodes],
        "token_ids": [d.token_ids for d in decodes],
        "matches_reference": None,
        "first_mismatch": None,
        "cross_path": getattr(method, "cross_path", False),
    }
    if config.greedy and reference is not None:
        mismatch = first_mismatch([t["decode"].token_ids for t in reference], record["token_ids"])
        if mismatch is not None and record["cross_path"]:
            turn = reference[mismatch["turn"]]
            prefix = turn["decode"].token_ids[:mismatch["position"]]
            mismatch["logit_margin"] = logit_margin(target.model, list(turn["prompt_ids"]) + prefix)
        record.update(matches_reference=mismatch is None, first_mismatch=mismatch)
    return record


@torch.inference_mode()
def logit_margin(model, ids: list[int]) -> float:
    """The eager target's margin between its two most likely next tokens after ``ids``."""
    logits = model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def first_mismatch(expected: list[list[int]], actual: list[list[int]]) -> dict | None:
    """Where two multi-turn token sequences first differ ({turn, position}), or None if equal."""
    for turn, (a, b) in enumerate(zip(expected, actual)):
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if position is None and len(a) != len(b):
            position = min(len(a), len(b))
        if position is not None:
            return {"turn": turn, "position": position}
    if len(expected) != len(actual):
        return {"turn": min(len(expected), len(actual)), "position": 0}
    return None


def _postfix(records: list[dict], names: list[str]) -> str:
    parts = []
    for name in names:
        rows = [r for r in records if r["method"] == name]
        tokens, seconds = sum(r["new_tokens"] for r in rows), sum(r["seconds"] for r in rows)
        parts.append(f"{name} {tokens / seconds if seconds else 0:.1f} tok/s")
    return ", ".join(parts)


def environment(target) -> dict:
    """What the figures depend on: versions, threads, device, dtype."""
    import transformers

    from blockspec import __version__

    device = target.model.device
    info = {
        "blockspec": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
        "dtype": str(target.model.dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info
