"""Generate SmolLM2-135M-Instruct's own responses to the training prompts (resumable).

This is the data stage of the shipped drafter (docs/shipped-drafters.md). By default:
900 gsm8k train, 450 Code Alpaca and 150 MBPP train-split prompts (never a test split),
greedy, 256 new tokens, fp32, cached to runs/smollm2-data/responses.jsonl. Stop it at any
time; run it again to continue. `blockspec train-draft --responses cache` then trains on
what is there. --styles asks the prompts the ways users do (plain, chat-style, with the
benchmark suffix; "stub" asks a coding task with a reference solution as its function's
signature and docstring to complete, HumanEval's form), so a drafter does not learn one
phrasing only.

More prompts of each file: raise the counts and pass the first cache as --exclude-cache,
so only prompts it lacks are generated (the files are shuffled with a fixed seed, so a
larger count takes the same prompts first). --dtype bfloat16 generates about twice as fast
on CPUs with bf16 matrix units; such a cache is a separate file (its settings differ).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockspec import hub
from blockspec.training.prompts import PROMPT_STYLES, load_prompts, restyle_prompts
from blockspec.training.response_cache import read_cache
from blockspec.training.responses import generate_responses

COUNTS = {"gsm8k_train.jsonl": 900, "code_alpaca_2k.json": 450, "mbpp.jsonl": 150}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", default="../shared/datasets")
    parser.add_argument("--cache", default="runs/smollm2-data/responses.jsonl")
    parser.add_argument("--exclude-cache", nargs="*", default=[], metavar="FILE",
                        help="skip the prompts these caches already answer")
    for name, count in COUNTS.items():
        parser.add_argument(f"--{name.split('.')[0].replace('_', '-')}", type=int, default=count,
                            dest=name, metavar="N", help=f"prompts of {name} (default {count})")
    parser.add_argument("--styles", default=None, metavar="S,S",
                        help=f"ask each prompt in one of these styles ({', '.join(PROMPT_STYLES)}), picked per "
                             "prompt; ids gain @style (default: gsm8k with the benchmark suffix, the rest as written)")
    parser.add_argument("--skip", type=int, default=0, dest="skip", metavar="N",
                        help="leave out each file's first N prompts (after the fixed shuffle)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = hub.prepare(hub.DEFAULT_TARGET)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    excluded = {row["id"] for cache in args.exclude_cache for row in read_cache(cache)}
    records = []
    for name in COUNTS:
        count = getattr(args, name)
        if count == 0:
            continue
        rows, report = load_prompts([f"{args.datasets}/{name}"], limit=args.skip + count, seed=0,
                                    format_prompts=args.styles is None)
        print(report.summary(), flush=True)
        rows = rows[args.skip:]
        if args.styles:
            rows = restyle_prompts(rows, args.styles.split(","), seed=0)
        records += [row for row in rows if row.id not in excluded]
    print(f"{len(records)} prompts to answer ({len(excluded)} answered in --exclude-cache)", flush=True)
    report = generate_responses(model, tokenizer, records, args.cache, max_new_tokens=256,
                                batch_size=args.batch_size)
    print(report.summary())


if __name__ == "__main__":
    main()
