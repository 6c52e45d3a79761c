"""How sure the target is of its own greedy answers: a drafter-free measure of how predictable they are.

For each AR run given (a greedy `blockspec bench` results.json), one target forward over every
prompt + answer gives, at each answer position, the probability the target puts on the token it
chose (its top-1) and the entropy of its distribution. Answers the target itself is less sure of
are harder for any drafter to guess, whatever it was trained on. Compare runs of the same
questions asked two ways, e.g. the last 50 gsm8k test questions plainly and with the suffix:

    .venv/bin/python benchmarks/answer_confidence.py runs/ar-gsm8k-last50-plain/results.json \
        runs/ar-gsm8k-last50-suffix/results.json
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from blockspec.bench.replay import recorded_answers
from blockspec.errors import BlockspecError
from blockspec.models.target import load_target

THRESHOLDS = (0.5, 0.9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of greedy blockspec bench runs (their ar records)")
    parser.add_argument("--target", default=None, help="target (default: each run's)")
    parser.add_argument("--data-dir", default=None, help="where the run read its prompts, for runs without prompt_ids")
    args = parser.parse_args()
    try:
        rows = [confidence_of_run(Path(path), args) for path in args.results]
    except BlockspecError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print("| run | answers | answer tokens | mean top-1 probability | mean entropy (nats) | "
          + " | ".join(f"top-1 < {t}" for t in THRESHOLDS) + " |")
    print("|---" * (5 + len(THRESHOLDS)) + "|")
    for row in rows:
        shares = " | ".join(f"{row[f'below_{t}']:.1%}" for t in THRESHOLDS)
        print(f"| {row['run']} | {row['answers']} | {row['tokens']} | {row['top1']:.3f} | {row['entropy']:.3f} "
              f"| {shares} |")
    return 0


def confidence_of_run(path: Path, args) -> dict:
    results = json.loads(path.read_text())
    target = _load_target(args.target or results["target"])
    answers = recorded_answers(results, target, args.data_dir)
    top1, entropy = [], []
    for answer in answers:
        chosen_probability, answer_entropy = answer_confidence(target.model, answer.prompt_ids, answer.answer_ids)
        top1.append(chosen_probability)
        entropy.append(answer_entropy)
    top1, entropy = torch.cat(top1), torch.cat(entropy)
    row = {"run": path.parent.name, "answers": len(answers), "tokens": top1.numel(),
           "top1": top1.mean().item(), "entropy": entropy.mean().item()}
    row.update({f"below_{t}": (top1 < t).float().mean().item() for t in THRESHOLDS})
    return row


@functools.cache
def _load_target(name: str):
    return load_target(name)  # runs of one target (the usual comparison) load it once


@torch.inference_mode()
def answer_confidence(model, prompt_ids: list[int], answer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per answer token: the target's probability of the token it chose, and its distribution's entropy."""
    ids = torch.tensor([prompt_ids + answer_ids], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
    log_probs = torch.log_softmax(logits, dim=-1)
    chosen = log_probs.gather(-1, ids[0, len(prompt_ids):].unsqueeze(-1)).squeeze(-1).exp()
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen.cpu(), entropy.cpu()


if __name__ == "__main__":
    sys.exit(main())
