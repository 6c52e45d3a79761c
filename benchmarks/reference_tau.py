"""Our DFlash drafters in the public reference implementation: same tokens, and the tau it gets.

Loads each draft with the reference's own ``DFlashDraftModel.from_pretrained`` (pip package ``dflash``,
installed without its pinned dependencies by `make test`) and decodes the first-turn prompts of a greedy
`blockspec bench` run with its ``dflash_generate`` (block 16, greedy). The reference drafts through the
target's whole LM head: it ignores a reduced draft vocabulary's ``lm_head.weight`` and ``d2t``. Each
output is checked against the run's recorded autoregressive answer; tau is tokens per target forward.

    .venv/bin/python benchmarks/reference_tau.py runs/ar-gsm8k/results.json \
        --draft blockspec/assets/dflash-smollm2-135m --limit 20
"""

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

from blockspec.bench.replay import recorded_answers
from blockspec.models.target import load_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="results.json of a greedy blockspec bench run (its ar records)")
    parser.add_argument("--draft", nargs="+", required=True, metavar="DIR")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    try:
        import dflash.model as reference
    except ImportError:
        print("reference_tau: the reference is not installed: pip install --no-deps dflash==0.1.0", file=sys.stderr)
        return 2
    reference._cuda_time = time.perf_counter  # its statistics time with CUDA events; this runs anywhere
    results = json.loads(Path(args.results).read_text())
    target = load_target(results["target"])
    answers = recorded_answers(results, target, args.data_dir)[: args.limit]
    max_new = results["config"]["max_new_tokens"]
    stops = list(target.stop_token_ids())
    print("| draft | prompts | tau (reference) | same tokens as ar |\n|---|---|---|---|")
    for directory in args.draft:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the reference reports a reduced vocabulary's tensors as unused
            draft = reference.DFlashDraftModel.from_pretrained(directory, dtype=torch.float32).eval()
        lengths, same = [], 0
        for answer in answers:
            ids = torch.tensor([answer.prompt_ids])
            stats = reference.dflash_generate(draft, target.model, ids, max_new, stops, return_stats=True)
            same += stats.output_ids[0, ids.shape[1]:].tolist() == answer.answer_ids
            lengths += list(stats.acceptance_lengths)
        print(f"| {Path(directory).name} | {len(answers)} | {sum(lengths) / len(lengths):.3f} | "
              f"{same}/{len(answers)} |")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
