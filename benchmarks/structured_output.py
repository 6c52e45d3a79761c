"""Structured output under speculation on the default pair: JSON-schema answers, DFlash against AR.

Each gsm8k problem is asked for as a JSON object of a schema (the numbers in it, what is asked, the
answer). Per prompt, interleaved in one process: constrained AR, constrained DFlash (the server's
default: a 16-node tree, adaptive width, compiled fast path) and unconstrained AR. Reports how many
answers parse and fit the schema, whether DFlash's tokens equal AR's under the grammar, and the time
ratio. Writes a JSON file.

    .venv/bin/python benchmarks/structured_output.py --out benchmarks/results/structured-output
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from blockspec import hub
from blockspec.bench.datasets import load_benchmark_prompts
from blockspec.decoding.generate import speculative_generate, warm_up_fast_path
from blockspec.decoding.grammar import Grammar
from blockspec.decoding.policy import AUTO, WidthPolicies
from blockspec.decoding.sequence import PREFERRED_TREE_BUDGET, GenerationConfig
from blockspec.drafters.registry import load_drafter, shipped_draft
from blockspec.io import write_text_atomically
from blockspec.machine import hardware_name
from blockspec.models.target import load_target

SCHEMA = {
    "type": "object",
    "properties": {
        "numbers": {"type": "array", "items": {"type": "number"}, "maxItems": 12},
        "unknown": {"type": "string", "maxLength": 80},
        "answer": {"type": "integer"},
    },
    "required": ["numbers", "unknown", "answer"],
    "additionalProperties": False,
}
ASK = ('Reply with JSON only, of the form {"numbers": [the numbers in the problem], "unknown": "what is asked, '
       'in a few words", "answer": the answer as an integer}.\n\nProblem: ')


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=hub.DEFAULT_TARGET)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--compact", action="store_true",
                        help="no free whitespace in the JSON (llguidance's whitespace_flexible: false)")
    parser.add_argument("--out", default="benchmarks/results/structured-output")
    return parser.parse_args()


def fits_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"numbers", "unknown", "answer"}
            and isinstance(value["numbers"], list) and all(isinstance(n, (int, float)) for n in value["numbers"])
            and isinstance(value["unknown"], str) and isinstance(value["answer"], int))


def run(target, ids, drafter, config, policies):
    started = time.perf_counter()
    stream = speculative_generate(target.model, ids, drafter, config, width_policies=policies)
    list(stream)
    return stream.token_ids, time.perf_counter() - started, stream.stats.tau


def main():
    args = parse_args()
    torch.manual_seed(0)
    target = load_target(args.target)
    drafter = load_drafter(shipped_draft(target.name), target, packed=True)
    schema = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}} if args.compact else SCHEMA
    grammar = Grammar.json_schema(target.tokenizer, schema)
    stops = tuple(target.stop_token_ids())
    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, compile="auto")
    ar_config = GenerationConfig(grammar=grammar, **common)
    free_config = GenerationConfig(**common)
    spec_config = GenerationConfig(grammar=grammar, block_size=AUTO, tree_budget=PREFERRED_TREE_BUDGET, **common)
    policies = WidthPolicies()
    rows = load_benchmark_prompts("gsm8k", num_prompts=args.num_prompts)
    cases = [torch.tensor(target.encode_prompt([{"role": "user", "content": ASK + row["turns"][0]}]))
             for row in rows]
    longest = max(ids.shape[-1] for ids in cases)
    warm_up_fast_path(target.model, drafter, spec_config, longest)  # every width bucket, compiled or read
    warm_up_fast_path(target.model, None, ar_config, longest)
    run(target, cases[0], drafter, spec_config, policies)  # the width policy's costs, measured or read
    run(target, cases[0], None, ar_config, policies)
    records = []
    for index, ids in enumerate(cases):
        order = [("ar", None, ar_config), ("dflash", drafter, spec_config), ("free", None, free_config)]
        if index % 2:
            order[0], order[1] = order[1], order[0]
        results = {name: run(target, ids, d, c, policies) for name, d, c in order}
        texts = {name: target.tokenizer.decode(tokens, skip_special_tokens=True) for name, (tokens, _, _) in
                 results.items()}
        record = {"prompt": index, "identical": results["ar"][0] == results["dflash"][0],
                  "valid": {name: fits_schema(text) for name, text in texts.items()},
                  "seconds": {name: round(r[1], 3) for name, r in results.items()},
                  "tokens": {name: len(r[0]) for name, r in results.items()}, "tau": round(results["dflash"][2], 3),
                  "text": texts["dflash"]}
        records.append(record)
        print(f"{index:2d} identical={record['identical']} valid={record['valid']} "
              f"ar {record['seconds']['ar']:.2f}s dflash {record['seconds']['dflash']:.2f}s tau {record['tau']}",
              flush=True)
    total = {name: sum(r["seconds"][name] for r in records) for name in ("ar", "dflash", "free")}
    summary = {
        "machine": hardware_name(target.model.device), "target": target.name, "compact": args.compact,
        "prompts": len(records),
        "identical": sum(r["identical"] for r in records),
        "valid": {name: sum(r["valid"][name] for r in records) for name in ("ar", "dflash", "free")},
        "speedup_over_constrained_ar": round(total["ar"] / total["dflash"], 3),
        "mean_tau": round(sum(r["tau"] for r in records) / len(records), 3),
        "records": records,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out / "results.json", json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
