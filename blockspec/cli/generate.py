"""`blockspec generate`: text from a prompt, streaming; and the drafter choice generate and serve share."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from blockspec.cli.options import (
    DEFAULT_MAX_NEW_TOKENS,
    add_model_options,
    add_sampling_options,
    hide_loading_bars,
    read_prompt,
    tree_top_k_given,
)
from blockspec.drafters.registry import AUTOREGRESSIVE, DFLASH_METHODS, DRAFTED_METHODS, detect_method, shipped_draft
from blockspec.errors import BlockspecError


def add_generate_command(commands) -> None:
    parser = commands.add_parser("generate", help="generate text from a prompt, streaming")
    add_model_options(parser)
    add_sampling_options(parser)
    add_output_control_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.add_argument("prompt", help="the prompt text ('-' reads it from standard input)")
    parser.set_defaults(run=run_generate)


def add_output_control_options(parser) -> None:
    """Logit adjustments and structured output: applied to the target at every verified position, so the answer
    is the one plain decoding with the same settings gives."""
    group = parser.add_argument_group("output control (lossless under speculation)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0; 1 is off (default)")
    group.add_argument("--presence-penalty", type=float, default=0.0)
    group.add_argument("--frequency-penalty", type=float, default=0.0)
    group.add_argument("--min-p", type=float, default=0.0, help="sampling keeps tokens of at least this share of "
                       "the most likely one's probability")
    group.add_argument("--logit-bias", action="append", default=[], metavar="TOKEN=BIAS",
                       help="add BIAS to token id TOKEN's logit (repeat for several)")
    group.add_argument("--ban", action="append", default=[], metavar="WORD",
                       help="never generate WORD, at the start of the text or after a space (repeat for several)")
    structure = group.add_mutually_exclusive_group()
    structure.add_argument("--json-schema", metavar="SCHEMA", help="the answer is JSON valid under SCHEMA: a file "
                           "or the schema itself ('{\"type\": \"object\"}' for any object)")
    structure.add_argument("--regex", metavar="PATTERN", help="the answer matches PATTERN")
    structure.add_argument("--choice", action="append", metavar="OPTION",
                           help="the answer is one of the options (repeat for each)")
    structure.add_argument("--grammar", metavar="FILE", help="the answer follows a Lark or GBNF grammar")


def run_generate(args) -> int:
    from blockspec.decoding.adjust import bad_words_ids
    from blockspec.decoding.generate import warm_up_fast_path
    from blockspec.decoding.sequence import preferred_decoding
    from blockspec.decoding.text import stream_text
    from blockspec.serve.limits import check_verify_size

    prompt = read_prompt(args.prompt)
    config = generation_config(args)  # bad values are refused before the models load
    structure = structure_source(args)
    target, drafter = load_models(args)
    config = replace(preferred_decoding(drafter, config), grammar=output_grammar(structure, target.tokenizer),
                     bad_words_ids=bad_words_ids(target.tokenizer, args.ban))
    config.adjustments.check_vocabulary(target.model.config.get_text_config(decoder=True).vocab_size)
    check_verify_size(target.model, drafter, config)
    prompt_length = len(target.encode_prompt(prompt, not args.no_chat_template))
    check_token_limit(args.max_new_tokens, prompt_length, target.context_length)
    warm_up_fast_path(target.model, drafter, config, prompt_length)
    stream = stream_text(target, prompt, drafter, config, use_chat_template=not args.no_chat_template)
    for chunk in stream:
        if not args.json:
            print(chunk.text, end="", flush=True)
    result = stream.result
    if args.json:
        print(json.dumps({"method": AUTOREGRESSIVE if drafter is None else drafter.name, **result.to_dict()}))
    else:
        stats = result.stats
        print(f"\n[{'AR' if drafter is None else drafter.name}] {stats.new_tokens} tokens, "
              f"tau {stats.tau:.2f}, {stats.tokens_per_s:.1f} tokens/s, "
              f"first token {stats.time_to_first_token * 1000:.0f} ms"
              + ("" if drafter is None else f", a step {stats.draft_ms_per_step:.1f} ms drafting + "
                 f"{stats.verify_ms_per_step:.1f} ms verifying"), file=sys.stderr)
    return 0


def generation_config(args):
    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.serve.limits import usable_sampling

    max_new_tokens = DEFAULT_MAX_NEW_TOKENS if args.max_new_tokens is None else args.max_new_tokens
    temperature, top_p, top_k = usable_sampling(args.temperature, args.top_p, args.top_k)
    return GenerationConfig(max_new_tokens=max_new_tokens, block_size=args.block_size, temperature=temperature,
                            top_p=top_p, top_k=top_k, seed=args.seed, tree_budget=args.tree_budget,
                            compile=args.compile, **tree_top_k_given(args), **logit_adjustments(args))


def logit_adjustments(args) -> dict:
    """The --*-penalty, --min-p and --logit-bias options as ``GenerationConfig`` fields (checked there)."""
    if not 0.0 <= args.min_p <= 1.0:
        raise BlockspecError(f"--min-p must lie in [0, 1], got {args.min_p}")
    bias = {}
    for given in args.logit_bias:
        token, _, value = given.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise BlockspecError(f"--logit-bias takes TOKEN=BIAS (a token id and a number), got {given!r}") from None
    return {"repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
            "frequency_penalty": args.frequency_penalty, "min_p": args.min_p, "logit_bias": bias}


def structure_source(args) -> tuple[str, object] | None:
    """What the answer must follow, read and parsed before the models load: (kind, value) or None."""
    if args.json_schema is not None:
        text = args.json_schema
        if not text.lstrip().startswith("{"):
            text = _read(text, "--json-schema")
        try:
            return "json", json.loads(text)
        except json.JSONDecodeError as error:
            raise BlockspecError(f"--json-schema is not valid JSON: {error}") from None
    if args.grammar is not None:
        return "grammar", _read(args.grammar, "--grammar")
    if args.regex is not None:
        return "regex", args.regex
    if args.choice:
        return "choice", args.choice
    return None


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise BlockspecError(f"{option}: cannot read {path}: {error.strerror or error}") from None


def output_grammar(structure: tuple[str, object] | None, tokenizer):
    """The grammar of --json-schema, --regex, --choice or --grammar over the target's tokenizer (None: free)."""
    from blockspec.decoding.grammar import Grammar

    if structure is None:
        return None
    kind, value = structure
    make = {"json": Grammar.json_schema, "regex": Grammar.regex, "choice": Grammar.choice, "grammar": Grammar.lark}
    return make[kind](tokenizer, value)


