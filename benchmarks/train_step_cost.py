"""Seconds per DFlash training step with the whole LM head and with a reduced draft vocabulary, side by side.

Runs the shipped drafter's recipe (docs/shipped-drafters.md) for a few steps per setting on the same
sequences, in one process, after one untimed pass that puts the target's features in the on-disk cache (so
no setting pays for computing them), and prints seconds per step and the ratio to the whole head.

    .venv/bin/python benchmarks/train_step_cost.py --cache runs/smollm2-data/responses.jsonl \
        --vocab 8192 16384 --steps 12
"""

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from blockspec import hub
from blockspec.models.target import load_target
from blockspec.training.pipeline import DataConfig, prepare_samples
from blockspec.training.trainer import TrainConfig, Trainer

DATA_FILES = ("gsm8k_train.jsonl", "code_alpaca_2k.json", "mbpp.jsonl")


def recipe(out, features, vocab, steps, precision):
    return TrainConfig(out=str(out), num_layers=2, intermediate_size=768, target_layer_ids=[1, 15, 29], gamma=3,
                       block_size=16, max_steps=steps, batch_size=4, anchors_per_sequence=32, max_length=512,
                       lr=1e-3, precision=precision, save_every=0, progress=False, feature_cache_dir=str(features),
                       draft_vocab_size=vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", nargs="+", required=True, help="response caches (the training data)")
    parser.add_argument("--vocab", nargs="+", type=int, default=[8192], help="draft vocabulary sizes to compare")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2, help="timed runs of each setting, interleaved")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--data-dir", default="../shared/datasets")
    args = parser.parse_args()
    torch.set_num_threads(2)
    target = load_target(hub.DEFAULT_TARGET)
    work = Path(tempfile.mkdtemp(prefix="step-cost-"))
    try:
        data = DataConfig(files=[f"{args.data_dir}/{name}" for name in DATA_FILES], responses="cache",
                          cache=args.cache, held_out=0)
        samples, _ = prepare_samples(target, data, work / "data", max_length=512)
        features = work / "features"
        Trainer(recipe(work / "warm", features, None, args.steps, args.precision), target, samples).run()
        settings = [None, *args.vocab]
        seconds = {vocab: [] for vocab in settings}
        for round_index in range(args.rounds):
            for vocab in settings:
                trainer = Trainer(recipe(work / f"{vocab}-{round_index}", features, vocab, args.steps,
                                         args.precision), target, samples)
                began = time.perf_counter()
                state = trainer.run()
                seconds[vocab].append(state.seconds_per_step)
                print(f"round {round_index}: vocabulary {vocab or 'whole'}: {state.seconds_per_step:.3f} s/step "
                      f"({time.perf_counter() - began:.0f} s)", flush=True)
        whole = statistics.median(seconds[None])
        for vocab in settings:
            median = statistics.median(seconds[vocab])
            print(f"{'whole vocabulary' if vocab is None else f'{vocab} tokens':>18}: {median:.3f} s/step "
                  f"({median / whole:.2f}x the whole head)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
