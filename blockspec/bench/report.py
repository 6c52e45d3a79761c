"""Benchmark figures: per-dataset, per-method summaries, and the files they are written to.

Speedups are ratios of tokens/s measured on the same prompt in the same run, taken per
prompt first and then summarised (median and mean), never ratios of separate runs.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from pathlib import Path

from blockspec.decoding.sequence import acceptance_by_position
from blockspec.errors import BlockspecError
from blockspec.io import write_text_atomically

BASELINES = ("ar", "hf", "hf-compiled")


def summarize(records: list[dict], methods: list[str]) -> dict:
    """{dataset: {method: figures}}, datasets in first-seen order, plus "all" over every prompt."""
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    groups = {name: [r for r in records if r["dataset"] == name] for name in datasets}
    if len(datasets) > 1:
        groups["all"] = list(records)
    return {name: {method: _figures(rows, method) for method in methods if any(r["method"] == method for r in rows)}
            for name, rows in groups.items()}


def _verify_widths(record: dict) -> list[int]:
    """Tokens per verify forward; records written before ``verified`` existed give drafts + 1."""
    return record.get("verified") or [d + 1 for d in record["drafted"]]


def _figures(rows: list[dict], method: str) -> dict:
    mine = [r for r in rows if r["method"] == method]
    steps = [n for r in mine for n in r["acceptance_lengths"]]
    tokens, seconds = sum(r["new_tokens"] for r in mine), sum(r["seconds"] for r in mine)
    figures = {
        "prompts": len(mine),
        "new_tokens": tokens,
        "tau": sum(steps) / len(steps) if steps else 0.0,
        "tau_per_prompt_mean": _mean([r["tau"] for r in mine]),
        "tau_histogram": {str(k): v for k, v in sorted(Counter(steps).items())},
        "verify_width_histogram": {str(k): v for k, v in sorted(Counter(
            w for r in mine for w in _verify_widths(r)).items())},
        "acceptance_by_position": acceptance_by_position([n for r in mine for n in r["drafted"]],
                                                         [n for r in mine for n in r["accepted"]]),
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "tokens_per_s_per_prompt_mean": _mean([r["tokens_per_s"] for r in mine]),
        "time_to_first_token_mean": _mean([r["time_to_first_token"] for r in mine]),
        "peak_memory_mib": max((r["peak_memory_mib"] for r in mine), default=0.0),
        **_step_times(mine, len(steps)),
        "mismatches": sum(r.get("matches_reference") is False and not r.get("cross_path") for r in mine),
        "cross_path_differences": sum(r.get("matches_reference") is False and bool(r.get("cross_path"))
                                      for r in mine),
        "checked": sum(r.get("matches_reference") is not None for r in mine),
    }
    for baseline in BASELINES:
        ratios = per_prompt_speedups(rows, method, baseline)
        figures[f"speedup_vs_{baseline}_median"] = statistics.median(ratios) if ratios else None
        figures[f"speedup_vs_{baseline}_mean"] = _mean(ratios) if ratios else None
    return figures


def _step_times(records: list[dict], steps: int) -> dict:
    """Where a decode step's time goes: drafting and verifying, in total, per step, and the drafter's share
    (zeros for methods that do not say, and records written before these were kept)."""
    draft = sum(r.get("draft_seconds", 0.0) for r in records)
    verify = sum(r.get("verify_seconds", 0.0) for r in records)
    return {"draft_seconds": draft, "verify_seconds": verify,
            "draft_ms_per_step": 1000 * draft / steps if steps and draft else 0.0,
            "verify_ms_per_step": 1000 * verify / steps if steps and verify else 0.0,
            "draft_share": draft / (draft + verify) if draft + verify > 0 else 0.0}


def per_prompt_speedups(rows: list[dict], method: str, baseline: str) -> list[float]:
    """tokens/s of ``method`` over ``baseline``'s, prompt by prompt (prompts both decoded)."""
    base = {r["id"]: r["tokens_per_s"] for r in rows if r["method"] == baseline}
    return [r["tokens_per_s"] / base[r["id"]] for r in rows
            if r["method"] == method and base.get(r["id"], 0) > 0 and r["tokens_per_s"] > 0]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def markdown_table(summary: dict) -> str:
    header = ("| dataset | method | prompts | tau | tok/s | speedup vs ar (median / mean) "
              "| speedup vs hf (median / mean) | speedup vs hf-compiled (median / mean) | TTFT ms "
              "| draft / verify ms per step (draft share) | peak MiB | same tokens as ar |")
    lines = [header, "|" + "---|" * 12]
    for dataset, methods in summary.items():
        for method, f in methods.items():
            lines.append(f"| {dataset} | {method} | {f['prompts']} | {f['tau']:.2f} | {f['tokens_per_s']:.1f} "
                         f"| {_ratio_pair(f, 'ar')} | {_ratio_pair(f, 'hf')} | {_ratio_pair(f, 'hf-compiled')} "
                         f"| {f['time_to_first_token_mean'] * 1000:.0f} | {_step_split(f)} "
                         f"| {f['peak_memory_mib']:.0f} | {_check(f)} |")
    return "\n".join(lines) + "\n"


def _step_split(figures: dict) -> str:
    if not figures.get("verify_ms_per_step"):
        return "-"  # a loop that does not say (HF generate)
    if not figures.get("draft_ms_per_step"):
        return f"- / {figures['verify_ms_per_step']:.1f}"  # no drafter
    return (f"{figures['draft_ms_per_step']:.1f} / {figures['verify_ms_per_step']:.1f} "
            f"({100 * figures['draft_share']:.0f}%)")