def check_token_limit(asked: int | None, prompt_length: int, context: int | None) -> None:
    """A --max-new-tokens the context cannot hold is an error (as the server answers it); the default
    is lowered to fit."""
    if asked is None or context is None or prompt_length + asked <= context:
        return
    room = context - prompt_length
    raise BlockspecError(f"--max-new-tokens {asked} does not fit: the model's context is {context} tokens and the "
                         f"prompt has {prompt_length}, so at most {max(room, 0)} can be generated")


def drafter_choice(args) -> tuple[str | None, str | None, dict]:
    """The drafter the model options name: (method, draft, drafter options); method None for AR decoding.

    Nothing loads: the draft's method is read from its config.json when --method does not give it.
    """
    method, draft = args.method, args.draft
    if method == "ngram" and draft is not None:
        raise BlockspecError("--method ngram drafts from the prompt and takes no --draft: drop --draft")
    if draft is None and method in (None, *DRAFTED_METHODS) and \
            (shipped := shipped_draft(args.target, method or "dflash")) is not None:
        draft = str(shipped)
    if method in DRAFTED_METHODS and draft is None:
        what = "MODEL (a causal LM directory or a known name)" if method == "draft" else "DIR"
        raise BlockspecError(f"--method {method} needs --draft {what}")
    if method == AUTOREGRESSIVE or (method is None and draft is None):
        return None, None, drafter_options(args, AUTOREGRESSIVE)
    method = method or detect_method(draft)  # checks the draft before the target loads
    return method, draft, drafter_options(args, method)


def drafter_options(args, method: str) -> dict:
    """The options of the drafter ``method`` from the command line."""
    denoise_steps = getattr(args, "denoise_steps", 1)  # serve has no --denoise-steps
    if denoise_steps != 1 and method != "dflash":
        raise BlockspecError(f"--denoise-steps is for the dflash drafter (a block denoiser), not {method}: "
                             "drop it or use --method dflash")
    options = {"sample_drafts": args.draft_sampling == "sample"} if method in DRAFTED_METHODS else {}
    if method == "dflash":
        options["denoise_steps"] = denoise_steps
    check_draft_vocabulary_options(args, method)
    return options


def check_draft_vocabulary_options(args, method: str | None) -> None:
    size, data = getattr(args, "draft_vocab_size", None), getattr(args, "draft_vocab_data", None)
    if size is None and data is None:
        return
    if method != "dflash":
        raise BlockspecError(f"--draft-vocab-size is for dflash drafters, not {method}: drop it")
    if size is None or not data:
        raise BlockspecError("give --draft-vocab-size K and --draft-vocab-data FILE together (the K most frequent "
                             "tokens of that data make the draft vocabulary)")
    if size < 1:
        raise BlockspecError(f"--draft-vocab-size must be >= 1, got {size}")


def draft_vocabulary(args, target):
    """The target ids of --draft-vocab-size / --draft-vocab-data (None when not given)."""
    if getattr(args, "draft_vocab_size", None) is None:
        return None
    from blockspec.training.vocabulary import target_vocabulary

    return target_vocabulary(target, args.draft_vocab_data, args.draft_vocab_size)


def load_models(args):
    """The target and the drafter the options name (the drafter is None for AR decoding).

    With the fast path chosen (``--compile``), its forward is set up here, saying what it does, and a
    DFlash drafter reads its drafts through the same packed LM head.
    """
    from blockspec.decoding.compile_policy import compile_choice
    from blockspec.decoding.fast import fast_forward
    from blockspec.drafters.registry import build_drafter
    from blockspec.models.target import load_target

    method, draft, options = drafter_choice(args)
    hide_loading_bars()
    target = load_target(args.target, device=args.device, dtype=args.dtype, quantize=args.quantize)
    if args.quantize != "none":
        say(f"the target's linear layers run on {args.quantize} weights; output is that target's own")
    compiled, reason = compile_choice(target.model, args.compile)
    if compiled:
        say(reason)
    if compiled and method in DFLASH_METHODS:
        options["packed"] = True
    if (vocabulary := draft_vocabulary(args, target)) is not None:
        from blockspec.training.vocabulary import head_rows

        options["draft_vocabulary"] = vocabulary
        say(f"drafting over {len(vocabulary)} of the target's {head_rows(target)} tokens")
    drafter = None if method is None else build_drafter(method, target, draft, **options)
    if compiled:
        fast_forward(target.model, drafter.feature_layers if drafter is not None else None, progress=say)
    return target, drafter


def say(message: str) -> None:
    """A progress line for the user, apart from the output."""
    print(f"blockspec: {message}", file=sys.stderr, flush=True)
