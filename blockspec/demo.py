"""The demo: DFlash against plain autoregressive decoding on a few bundled prompts.

For each prompt the target decodes greedily twice through the same loop, once alone (AR)
and once verifying the DFlash drafter's blocks; the DFlash text streams to the terminal,
the two token sequences are compared (they must be identical) and the timings give the
speedup. A table sums the prompts up at the end.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from blockspec.errors import BlockspecError

#: Bundled sets the demo draws from by default; prompts are dealt round-robin over them,
#: so the default four are 2 gsm8k, 1 humaneval and 1 mt_bench.
DEFAULT_DATASETS = ("gsm8k", "humaneval", "mt_bench")
DEFAULT_NUM_PROMPTS = 4
DEFAULT_MAX_NEW_TOKENS = 128
#: The verify width is chosen each step by the cost model, over a 16-node token tree, as in `blockspec generate`.
DEFAULT_BLOCK_SIZE = "auto"
DEFAULT_TREE_BUDGET = 16
_WARMUP_TOKENS = 4


def demo_prompts(datasets=None, num_prompts: int = DEFAULT_NUM_PROMPTS) -> list[dict]:
    """``num_prompts`` bundled rows dealt round-robin over ``datasets``, grouped by dataset."""
    from blockspec.bench.datasets import bundled_name, load_bundled

    if num_prompts < 1:
        raise BlockspecError(f"--num-prompts must be >= 1, got {num_prompts}")
    names = list(dict.fromkeys(bundled_name(d) for d in (datasets or DEFAULT_DATASETS)))
    counts = {name: len(range(i, num_prompts, len(names))) for i, name in enumerate(names)}
    prompts = []
    for name, count in counts.items():
        rows = load_bundled(name, limit=count)
        if len(rows) < count:
            raise BlockspecError(f"the bundled set {name} has only {len(rows)} prompts, {count} were asked for")
        prompts.extend(rows)
    return prompts


def run_demo(target, drafter, prompts, *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             block_size: int | str | None = DEFAULT_BLOCK_SIZE, tree_budget: int | None = None,
             compile: str = "off", console=None) -> list[dict]:
    """Decode each prompt with Hugging Face ``generate`` (eager), AR and DFlash (greedy; the two through
    blockspec's loop, on the fast path with ``compile``), stream the DFlash text; figures per prompt.

    ``prompts`` are bundled rows (dicts with ``turns``; the first turn is used) or strings.
    ``block_size``: a verify width, None for the drafter's trained size, or "auto"; ``tree_budget``: verify
    a token tree of that many nodes (None: a chain).
    """
    from rich.console import Console

    from blockspec.bench.methods import HFGenerateMethod
    from blockspec.decoding.compile_policy import compile_choice
    from blockspec.decoding.policy import AUTO, WidthPolicies
    from blockspec.decoding.sequence import GenerationConfig, resolve_block_size
    from blockspec.models.quantized import quantization_of

    console = console or Console()
    rows = [_as_row(prompt, i) for i, prompt in enumerate(prompts)]
    if not rows:
        raise BlockspecError("the demo needs at least one prompt")
    ar_config = GenerationConfig(max_new_tokens=max_new_tokens, compile=compile,
                                 stop_token_ids=target.stop_token_ids())
    dflash_config = replace(ar_config, block_size=block_size, tree_budget=tree_budget)
    width = resolve_block_size(drafter, block_size)  # checks the block size before any decoding
    described = f"verify width auto (1..{width})" if block_size == AUTO else f"block size {width}"
    if tree_budget:
        described = f"a token tree of {tree_budget} nodes, " + ("the cost model choosing how many to verify"
                                                               if block_size == AUTO else "all verified")

    model = target.model
    path = "fast path" if compile_choice(model, compile)[0] else "eager forward"
    precision = str(model.dtype).removeprefix("torch.")
    if quantization_of(model) != "none":
        precision += f", linear layers on {quantization_of(model)} weights"
    console.print(f"[bold]blockspec demo[/]: target [cyan]{_plain(target.name)}[/] on {model.device} "
                  f"({precision}), blockspec's {path}\n"
                  f"drafter [cyan]{drafter.name}[/], {described}, greedy, up to {max_new_tokens} new tokens; "
                  "against HF generate (eager) and AR through the same loop")
    policies = WidthPolicies()  # the adaptive width's calibration carries over the prompts
    hf = HFGenerateMethod("hf", model, pad_token_id=_pad_id(target))
    longest = max(len(target.encode_prompt(_chat_prompt(target, row))) for row in rows)
    _warm_up(target, drafter, _chat_prompt(target, rows[0]), ar_config, dflash_config, policies, hf, longest)

    figures = []
    for index, row in enumerate(rows, start=1):
        _print_header(console, index, len(rows), row)
        prompt = _chat_prompt(target, row)
        baseline = hf.decode(target.encode_prompt(prompt), ar_config)
        ar = _decode(target, prompt, None, ar_config)
        dflash = _decode(target, prompt, drafter, dflash_config, console=console, width_policies=policies)
        console.print()
        figure = _figures(row, baseline, ar, dflash, block_size if block_size == AUTO else width)
        figures.append(figure)
        _print_figures(console, figure)
    _print_summary(console, figures)
    return figures


def _as_row(prompt, index: int) -> dict:
    if isinstance(prompt, str):
        return {"id": f"prompt/{index}", "dataset": "custom", "turns": [prompt]}
    if isinstance(prompt, dict) and prompt.get("turns"):
        return prompt
    raise BlockspecError(f"demo prompt {index} must be a string or a row with 'turns', not {type(prompt).__name__}")


def _chat_prompt(target, row: dict):
    """The first user turn: a one-message chat when the tokenizer has a template, else the text."""
    text = row["turns"][0]
    if target.tokenizer.chat_template:
        return [{"role": "user", "content": text}]
    return text


def _warm_up(target, drafter, prompt, ar_config, config, width_policies, hf, longest: int) -> None:
    """A few tokens every way, and the fast path's graphs for the longest prompt, so that first-call
    overheads do not land on the first prompt."""
    from blockspec.decoding.generate import warm_up_fast_path
    from blockspec.decoding.text import generate_text

    hf.decode(target.encode_prompt(prompt), replace(ar_config, max_new_tokens=_WARMUP_TOKENS))
    generate_text(target, prompt, None, replace(ar_config, max_new_tokens=_WARMUP_TOKENS))
    generate_text(target, prompt, drafter, replace(config, max_new_tokens=_WARMUP_TOKENS),
                  width_policies=width_policies)
    warm_up_fast_path(target.model, None, ar_config, longest)
    warm_up_fast_path(target.model, drafter, config, longest)


def _pad_id(target) -> int:
    pad = target.tokenizer.pad_token_id
    return pad if pad is not None else (target.stop_token_ids() or [0])[0]


def _decode(target, prompt, drafter, config, console=None, width_policies=None) -> dict:
    """One greedy decode; the wall time excludes the time spent printing the stream."""
    from blockspec.decoding.text import stream_text

    printing = 0.0
    start = time.perf_counter()
    stream = stream_text(target, prompt, drafter, config, width_policies=width_policies)
    for chunk in stream:
        if console is not None and chunk.text:
            before = time.perf_counter()
            console.print(chunk.text, end="", markup=False, highlight=False, emoji=False, soft_wrap=True)
            printing += time.perf_counter() - before
    elapsed = time.perf_counter() - start - printing
    result = stream.result
    return {"token_ids": result.token_ids, "text": result.text, "stats": result.stats, "time": elapsed,
            "prompt_tokens": len(result.prompt_ids)}


def _figures(row: dict, baseline, ar: dict, dflash: dict, block_size: int | str) -> dict:
    ar_ids, dflash_ids = ar["token_ids"], dflash["token_ids"]
    mismatch = next((i for i, (a, b) in enumerate(zip(ar_ids, dflash_ids)) if a != b), None)
    if mismatch is None and len(ar_ids) != len(dflash_ids):
        mismatch = min(len(ar_ids), len(dflash_ids))
    stats = dflash["stats"]
    hf_tokens_per_s = len(baseline.token_ids) / baseline.seconds if baseline.seconds > 0 else 0.0
    ar_tokens_per_s = len(ar_ids) / ar["time"] if ar["time"] > 0 else 0.0
    dflash_tokens_per_s = len(dflash_ids) / dflash["time"] if dflash["time"] > 0 else 0.0
    return {
        "id": row.get("id"),
        "dataset": row.get("dataset"),
        "prompt": row["turns"][0],
        "prompt_tokens": dflash["prompt_tokens"],
        "block_size": block_size,
        "new_tokens": len(dflash_ids),
        "ar_new_tokens": len(ar_ids),
        "tau": stats.tau,
        "acceptance_lengths": list(stats.acceptance_lengths),
        "verify_widths": list(stats.verified),
        "mean_verify_width": statistics.mean(stats.verified) if stats.verified else 0.0,
        "draft_ms_per_step": stats.draft_ms_per_step,
        "verify_ms_per_step": stats.verify_ms_per_step,
        "draft_share": stats.draft_share,
        "ar_time": ar["time"],
        "dflash_time": dflash["time"],
        "hf_tokens_per_s": hf_tokens_per_s,
        "ar_tokens_per_s": ar_tokens_per_s,
        "dflash_tokens_per_s": dflash_tokens_per_s,
        #: DFlash over AR through the same loop and forward, and over HF generate (eager); AR over HF.
        "speedup": dflash_tokens_per_s / ar_tokens_per_s if ar_tokens_per_s > 0 else 0.0,
        "speedup_vs_hf": dflash_tokens_per_s / hf_tokens_per_s if hf_tokens_per_s > 0 else 0.0,
        "ar_vs_hf": ar_tokens_per_s / hf_tokens_per_s if hf_tokens_per_s > 0 else 0.0,
        "hf_same_tokens": baseline.token_ids == list(ar_ids),
        "ar_ttft": ar["stats"].time_to_first_token,
        "dflash_ttft": stats.time_to_first_token,
        "match": mismatch is None,
        "first_mismatch": mismatch,
        "text": dflash["text"],
        "ar_token_ids": list(ar_ids),
        "dflash_token_ids": list(dflash_ids),
    }


def shorten(text: str, width: int = 90) -> str:
    """One line of at most ``width`` characters."""
    line = " ".join(text.split())
    return line if len(line) <= width else line[: width - 1].rstrip() + "…"


def _plain(text: str) -> str:
    from rich.markup import escape

    return escape(str(text))


def _print_header(console, index: int, total: int, row: dict) -> None:
    from rich.text import Text

    console.print()
    console.rule(Text.assemble((f" {index}/{total} ", "bold"), (str(row.get("dataset", "")), "bold magenta"),
                               (f"  {row.get('id', '')} ", "dim")), align="left")
    console.print(Text(shorten(row["turns"][0], max(20, console.width - 2)), style="dim italic"))
    console.print()


def _print_figures(console, figure: dict) -> None:
    if not figure["match"]:
        console.print(f"[bold red]WARNING: the DFlash tokens differ from the AR tokens from token "
                      f"{figure['first_mismatch']} on ({figure['new_tokens']} DFlash tokens, "
                      f"{figure['ar_new_tokens']} AR tokens): decoding was not lossless[/]")
    console.print(
        f"[bold]tau[/] {figure['tau']:.2f}  "
        f"[bold]verify width[/] {figure['mean_verify_width']:.1f} mean  "
        f"[bold]step[/] {figure['draft_ms_per_step']:.1f} ms drafting + {figure['verify_ms_per_step']:.1f} ms "
        f"verifying  "
        f"[bold]tok/s[/] DFlash {figure['dflash_tokens_per_s']:.1f}, AR {figure['ar_tokens_per_s']:.1f}, "
        f"HF {figure['hf_tokens_per_s']:.1f}  "
        f"[bold green]speedup {figure['speedup']:.2f}x over AR, {figure['speedup_vs_hf']:.2f}x over HF[/]  "
        f"[bold]TTFT[/] {figure['dflash_ttft'] * 1000:.0f} ms (AR {figure['ar_ttft'] * 1000:.0f} ms)"
        + ("" if figure["match"] else "  [bold red]MISMATCH[/]")
    )


def _print_summary(console, figures: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="DFlash vs autoregressive, greedy", title_style="bold")
    columns = ("prompt", "tokens", "tau", "verify\nwidth", "draft/verify\nms a step", "HF\ntok/s", "AR\ntok/s",
               "DFlash\ntok/s", "x AR", "x HF", "first token\nms AR/DF", "same")
    for name in columns:
        table.add_column(name, justify="left" if name == "prompt" else "right", no_wrap=name != "prompt")
    for f in figures:
        table.add_row(_plain(f["id"]), str(f["new_tokens"]), f"{f['tau']:.2f}", f"{f['mean_verify_width']:.1f}",
                      f"{f['draft_ms_per_step']:.1f}/{f['verify_ms_per_step']:.1f}", f"{f['hf_tokens_per_s']:.1f}",
                      f"{f['ar_tokens_per_s']:.1f}", f"{f['dflash_tokens_per_s']:.1f}",
                      f"{f['speedup']:.2f}x", f"{f['speedup_vs_hf']:.2f}x",
                      f"{f['ar_ttft'] * 1000:.0f}/{f['dflash_ttft'] * 1000:.0f}",
                      "[green]yes[/]" if f["match"] else "[bold red]NO[/]")
    console.print()
    console.print(table)
    taus = [f["tau"] for f in figures]
    for label, key in (("DFlash over AR (the same loop and forward)", "speedup"),
                       ("DFlash over HF generate (eager)", "speedup_vs_hf"),
                       ("AR over HF generate (eager)", "ar_vs_hf")):
        values = [f[key] for f in figures]
        console.print(f"{label}: mean [bold green]{statistics.mean(values):.2f}x[/], "
                      f"median {statistics.median(values):.2f}x")
    console.print(f"tau: mean [bold]{statistics.mean(taus):.2f}[/], median {statistics.median(taus):.2f}")
    shares = [f["draft_share"] for f in figures]
    console.print(f"drafting's share of a DFlash step: mean [bold]{100 * statistics.mean(shares):.0f}%[/] "
                  f"(the rest verifies)")
    mismatches = sum(not f["match"] for f in figures)
    if mismatches:
        console.print(f"[bold red]WARNING: {mismatches} of {len(figures)} prompts gave DFlash tokens that differ "
                      f"from the AR tokens[/]")
    else:
        console.print(f"[green]DFlash output was token-for-token the AR output on all {len(figures)} prompts[/]")
