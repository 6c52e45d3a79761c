"""Short DFlash training runs that differ in one recipe setting, scored on held-out responses.

Each run trains the drafter for --steps on a response cache (minus --held-out responses,
chosen with a fixed seed), then scores it by held-out block acceptance: at random anchors
inside each held-out response the drafter drafts its block, and a block's accepted length
is how many of its drafts in a row equal the response. The responses are the target's
greedy output, so this is greedy acceptance exactly; averaged over anchors it is the tau of
a chain at the trained block size (anchors taken uniformly, not where a decode would stop).
A second score, sampled_tau, is the expected accepted length under temperature-1
verification along the same responses. --rescore scores a finished run again without
training.

    .venv/bin/python benchmarks/recipe_sweep.py --name gamma3 --cache runs/smollm2-data/responses.jsonl \
        --target-layers 1,15,29 --gamma 3
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from blockspec.cli.options import layer_list
from blockspec.models.target import load_target
from blockspec.training.anchors import build_blocks
from blockspec.training.samples import load_samples, pad_batch
from blockspec.training.trainer import TrainConfig, Trainer

MAX_LENGTH = 512  # tokens per training sequence, as the shipped drafter's command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", required=True)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--cache", nargs="+", required=True, help="response caches (the first gives the held-out)")
    parser.add_argument("--held-out", type=int, default=64)
    parser.add_argument("--anchors-scored", type=int, default=48, help="anchors per held-out response")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=768)
    parser.add_argument("--target-layers", type=layer_list, default=None)
    parser.add_argument("--gamma", type=float, default=None)
    parser.add_argument("--fixed-blocks", action="store_true")
    parser.add_argument("--uniform-weights", action="store_true")
    parser.add_argument("--soft-labels", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--anchors-per-sequence", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--out", default="runs/recipe-sweep")
    parser.add_argument("--results", default="runs/recipe-sweep/results.jsonl")
    parser.add_argument("--rescore", action="store_true",
                        help="score the finished run NAME again (its draft/ and train_config.json) without training")
    args = parser.parse_args()

    target = load_target(args.target, dtype="float32")
    held_out, training = split(args.cache, args.held_out)
    if args.rescore:
        rescore(args, target, held_out, training)
        return
    config = TrainConfig(
        out=f"{args.out}/{args.name}", num_layers=args.num_layers, intermediate_size=args.intermediate_size,
        target_layer_ids=args.target_layers, gamma=args.gamma, random_anchors=not args.fixed_blocks,
        decay_weights=not args.uniform_weights, soft_labels=args.soft_labels, block_size=args.block_size,
        batch_size=args.batch_size, anchors_per_sequence=args.anchors_per_sequence, max_length=MAX_LENGTH,
        lr=args.lr, precision="bf16",
        max_steps=args.steps, save_every=0)
    started = time.perf_counter()
    trainer = Trainer(config, target, training)
    trainer.run()
    seconds = time.perf_counter() - started
    scores = held_out_acceptance(trainer, target, held_out, args.anchors_scored, args.block_size)
    losses = trainer.state.losses
    record({"name": args.name, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "results")},
            "train_seconds": round(seconds), "loss_last_50": sum(losses[-50:]) / len(losses[-50:]), **scores},
           args.results)


def rescore(args, target, held_out, training):
    """Score a finished run's drafter again (e.g. after a new score was added) on the same held-out draw."""
    run = Path(args.out) / args.name
    settings = json.loads((run / "train_config.json").read_text())
    config = TrainConfig(**{**settings, "init_from": str(run / "draft"), "progress": False})
    trainer = Trainer(config, target, training)
    scores = held_out_acceptance(trainer, target, held_out, args.anchors_scored, config.block_size)
    record({"name": args.name, "rescored": True, **scores}, args.results)


def record(result, path):
    print(json.dumps(result))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as results:
        results.write(json.dumps(result) + "\n")


