"""Fewer bytes a token: the target at fp32 and with --quantize fp16 / int8 / int4, side by side in one process.

Two parts, both printed as tables and written as JSON under --out:

1. Products: each linear layer shape of the target at 1, 4 and 16 rows through every CPU kernel
   there is for it: fp32 oneDNN-packed (the fast path's), fp16 weights through FBGEMM
   (--quantize fp16), blockspec's Q8_0 / Q4_1 weight-only kernel (--quantize int8 / int4),
   PyTorch's int8 and int4 weight-only kernels (what torchao's CPU layouts call), and FBGEMM's int8
   with per-token int8 activations. Medians of --repeats calls.
2. Decoding: every prompt decoded greedily, interleaved prompt by prompt: HF ``generate`` (eager,
   at fp32: the baseline a user runs, and on each quantized model), blockspec AR and DFlash at each
   precision (the same fast path: static cache, compiled width buckets). Each precision's DFlash
   output must equal that precision's AR output token for token; how often a quantized target's
   greedy answer equals the fp32 target's is reported beside it.

    .venv/bin/python benchmarks/quantized_target.py --num-prompts 6 --max-new-tokens 128 \\
        --out benchmarks/results/quantized
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from blockspec.bench.datasets import load_bundled
from blockspec.bench.methods import HFGenerateMethod
from blockspec.decoding.generate import warm_up_fast_path
from blockspec.decoding.policy import WidthPolicies
from blockspec.decoding.sequence import GenerationConfig
from blockspec.decoding.text import generate_text
from blockspec.drafters.registry import build_drafter, shipped_draft
from blockspec.hub import DEFAULT_TARGET
from blockspec.io import write_text_atomically
from blockspec.models.target import load_target
from blockspec.models.weight_only import WeightOnlyLinear

PRECISIONS = ("none", "fp16", "int8", "int4")
ROWS = (1, 4, 16)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    parser.add_argument("--num-prompts", type=int, default=6, help="prompts, dealt round-robin over --datasets")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=16, help="DFlash's token tree (0: a chain)")
    parser.add_argument("--repeats", type=int, default=30, help="calls per product timing")
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=PRECISIONS,
                        help="targets to decode with (none: fp32, always included)")
    parser.add_argument("--skip-products", action="store_true")
    parser.add_argument("--out", default=None, help="write results.json and results.md here")
    return parser.parse_args()


# --- products -------------------------------------------------------------------------------------------

def _median_ms(call, repeats: int) -> float:
    for _ in range(3):
        call()
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def _kernels(weight: torch.Tensor) -> dict:
    """name -> (x -> weight-product) for one weight [N, K]."""
    out_features, in_features = weight.shape
    onednn = weight.to_mkldnn()
    fp16 = torch.ops.quantized.linear_prepack_fp16(weight, None)
    scales = weight.abs().amax(dim=1).clamp_min(1e-12) / 127
    int8 = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        per_channel = torch._make_per_channel_quantized_tensor(int8, scales.double(),
                                                               torch.zeros(out_features, dtype=torch.long), 0)
        fbgemm_int8 = torch.ops.quantized.linear_prepack(per_channel, None)
    group = 32
    grouped = weight.reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1, keepdim=True), grouped.amax(-1, keepdim=True)
    step = (high - low).clamp_min(1e-12) / 15
    int4 = torch.round((grouped - low) / step).clamp(0, 15).to(torch.int32).reshape(out_features, in_features)
    int4_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(int4, 2)
    scale_zero = torch.stack([step.reshape(out_features, -1), (low + 8 * step).reshape(out_features, -1)],
                             dim=-1).transpose(0, 1).contiguous()

    def per_token_int8(x):
        peak = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x / peak, 1 / 127, 128,
                                                                                 fbgemm_int8) * peak

    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data.copy_(weight)
    q8, q4 = WeightOnlyLinear(linear, 8), WeightOnlyLinear(linear, 4)
    return {
        "fp32 oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""),
        "fp16 FBGEMM": lambda x: torch.ops.quantized.linear_dynamic_fp16(x, fp16),
        "int8 Q8_0 (blockspec)": q8,
        "int4 Q4_1 (blockspec)": q4,
        "int8 weight-only (aten)": lambda x: torch.ops.aten._weight_int8pack_mm(x, int8, scales),
        "int4 weight-only (aten)": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4_packed, group,
                                                                                        scale_zero),
        "int8 x int8/token FBGEMM": per_token_int8,
    }


def time_products(model, repeats: int) -> list[dict]:
    shapes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            shapes.setdefault(tuple(module.weight.shape), (name.split(".")[-1], module.weight.detach()))
    rows = []
    with torch.inference_mode():
        for (out_features, in_features), (name, weight) in shapes.items():
            kernels = _kernels(weight.float())
            for count in ROWS:
                x = torch.randn(count, in_features)
                row = {"layer": name, "shape": f"{out_features}x{in_features}", "rows": count}
                row.update({kernel: _median_ms(lambda: call(x), repeats) for kernel, call in kernels.items()})
                rows.append(row)
                print(row, flush=True)
    return rows


# --- decoding -------------------------------------------------------------------------------------------

def prompts_of(datasets, count: int) -> list[dict]:
    rows = []
    per_set = {name: len(range(i, count, len(datasets))) for i, name in enumerate(datasets)}
    for name, number in per_set.items():
        rows.extend(load_bundled(name, limit=number))
    return rows


def chat(target, row):
    text = row["turns"][0]
    return [{"role": "user", "content": text}] if target.tokenizer.chat_template else text


def label_of(precision: str) -> str:
    return "fp32" if precision == "none" else precision


def decode_all(args) -> list[dict]:
    precisions = ["none"] + [p for p in args.precisions if p != "none"]
    targets = {precision: load_target(args.target, quantize=precision) for precision in precisions}
    draft = shipped_draft(args.target)
    drafters = {p: build_drafter("dflash", t, draft, packed=True) for p, t in targets.items()}
    reference = targets["none"]
    ar = GenerationConfig(max_new_tokens=args.max_new_tokens, compile="on", stop_token_ids=reference.stop_token_ids())
    spec = replace(ar, block_size="auto", tree_budget=args.tree_budget or None)
    policies = {p: WidthPolicies() for p in precisions}
    pad = reference.tokenizer.pad_token_id or 0
    hfs = {p: HFGenerateMethod("hf", t.model, pad_token_id=pad) for p, t in targets.items()}
    rows = prompts_of(args.datasets, args.num_prompts)
    longest = max(len(reference.encode_prompt(chat(reference, r))) for r in rows)
    for precision, target in targets.items():  # compile (or read) every graph before any timing
        warm_up_fast_path(target.model, None, ar, longest)
        warm_up_fast_path(target.model, drafters[precision], spec, longest)
        generate_text(target, chat(target, rows[0]), drafters[precision], replace(spec, max_new_tokens=8),
                      width_policies=policies[precision])
        hfs[precision].decode(reference.encode_prompt(chat(reference, rows[0])), replace(ar, max_new_tokens=4))

    records = []
    for row in rows:
        prompt = chat(reference, row)
        record = {"id": row["id"], "dataset": row["dataset"]}
        for precision, target in targets.items():
            label = label_of(precision)
            baseline = hfs[precision].decode(reference.encode_prompt(prompt), ar)
            record[f"hf {label}"] = {"tok/s": len(baseline.token_ids) / baseline.seconds, "tokens": baseline.token_ids}
            for method, drafter, config in (("ar", None, ar), ("dflash", drafters[precision], spec)):
                began = time.perf_counter()
                result = generate_text(target, prompt, drafter, config,
                                       width_policies=policies[precision] if drafter else None)
                seconds = time.perf_counter() - began
                record[f"{method} {label}"] = {"tok/s": len(result.token_ids) / seconds, "tokens": result.token_ids,
                                               "tau": result.stats.tau}
        records.append(record)
        print(_record_line(record, precisions), flush=True)
    return records


def _record_line(record: dict, precisions) -> str:
    speeds = ", ".join(f"{k} {v['tok/s']:.1f}" for k, v in record.items() if isinstance(v, dict))
    labels = [label_of(p) for p in precisions]
    taus = " ".join(f"{label} {record[f'dflash {label}']['tau']:.2f}" for label in labels)
    lossless = " ".join(f"{label} {_same(record, label)}" for label in labels)
    return f"{record['id']}: {speeds} tok/s; tau {taus}; DFlash == AR: {lossless}"


def _same(record: dict, label: str) -> bool:
    return record[f"dflash {label}"]["tokens"] == record[f"ar {label}"]["tokens"]


def summarize(records: list[dict]) -> dict:
    def ratio(numerator, denominator):
        return statistics.median(r[numerator]["tok/s"] / r[denominator]["tok/s"] for r in records)

    labels = [key.split(" ", 1)[1] for key in records[0] if key.startswith("ar ")]
    quantized = [label for label in labels if label != "fp32"]
    ratios = {"ar fp32 / hf fp32": ratio("ar fp32", "hf fp32"),
              "dflash fp32 / hf fp32": ratio("dflash fp32", "hf fp32")}
    for label in quantized:
        ratios[f"ar {label} / ar fp32"] = ratio(f"ar {label}", "ar fp32")
        ratios[f"hf {label} / hf fp32"] = ratio(f"hf {label}", "hf fp32")
        ratios[f"dflash {label} / ar {label}"] = ratio(f"dflash {label}", f"ar {label}")
        ratios[f"dflash {label} / hf {label}"] = ratio(f"dflash {label}", f"hf {label}")
        ratios[f"dflash {label} / hf fp32"] = ratio(f"dflash {label}", "hf fp32")
    return {
        "prompts": len(records),
        "median x": ratios,
        "mean tau": {label: statistics.mean(r[f"dflash {label}"]["tau"] for r in records) for label in labels},
        "lossless": {label: sum(_same(r, label) for r in records) for label in labels},
        "answer == fp32 answer": {label: sum(r[f"ar {label}"]["tokens"] == r["ar fp32"]["tokens"] for r in records)
                                  for label in quantized},
    }


def markdown(products: list[dict], summary: dict) -> str:
    lines = []
    if products:
        kernels = [k for k in products[0] if k not in ("layer", "shape", "rows")]
        lines += ["| layer | shape | rows | " + " | ".join(f"{k} ms" for k in kernels) + " |",
                  "|---|---|---|" + "---|" * len(kernels)]
        lines += [f"| {p['layer']} | {p['shape']} | {p['rows']} | " + " | ".join(f"{p[k]:.3f}" for k in kernels) + " |"
                  for p in products]
        lines.append("")
    if summary:
        lines += ["| ratio (median over prompts) | x |", "|---|---|"]
        lines += [f"| {name} | {value:.2f} |" for name, value in summary["median x"].items()]
        count = summary["prompts"]
        lines += ["", "mean tau: " + ", ".join(f"{k} {v:.2f}" for k, v in summary["mean tau"].items())
                  + "; DFlash == AR: " + ", ".join(f"{k} {v}/{count}" for k, v in summary["lossless"].items())
                  + "; greedy answer == fp32's: "
                  + ", ".join(f"{k} {v}/{count}" for k, v in summary["answer == fp32 answer"].items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    products = [] if args.skip_products else time_products(load_target(args.target).model, args.repeats)
    records = decode_all(args) if args.num_prompts > 0 else []
    summary = summarize(records) if records else {}
    text = markdown(products, summary)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomically(out / "results.json", json.dumps(
            {"args": vars(args), "threads": torch.get_num_threads(), "products": products, "summary": summary,
             "records": records}, indent=1))
        write_text_atomically(out / "results.md", text)


if __name__ == "__main__":
    main()
