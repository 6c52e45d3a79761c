"""The diffusion benchmark: accuracy, tokens/s and forwards per token of sampler settings,
beside the AR target on the same prompts, measured in one run.

A setting is written ``SAMPLER[:key=value,...]``, e.g. ``llada:steps=64``,
``fast-dllm:threshold=0.9,cache=dual``, ``dream:score=margin,alg_temp=0.1``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from blockspec.dllm.generate import SAMPLER_PRESETS, DiffusionConfig, diffusion_generate
from blockspec.dllm.schedule import Scheduler
from blockspec.errors import BlockspecError

SCHEDULER_KEYS = {"count": str, "score": str, "select": str, "threshold": float, "alg_temp": float}
CONFIG_KEYS = {"steps": int, "block_length": int, "block": int, "cache": str, "temperature": float,
               "top_p": float, "top_k": int, "cfg_scale": float, "cfg": float, "attention": str}
ALIASES = {"block": "block_length", "cfg": "cfg_scale"}
AR_NAME = "ar (target)"


def default_settings(gen_length: int) -> list[str]:
    """The issue's figure: steps = gen_length, /2, /4, and threshold decoding at 0.9 (without and with a cache)."""
    return [f"llada:steps={gen_length}", f"llada:steps={gen_length // 2}", f"llada:steps={gen_length // 4}",
            "fast-dllm:threshold=0.9,cache=none", "fast-dllm:threshold=0.9,cache=dual"]


def parse_setting(spec: str, gen_length: int, seed: int | None = None) -> DiffusionConfig:
    """A ``DiffusionConfig`` from ``SAMPLER[:key=value,...]``."""
    sampler, _, rest = spec.partition(":")
    if sampler not in SAMPLER_PRESETS:
        raise BlockspecError(f"setting {spec!r}: unknown sampler {sampler!r} (choose {', '.join(SAMPLER_PRESETS)})")
    preset = dict(SAMPLER_PRESETS[sampler])
    scheduler = dataclasses.asdict(preset.pop("scheduler"))
    values = dict(preset, gen_length=gen_length, seed=seed)
    for item in filter(None, rest.split(",")):
        key, equals, raw = item.partition("=")
        key = key.strip()
        kind = SCHEDULER_KEYS.get(key) or CONFIG_KEYS.get(key)
        if not equals or kind is None:
            known = ", ".join(sorted(SCHEDULER_KEYS) + sorted(CONFIG_KEYS))
            raise BlockspecError(f"setting {spec!r}: {item!r} is not key=value with a key among {known}")
        try:
            value = kind(raw.strip())
        except ValueError:
            raise BlockspecError(f"setting {spec!r}: {key} needs a {kind.__name__}, got {raw!r}") from None
        if key in SCHEDULER_KEYS:
            scheduler[key] = value
        else:
            values[ALIASES.get(key, key)] = value
    return DiffusionConfig(scheduler=Scheduler(**scheduler), **values)


# ---------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------

_NUMBER = r"-?\d[\d,]*(?:\.\d+)?"


def final_number(text: str) -> str | None:
    """The answer a gsm8k response gives: \\boxed{N}, else '#### N', else its last number."""
    for pattern in (r"\\boxed\{\s*\$?(" + _NUMBER + r")", r"####\s*\$?(" + _NUMBER + ")"):
        found = re.findall(pattern, text)
        if found:
            return _clean(found[-1])
    numbers = re.findall(_NUMBER, text)
    return _clean(numbers[-1]) if numbers else None


def _clean(number: str) -> str:
    number = number.replace(",", "").rstrip(".")
    return number[:-2] if number.endswith(".0") else number


def is_correct(text: str, gold: str) -> bool:
    """Whether a response's final number equals the gold one (a number, or a solution ending in one)."""
    answer, expected = final_number(text), final_number(gold)
    if answer is None or expected is None:
        return False
    return abs(float(answer) - float(expected)) < 1e-6


# ---------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------

@dataclass
class SettingResult:
    name: str
    prompts: int = 0
    correct: int = 0
    tokens: int = 0
    forwards: int = 0
    seconds: float = 0.0
    samples: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.correct / self.prompts if self.prompts else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.forwards / self.tokens if self.tokens else float("nan")

    def summary(self) -> dict:
        return {"setting": self.name, "prompts": self.prompts, "accuracy": round(self.accuracy, 4),
                "tokens": self.tokens, "forwards": self.forwards, "tokens_per_s": round(self.tokens_per_s, 2),
                "forwards_per_token": round(self.forwards_per_token, 4), "seconds": round(self.seconds, 4)}


