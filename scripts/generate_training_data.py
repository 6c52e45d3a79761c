"""Generate SmolLM2-135M-Instruct's own responses to the training prompts (resumable).

This is the data stage of the shipped drafter (README, "The shipped drafter"): 900 gsm8k
train, 450 Code Alpaca and 150 MBPP train-split prompts (never a test split), greedy,
256 new tokens, cached to runs/smollm2-data/responses.jsonl. Stop it at any time; run it
again to continue. `blockspec train-draft --responses cache` then trains on what is there.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockspec import hub
from blockspec.training.data import generate_responses, load_prompts

FILES = [("gsm8k_train.jsonl", 900), ("code_alpaca_2k.json", 450), ("mbpp.jsonl", 150)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--datasets", default="../shared/datasets")
    parser.add_argument("--cache", default="runs/smollm2-data/responses.jsonl")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = hub.prepare(hub.DEFAULT_TARGET)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    records = []
    for name, limit in FILES:
        rows, report = load_prompts([f"{args.datasets}/{name}"], limit=limit, seed=0)
        print(report.summary(), flush=True)
        records += rows
    report = generate_responses(model, tokenizer, records, args.cache, max_new_tokens=256, batch_size=32)
    print(report.summary())


if __name__ == "__main__":
    main()
