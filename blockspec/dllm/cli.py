"""`blockspec dllm ...`: diffusion language models from the command line."""

from __future__ import annotations

import argparse
import sys

from blockspec.hub import DEFAULT_TARGET


def add_dllm_parsers(commands) -> None:
    """The `dllm` command and its actions, under the top-level subparsers ``commands``."""
    parser = commands.add_parser("dllm", help="diffusion language models: adapt an AR model into one (train)")
    actions = parser.add_subparsers(metavar="ACTION", required=True)
    add_train_parser(actions)


def add_train_parser(actions) -> None:
    parser = actions.add_parser(
        "train", help="adapt a causal LM into a masked diffusion LM (Dream-style) on prompt/response data",
        description="Start from the AR weights, train with the masked-diffusion loss (1/t weighted) under "
                    "bidirectional or block-causal attention; checkpoints in OUT/checkpoints, the model in OUT/model.")
    parser.add_argument("--init", default=DEFAULT_TARGET,
                        help=f"the causal LM to start from: a directory or a known name (default: {DEFAULT_TARGET})")
    parser.add_argument("--data", dest="files", nargs="+", required=True,
                        help="prompt files whose rows carry the response (jsonl / json: gsm8k question/answer, "
                             "alpaca, messages ending on an assistant turn ...) or response caches")
    parser.add_argument("--out", required=True, help="output directory (checkpoints/, model/)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--max-length", type=int, default=256, help="tokens per sequence, prompt included")
    parser.add_argument("--attention", choices=["bidirectional", "block_causal"], default="bidirectional",
                        help="bidirectional (LLaDA, Dream) or block_causal (block diffusion: each block is denoised "
                             "from the clean blocks before it) (default bidirectional)")
    parser.add_argument("--block-size", type=int, default=32, help="block_causal: positions per block (default 32)")
    parser.add_argument("--no-shift", dest="shifted", action="store_false",
                        help="predict token i at position i (default: at i-1, as the AR model did)")
    parser.add_argument("--pretrain", dest="sft", action="store_false",
                        help="mask the prompt too (default: SFT, only response tokens are masked)")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="the mask token (default: the tokenizer's mask token or a spare special token)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (0: only at the end)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: where the model loads, cpu)")
    parser.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from blockspec.dllm.train import DiffusionTrainConfig, adapt, mean_losses

    hf_logging.disable_progress_bar()
    config = DiffusionTrainConfig(
        out=args.out, steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length,
        attention=args.attention, block_size=args.block_size, shifted=args.shifted, sft=args.sft,
        mask_token_id=args.mask_token_id, seed=args.seed, save_every=args.save_every)
    try:
        path, state = adapt(args.init, args.files, config, resume=args.resume, device=args.device)
    except KeyboardInterrupt:
        print(f"blockspec: training interrupted; continue with --resume --out {args.out}", file=sys.stderr)
        return 130
    first, last, window = mean_losses(state.losses)
    print(f"loss {first:.3f} (mean of the first {window} steps) -> {last:.3f} (mean of the last {window}), "
          f"{state.step} steps, {state.seconds_per_step:.2f} s/step", file=sys.stderr)
    print(f"saved the diffusion model to {path}")
    return 0