def _ratio_pair(figures: dict, baseline: str) -> str:
    median, mean = figures.get(f"speedup_vs_{baseline}_median"), figures.get(f"speedup_vs_{baseline}_mean")
    return "-" if median is None else f"{median:.2f}x / {mean:.2f}x"


def _check(figures: dict) -> str:
    if not figures["checked"]:
        return "-"
    across = figures.get("cross_path_differences", 0)
    same = figures["checked"] - figures["mismatches"] - across
    return f"{same}/{figures['checked']}" + (f" ({across} across kernels)" if across else "")


def markdown_report(run: dict, summary: dict) -> str:
    config, env = run["config"], run["environment"]
    mode = "greedy" if config["temperature"] == 0 else f"temperature {config['temperature']}"
    lines = [
        f"# blockspec bench: {run['target']}",
        "",
        f"{mode}, up to {config['max_new_tokens']} new tokens, block size {config['block_size'] or 'drafter default'}; "
        f"{env['device']} ({env['dtype']}), {env['torch_threads']} threads, torch {env['torch']}, "
        f"transformers {env['transformers']}; {run['seconds']:.0f} s.",
        "",
    ]
    if run["interrupted"]:
        lines += ["**Interrupted**: the figures cover the prompts finished before Ctrl-C.", ""]
    lines.append(markdown_table(summary))
    if run["mismatches"]:
        lines += ["", f"**{run['mismatches']} decode(s) differ from ar's tokens** (greedy must be lossless):", ""]
        lines += [f"- {r['method']} on {r['id']}: turn {r['first_mismatch']['turn']}, "
                  f"token {r['first_mismatch']['position']}" for r in run["records"]
                  if r["matches_reference"] is False and not r.get("cross_path")]
    across = [r for r in run["records"] if r["matches_reference"] is False and r.get("cross_path")]
    if across:
        lines += ["", f"{len(across)} decode(s) through Hugging Face's own forward part from ar's tokens; the eager "
                  "target's logit margin between its top two tokens where they part (a near tie that float "
                  "rounding across kernels can flip):", ""]
        lines += [f"- {r['method']} on {r['id']}: turn {r['first_mismatch']['turn']}, token "
                  f"{r['first_mismatch']['position']}, margin {r['first_mismatch'].get('logit_margin', 0.0):.4f}"
                  for r in across]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


def write_outputs(run, out_dir, *, plots: bool = True) -> dict[str, Path]:
    """results.json, results.md and (with ``plots``) the PNG figures; their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = run.to_dict() if hasattr(run, "to_dict") else run
    summary = summarize(data["records"], data["methods"])
    data = {**data, "summary": summary}
    paths = {"json": out / "results.json", "markdown": out / "results.md"}
    write_text_atomically(paths["json"], json.dumps(data, indent=1) + "\n")
    write_text_atomically(paths["markdown"], markdown_report(data, summary))
    if plots and data["records"]:
        from blockspec.bench.plots import write_plots

        paths.update(write_plots(summary, out))
    return paths


def load_results(path) -> dict:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise BlockspecError(f"{path} does not exist: pass a results.json written by blockspec bench") from None
    except json.JSONDecodeError as error:
        raise BlockspecError(f"{path} is not valid JSON ({error.msg}): pass a results.json from blockspec "
                             "bench") from None
    if not isinstance(data, dict) or "records" not in data or "methods" not in data:
        raise BlockspecError(f"{path} is not a blockspec bench result (no 'records' / 'methods')")
    return data


# --------------------------------------------------------------------------------------
# Two runs side by side
# --------------------------------------------------------------------------------------


def compare_runs(first: dict, second: dict, labels=("A", "B")) -> str:
    """A Markdown table of the (dataset, method) pairs in either run, A's figures beside B's."""
    a = summarize(first["records"], first["methods"])
    b = summarize(second["records"], second["methods"])
    la, lb = labels
    lines = [f"A = {la} ({first.get('target')}, {first.get('started', '')})",
             f"B = {lb} ({second.get('target')}, {second.get('started', '')})", "",
             "| dataset | method | tau A | tau B | tok/s A | tok/s B | B/A tok/s "
             "| speedup vs ar A | speedup vs ar B | mismatches A | mismatches B |",
             "|" + "---|" * 11]
    for dataset in dict.fromkeys(list(a) + list(b)):
        for method in dict.fromkeys(list(a.get(dataset, {})) + list(b.get(dataset, {}))):
            fa, fb = a.get(dataset, {}).get(method), b.get(dataset, {}).get(method)
            ratio = (fb["tokens_per_s"] / fa["tokens_per_s"]) if fa and fb and fa["tokens_per_s"] > 0 else None
            lines.append(f"| {dataset} | {method} | {_num(fa, 'tau')} | {_num(fb, 'tau')} "
                         f"| {_num(fa, 'tokens_per_s', 1)} | {_num(fb, 'tokens_per_s', 1)} "
                         f"| {'-' if ratio is None else f'{ratio:.2f}x'} "
                         f"| {_num(fa, 'speedup_vs_ar_median', suffix='x')} "
                         f"| {_num(fb, 'speedup_vs_ar_median', suffix='x')} "
                         f"| {_num(fa, 'mismatches', 0)} | {_num(fb, 'mismatches', 0)} |")
    return "\n".join(lines) + "\n"


def _num(figures: dict | None, key: str, digits: int = 2, suffix: str = "") -> str:
    if figures is None or figures.get(key) is None:
        return "-"
    value = figures[key]
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:.{digits}f}{suffix}"
