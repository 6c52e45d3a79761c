"""Options that several commands share, and the argument types they parse with."""

from __future__ import annotations

import argparse
import sys

from blockspec.drafters.registry import AUTOREGRESSIVE, DRAFT_METHODS
from blockspec.errors import BlockspecError
from blockspec.hub import DEFAULT_TARGET

#: Tokens `generate` decodes at most when --max-new-tokens is not given.
DEFAULT_MAX_NEW_TOKENS = 256

#: --compile values (blockspec.decoding.sequence.COMPILE_CHOICES; not imported: it loads torch).
COMPILE_CHOICES = ("auto", "on", "off")


def add_model_options(parser: argparse.ArgumentParser) -> None:
    add_target_option(parser)
    parser.add_argument("--draft", default=None,
                        help="the drafter: a DFlash, EAGLE-3 or MTP checkpoint directory, or for --method draft "
                             "a small causal LM (directory or known name) with the target's tokenizer (default: the "
                             "drafter of --method (DFlash without one) shipped for the default target, none for "
                             "other targets: autoregressive decoding)")
    parser.add_argument("--method", default=None, choices=[*DRAFT_METHODS, AUTOREGRESSIVE],
                        help="drafting method: dflash, eagle3, mtp, draft (a small draft LM), ngram (prompt lookup, "
                             "no --draft) "
                             "or ar (no drafter) (default: read from the --draft checkpoint)")
    add_draft_vocabulary_options(parser)
    add_device_options(parser)


def add_draft_vocabulary_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="K",
                        help="dflash: draft over the K tokens most frequent in --draft-vocab-data only (their rows of "
                             "the target's LM head: a cheaper pass; output stays lossless); for drafts without a "
                             "reduced vocabulary of their own")
    parser.add_argument("--draft-vocab-data", nargs="+", default=None, metavar="FILE",
                        help="the data --draft-vocab-size counts tokens in: response caches (.jsonl of prompt_ids/"
                             "response_ids) or prompt files (their prompts and any responses they give)")


def add_target_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="target model: a local directory, a known name, or a hub name "
                             f"(default: {DEFAULT_TARGET})")


def add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16 or float16 (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--compile", choices=COMPILE_CHOICES, default="auto",
                        help="the target's forward: 'on' the fast path (a static KV cache, oneDNN-packed weights on "
                             "a CPU, compiled once per verify width and cached on disk), 'off' the eager forward, "
                             "'auto' the fast path where it pays (supported families; on a CPU from 50M "
                             "parameters) (default: auto)")
    add_quantize_option(parser)


def add_quantize_option(parser) -> None:
    parser.add_argument("--quantize", default="none", metavar="{none,fp16,int8,int4}",
                        help="the target's linear layers (LM head included) on fewer bytes a weight, activations and "
                             "sums in fp32 (CPU): fp16 (FBGEMM, half of fp32's bytes), int8 or int4 (llama.cpp's "
                             "Q8_0 / Q4_1 blocks on blockspec's AVX2 kernel, built once per machine: a quarter / "
                             "about a sixth); output is that quantized target's own, token for token "
                             "(default: none)")


def block_size_arg(value: str):
    """--block-size: a whole number >= 1, or 'auto'."""
    if value == "auto":
        return value
    try:
        return int(value)  # the range is checked with the other decoding values
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number or 'auto', got {value!r}") from None


def add_tree_top_k_option(parser: argparse.ArgumentParser) -> None:
    # None leaves the fan-out to the library: its default lives with the tree code, which imports torch.
    parser.add_argument("--tree-top-k", type=int, default=None,
                        help="children per tree node at most (default: the library's fan-out (8))")


def tree_top_k_given(args) -> dict:
    """``{"tree_top_k": N}`` when --tree-top-k was given, else nothing (the library's default applies)."""
    return {} if args.tree_top_k is None else {"tree_top_k": args.tree_top_k}


def add_sampling_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS}, lowered to what the "
                             "model's context leaves; a larger number than it leaves is an error)")
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="verify width: the last token + block_size-1 drafts, or 'auto' (chosen each step by "
                             "the cost model from the draft's confidence) (default: auto for a dflash chain, "
                             "else the drafter's trained size)")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="verify a token tree of this many draft nodes per step (dflash; e.g. 16, 32, 64) "
                             "instead of one chain")
    add_tree_top_k_option(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=seed_arg, default=None)
    parser.add_argument("--draft-sampling", choices=["sample", "greedy"], default="sample",
                        help="at temperature > 0: sample drafts and rejection-sample with q (default), "
                             "or draft greedily and accept with probability p(draft)")
    parser.add_argument("--denoise-steps", type=int, default=1, metavar="K",
                        help="dflash: denoise the draft block in K passes, each committing the most confident "
                             "masked positions (default 1: the whole block in one pass); with K > 1 drafts "
                             "are greedy at any temperature")
    parser.add_argument("--no-chat-template", action="store_true", help="encode the prompt as plain text")


def layer_list(text: str) -> list[int]:
    """'1,15,29' -> [1, 15, 29] (for --target-layers)."""
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer numbers separated by commas, e.g. 1,15,29; got {text!r}")
    if not layers or any(layer < 0 for layer in layers):
        raise argparse.ArgumentTypeError(f"expected layer numbers >= 0 separated by commas, got {text!r}")
    return layers


def seed_arg(value: str) -> int:
    """--seed: a whole number a torch generator takes (64 bits, signed or not)."""
    seed_min, seed_max = -(2**63), 2**64 - 1
    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if not seed_min <= seed <= seed_max:
        raise argparse.ArgumentTypeError(f"a seed must lie in [-2**63, 2**64 - 1], got {value}")
    return seed


def read_prompt(value: str) -> str:
    """The prompt argument as text: '-' reads standard input. Either must be UTF-8."""
    if value != "-":
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:  # bytes the locale could not decode arrive as lone surrogates
            raise BlockspecError(f"the prompt is not UTF-8 text (it holds the byte {_escaped_byte(value[error.start])} "
                                 f"at character {error.start}): give it in UTF-8") from None
        return value
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:
        return sys.stdin.read()
    data = stream.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BlockspecError(f"standard input is not UTF-8 text (byte {data[error.start]:#04x} at offset "
                             f"{error.start}): give the prompt in UTF-8") from None


def _escaped_byte(char: str) -> str:
    code = ord(char)
    return f"{code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"


def check_device(device: str | None) -> None:
    """Refuse a --device this machine does not have, before anything loads onto it."""
    if not device:
        return
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise BlockspecError(f"--device {device!r} is not a device: give cpu, cuda, cuda:N or mps") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise BlockspecError(f"--device {device}: CUDA is not available on this machine (no GPU, or a torch built "
                             "without CUDA): use --device cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise BlockspecError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise BlockspecError(f"--device {device}: MPS is not available on this machine: use --device cpu")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise BlockspecError(f"--device {device}: blockspec runs on cpu, cuda or mps")


def add_keep_last_option(parser: argparse.ArgumentParser) -> None:
    # None leaves the count to the trainer's config (its default, 3, lives with the training code, which imports torch).
    parser.add_argument("--keep-last", type=int, default=None, metavar="N",
                        help="checkpoints kept on disk, the newest N (default 3; 0 keeps them all)")


def keep_last_given(args) -> dict:
    """``{"keep_checkpoints": N}`` when --keep-last was given, else nothing (the trainer's default applies)."""
    return {} if args.keep_last is None else {"keep_checkpoints": args.keep_last}


def hide_loading_bars() -> None:
    """Keep transformers' weight-loading progress bars off the terminal: a command says what it loads, and an
    error stays one line."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
