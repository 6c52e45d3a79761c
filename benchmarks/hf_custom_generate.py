"""blockspec inside Hugging Face ``generate``: plain ``generate`` against
``generate(custom_generate=hf_custom_generate(drafter))`` on the default target with its shipped DFlash drafter,
greedy, interleaved prompt by prompt in one process. Each prompt runs --passes times; the first pass on a machine
compiles the fast path's graphs (kept on disk), so read the later passes.

    .venv/bin/python benchmarks/hf_custom_generate.py --passes 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import time

import torch

from blockspec import hf_custom_generate, load_drafter, load_target
from blockspec.drafters.registry import shipped_draft
from blockspec.hub import DEFAULT_TARGET

PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the n-th Fibonacci number.",
)


def timed_generate(model, inputs, max_new_tokens: int, **options):
    began = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, **options)
    return out, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=16)
    args = parser.parse_args()
    target = load_target(DEFAULT_TARGET)
    drafter = load_drafter(shipped_draft(DEFAULT_TARGET), target, packed=True)
    decoding = hf_custom_generate(drafter, tree_budget=args.tree_budget, compile="auto")
    for number in range(1, args.passes + 1):
        for prompt in PROMPTS:
            inputs = target.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], return_dict=True,
                                                          add_generation_prompt=True, return_tensors="pt")
            plain, plain_s = timed_generate(target.model, inputs, args.max_new_tokens)
            ours, ours_s = timed_generate(target.model, inputs, args.max_new_tokens, custom_generate=decoding)
            new = ours.shape[1] - inputs["input_ids"].shape[1]
            print(f"pass {number}: {new} tokens, identical {torch.equal(plain, ours)}, plain generate {plain_s:.2f} s, "
                  f"custom_generate {ours_s:.2f} s, {plain_s / ours_s:.2f}x", flush=True)


if __name__ == "__main__":
    main()