def split(caches, count):
    """(held-out, training) samples: ``count`` of the first cache, drawn with a fixed seed."""
    first = load_samples(caches[0], max_length=MAX_LENGTH)
    order = list(range(len(first)))
    random.Random(0).shuffle(order)
    held_out = [first[i] for i in order[:count]]
    kept = {s.id for s in held_out}
    training = [first[i] for i in order[count:]]
    for cache in caches[1:]:
        training += [s for s in load_samples(cache, max_length=MAX_LENGTH) if s.id not in kept]
    return held_out, training


@torch.no_grad()
def held_out_acceptance(trainer, target, samples, anchors, block_size):
    """Greedy: mean accepted drafts + 1 over random anchors, and P(draft k accepted | k reached).

    Sampled (temperature 1): draft k is accepted with probability sum_x min(p_k(x), q_k(x)) =
    1 - TV(p_k, q_k), p the target's and q the drafter's distribution; the expected length is
    1 + sum_k prod_{j<=k} (1 - TV_j). Both distributions are taken along the greedy response
    (teacher-forced), not along sampled text: a comparison of drafters, not a decode's tau.
    """
    model = trainer.model.eval()
    generator = torch.Generator().manual_seed(123)
    lengths, reached, accepted = [], torch.zeros(block_size - 1), torch.zeros(block_size - 1)
    sampled_lengths = []
    for start in range(0, len(samples), 4):
        batch = samples[start:start + 4]
        ids, loss_mask, seq_lengths = pad_batch(batch)
        # negative keys: the trainer keeps features by sample index, and these are not training samples
        features = trainer.features([-1 - start - i for i in range(len(batch))], ids, seq_lengths)
        blocks = build_blocks(ids, loss_mask, seq_lengths, block_size=block_size, num_anchors=anchors,
                              mask_token_id=model.mask_token_id, gamma=None, generator=generator)
        embeddings = target.model.get_input_embeddings()(blocks.block_ids)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = model(embeddings, blocks.block_positions, features, blocks.context_positions,
                           attention_mask=blocks.attention_mask)
        draft_logits = target.model.get_output_embeddings()(hidden.float())
        drafts = draft_logits.argmax(-1)
        shape = (len(batch), anchors, block_size)
        hits = ((drafts == blocks.labels) & (blocks.weights > 0)).view(shape)[..., 1:].flatten(0, 1)
        valid = (blocks.weights > 0).view(shape)[..., 1:].flatten(0, 1)
        used = valid[:, 0]  # the others are unused anchor slots
        sampled_lengths += sampled_chain_lengths(target, ids, blocks, draft_logits, shape, valid, used)
        streak = hits[used].int().cumprod(-1)  # 1 while every draft so far was accepted
        before = torch.cat([torch.ones_like(streak[:, :1]), streak[:, :-1]], dim=-1)
        reached += (valid[used] & before.bool()).sum(0)
        accepted += streak.sum(0)
        lengths += (streak.sum(-1) + 1).tolist()
    by_position = (accepted / reached.clamp_min(1)).tolist()
    return {"held_out_tau": round(sum(lengths) / len(lengths), 3),
            "accepted_given_reached": [round(p, 3) for p in by_position[:4]],
            "sampled_tau": round(sum(sampled_lengths) / len(sampled_lengths), 3)}


def sampled_chain_lengths(target, ids, blocks, draft_logits, shape, valid, used):
    """Expected accepted length + 1 of each used anchor's block under temperature-1 verification.

    ``valid``: [anchor slots, block_size - 1], which drafts have a label; ``used``: which slots hold a block.
    """
    target_logits = target.model(input_ids=ids).logits  # position t predicts token t+1
    rows = torch.arange(ids.shape[0])[:, None].expand_as(blocks.block_positions)
    sources = (blocks.block_positions - 1).clamp(0, ids.shape[1] - 1)  # slots past the end are masked below
    target_probs = target_logits[rows, sources].softmax(-1)
    overlap = torch.minimum(target_probs, draft_logits.softmax(-1)).sum(-1)  # 1 - TV per block slot
    overlap = overlap.view(shape)[..., 1:].flatten(0, 1) * valid
    return (overlap[used].cumprod(-1).sum(-1) + 1).tolist()


if __name__ == "__main__":
    main()