def run_setting(model, tokenizer, rows, prompt_ids, name: str, config: DiffusionConfig, *,
                batch_size: int = 1, progress: bool = True) -> SettingResult:
    """Decode every prompt with one sampler setting, ``batch_size`` rows at a time."""
    result = SettingResult(name)
    eos = tuple(i for i in [tokenizer.eos_token_id] if i is not None)
    bar = tqdm(total=len(rows), desc=name, unit="prompt", disable=not progress, dynamic_ncols=True)
    for first in range(0, len(rows), batch_size):
        chunk = prompt_ids[first:first + batch_size]
        stream = diffusion_generate(model, chunk, config, eos_token_ids=eos)
        for _ in stream:
            pass
        result.seconds += stream.stats.seconds
        # A forward over a batch of b rows counts once per row: forwards per token stays per answer.
        result.forwards += stream.stats.forwards * len(chunk)
        for row, answer in zip(rows[first:first + batch_size], stream.token_ids):
            _score(result, row, tokenizer.decode(answer, skip_special_tokens=True), len(answer))
        bar.update(len(chunk))
        bar.set_postfix(acc=f"{result.accuracy:.2f}", tok_s=f"{result.tokens_per_s:.1f}")
    bar.close()
    return result


def run_autoregressive(target_model, tokenizer, rows, prompt_ids, gen_length: int, *,
                       progress: bool = True) -> SettingResult:
    """The AR target through blockspec's own loop (greedy, one forward per token)."""
    from blockspec.decoding.generate import speculative_generate
    from blockspec.decoding.sequence import GenerationConfig

    result = SettingResult(AR_NAME)
    config = GenerationConfig(max_new_tokens=gen_length)
    for row, ids in tqdm(list(zip(rows, prompt_ids)), desc="ar", unit="prompt", disable=not progress,
                         dynamic_ncols=True):
        started = time.perf_counter()
        stream = speculative_generate(target_model, torch.tensor([ids]), None, config)
        for _ in stream:
            pass
        result.seconds += time.perf_counter() - started
        tokens = list(stream.token_ids)
        result.forwards += stream.stats.target_forwards
        _score(result, row, tokenizer.decode(tokens, skip_special_tokens=True), len(tokens))
    return result


def _score(result: SettingResult, row: dict, text: str, length: int) -> None:
    correct = is_correct(text, str(row.get("answer", "")))
    result.prompts += 1
    result.correct += int(correct)
    result.tokens += length
    result.samples.append({"id": row.get("id"), "correct": correct, "tokens": length, "text": text})


def write_report(results: list[SettingResult], out: Path, meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    summary = {"meta": meta, "results": [r.summary() for r in results]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with open(out / "samples.jsonl", "w", encoding="utf-8") as handle:
        for result in results:
            for sample in result.samples:
                handle.write(json.dumps({"setting": result.name, **sample}) + "\n")
    _plot(results, out / "accuracy_vs_speed.png")


def load_report(out: Path, meta: dict) -> list[SettingResult]:
    """The settings an earlier run with the same ``meta`` finished in ``out`` (none if it differs or is absent)."""
    summary_path, samples_path = out / "summary.json", out / "samples.jsonl"
    if not summary_path.exists() or not samples_path.exists():
        return []
    try:
        summary = json.loads(summary_path.read_text())
        samples = [json.loads(line) for line in samples_path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise BlockspecError(f"{out}: the earlier report is not valid JSON ({error}); remove it or drop "
                             "--resume") from None
    if summary.get("meta") != meta:
        raise BlockspecError(f"{out} holds a report made with other options ({summary.get('meta')}); "
                             "use the same options, another --out, or drop --resume")
    results = []
    for entry in summary.get("results", []):
        rows = [{k: v for k, v in sample.items() if k != "setting"} for sample in samples
                if sample.get("setting") == entry["setting"]]
        results.append(SettingResult(entry["setting"], prompts=entry["prompts"],
                                     correct=sum(bool(r["correct"]) for r in rows), tokens=entry["tokens"],
                                     forwards=entry["forwards"], seconds=entry["seconds"], samples=rows))
    return results


def format_table(results: list[SettingResult]) -> str:
    reference = next((r for r in results if r.name == AR_NAME), None)
    lines = [f"{'setting':42s} {'acc':>6s} {'tok/s':>7s} {'fwd/tok':>8s} {'vs AR':>6s}"]
    for result in results:
        ratio = result.tokens_per_s / reference.tokens_per_s if reference and reference.tokens_per_s else float("nan")
        lines.append(f"{result.name:42s} {result.accuracy:6.1%} {result.tokens_per_s:7.1f} "
                     f"{result.forwards_per_token:8.3f} {ratio:5.2f}x")
    return "\n".join(lines)


def _plot(results: list[SettingResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7.5, 4.2))
    for result in results:  # a legend, not labels: settings of equal accuracy and speed would overlap
        marker = "s" if result.name == AR_NAME else "o"
        axis.scatter(result.tokens_per_s, 100 * result.accuracy, marker=marker, s=40, label=result.name)
    top = max((100 * r.accuracy for r in results), default=0.0)
    axis.set_ylim(-0.05 * max(top, 1.0), 1.15 * max(top, 1.0))
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    axis.set_xlabel("tokens / s")
    axis.set_ylabel("gsm8k accuracy (%)")
    axis.set_title("Diffusion sampler settings vs the AR target")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=130)
    plt.close(figure)
