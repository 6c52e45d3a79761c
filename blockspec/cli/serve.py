"""`blockspec serve` (an OpenAI-compatible HTTP API) and `blockspec loadtest` (measuring one)."""

from __future__ import annotations

import os
import sys

from blockspec.cli.generate import load_models
from blockspec.cli.options import add_model_options, add_tree_top_k_option, block_size_arg, tree_top_k_given
from blockspec.errors import BlockspecError
from blockspec.extras import require_extra

#: The environment variable that gives the API key (serve) or the key to send (loadtest).
API_KEY_VARIABLE = "BLOCKSPEC_API_KEY"


def add_serve_command(commands) -> None:
    parser = commands.add_parser("serve", help="serve the target over an OpenAI-compatible HTTP API")
    add_model_options(parser)
    parser.add_argument("--draft-sampling", choices=["sample", "greedy"], default="sample",
                        help="at temperature > 0: sample drafts (default) or draft greedily")
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="verify width of every request; 'auto' chooses it each step for the whole batch "
                             "(default: as `blockspec generate`: for dflash, 'auto' over a 16-node token tree; "
                             "else the drafter's trained size)")
    parser.add_argument("--tree-budget", type=int, default=None,
                        help="verify a token tree of this many draft nodes (dflash, suffix, dflash+suffix, "
                             "dflash+lookup); each row of a batch verifies a tree of its own")
    add_tree_top_k_option(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch-size", type=int, default=16,  # serve.engine.DEFAULT_MAX_BATCH_SIZE (loads torch)
                        help="rows decoded together (default 16; the KV cache grows only as the rows decoding need)")
    parser.add_argument("--prefill-chunk", type=int, default=256,  # serve.engine.DEFAULT_PREFILL_CHUNK
                        help="prompt tokens a batch step prefills at most: a long prompt enters over several steps "
                             "and holds the decoding rows up one chunk at a time (default 256)")
    parser.add_argument("--kv-budget", default="auto", metavar="SLOTS",
                        help="token slots (rows x columns) the batch's KV cache may take: a request waits until the "
                             "decoding rows leave room for its prompt and longest answer (default auto: what 40%% "
                             "of the memory available at start-up holds; none: no bound)")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests in flight (waiting + decoding) before new ones get 503 (default 64)")
    parser.add_argument("--api-key", action="append", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 endpoints; repeat it for several keys, "
                             "each a tenant whose answers only its own requests' suffix drafts copy (default: "
                             f"${API_KEY_VARIABLE} if set, several keys separated by commas; the variable keeps "
                             "the keys out of the process list)")
    parser.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                        help="request bodies larger than this are answered 413 (default 8 MiB)")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.set_defaults(run=run_serve)


#: oneDNN keeps up to 1024 prepared kernels by default, one per shape a packed linear layer is called at, and a
#: batch's shapes change step to step: over 1000 mixed requests the cache grew the server's memory by 15.7%; with 64
#: the growth over 400 requests was 2.9% (10.9% with the default), at the same speed (benchmarks/serve_memory.py).
ONEDNN_KERNEL_CACHE = "64"


def run_serve(args) -> int:
    require_extra("serve", "blockspec serve")
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_KERNEL_CACHE)  # read once torch first uses it
    import uvicorn

    from blockspec.decoding.sequence import GenerationConfig
    from blockspec.serve.app import check_decoding, create_app, one_at_a_time
    from blockspec.serve.limits import default_kv_budget

    if not 0 < args.port < 65536:
        raise BlockspecError(f"--port must be 1..65535, got {args.port}")
    if args.max_request_bytes < 1:
        raise BlockspecError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.prefill_chunk < 1:
        raise BlockspecError(f"--prefill-chunk must be >= 1 tokens, got {args.prefill_chunk}")
    api_keys = api_keys_of(args)
    kv_budget = kv_budget_asked(args)
    decoding = decoding_options(args)
    GenerationConfig(**decoding.config_fields())  # bad values are refused before the models load
    target, drafter = load_models(args)
    decoding = decoding.for_drafter(drafter)
    check_decoding(target.model, drafter, decoding)
    if kv_budget == "auto":
        kv_budget = None if one_at_a_time(args.max_batch_size) else default_kv_budget(target.model, args.max_batch_size)
    app = create_app(target, drafter, max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                     max_request_bytes=args.max_request_bytes, prefill_chunk=args.prefill_chunk,
                     api_keys=api_keys, decoding=decoding, kv_budget=kv_budget)
    # compiled graphs (one request at a time) or the batch's T(B, w) (adaptive width), ahead of the first request
    app.state.engine.prepare(GenerationConfig(**decoding.config_fields()), say=lambda text: print(
        f"blockspec: {text}", file=sys.stderr))
    how = "one request at a time" if one_at_a_time(args.max_batch_size) else \
        f"batches of up to {args.max_batch_size}, " + ("no KV budget" if kv_budget is None else
                                                      f"a KV budget of {kv_budget} token slots")
    print(f"blockspec: serving {target.name} ({'AR' if drafter is None else drafter.name}, "
          f"{verify_shape(decoding, drafter)}, {how}) at http://{args.host}:{args.port}/v1", file=sys.stderr)
    return serve_from_main_thread(app, uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))


def kv_budget_asked(args) -> int | str | None:
    """--kv-budget, checked: a number of token slots, 'auto' or None ('none')."""
    if args.kv_budget in ("auto", "none"):
        return None if args.kv_budget == "none" else "auto"
    try:
        budget = int(args.kv_budget)
    except ValueError:
        budget = 0
    if budget < 1:
        raise BlockspecError(f"--kv-budget takes a number of token slots >= 1, 'auto' or 'none', "
                             f"got {args.kv_budget!r}")
    return budget


def serve_from_main_thread(app, config) -> int:
    """uvicorn in a thread of its own, the decoding engine in this (the main) thread: torch's CPU thread pool
    runs at full speed only in the thread that first used it. Ctrl-C or SIGTERM stops both."""
    import signal
    import threading

    import uvicorn

    server = uvicorn.Server(config)
    web = threading.Thread(target=server.run, name="blockspec-http", daemon=True)
    engine = app.state.engine
    engine.claim_thread()
    main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    web.start()
    try:
        engine.run_here(keep_going=web.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        server.should_exit = True
        engine.stop()
        web.join(30)
    if not server.started:
        print("blockspec: the HTTP server did not start (see the error above)", file=sys.stderr)
        return 1
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def verify_shape(decoding, drafter) -> str:
    """What each step verifies, in words."""
    if drafter is None:
        return "one token a step"
    width = "the adaptive width" if decoding.block_size == "auto" else (
        "the drafter's width" if decoding.block_size is None else f"width {decoding.block_size}")
    return width + (f" over a {decoding.tree_budget}-node token tree" if decoding.tree_budget else "")


def api_keys_of(args) -> list[str]:
    """The server's keys: every --api-key, else $BLOCKSPEC_API_KEY's comma-separated keys; none: no keys."""
    if args.api_key is not None:
        return [checked_key(key, "--api-key") for key in args.api_key]
    keys = os.environ.get(API_KEY_VARIABLE)
    if keys is None:
        return []
    return [checked_key(key, f"${API_KEY_VARIABLE}") for key in keys.split(",")]


def api_key_of(args) -> str | None:
    """The key a client sends: --api-key, else $BLOCKSPEC_API_KEY."""
    if args.api_key is not None:
        return checked_key(args.api_key, "--api-key")
    key = os.environ.get(API_KEY_VARIABLE)
    return None if key is None else checked_key(key, f"${API_KEY_VARIABLE}")


def checked_key(key: str, source: str) -> str:
    """The key, refused when empty (rather than read as none) or when no HTTP header can carry it."""
    from blockspec.serve.auth import check_api_key

    check_api_key(key, source)
    return key


def decoding_options(args):
    """How the server verifies every request, from the options."""
    from blockspec.serve.engine import DecodingOptions

    return DecodingOptions(args.block_size, args.tree_budget, compile=args.compile, **tree_top_k_given(args))


def add_loadtest_command(commands) -> None:
    parser = commands.add_parser("loadtest",
                                 help="measure a local `blockspec serve` with concurrent streaming requests")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback addresses only)")
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    parser.add_argument("--requests", type=int, default=32, help="requests in all (default 32)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=None, help="the user message of every request")
    parser.add_argument("--dataset", default=None,
                        help="cycle through the prompts of a bundled benchmark set instead (gsm8k, humaneval, ...)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="sampling temperature of the requests (default: the server's, 1.0; 0 is greedy)")
    parser.add_argument("--model", default=None, help="model id to request (default: the one the server lists)")
    parser.add_argument("--api-key", default=None, help=f"the server's key (default: ${API_KEY_VARIABLE} if set)")
    parser.add_argument("--timeout", type=float, default=300.0, help="time limit for the whole run in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=run_loadtest)


def run_loadtest(args) -> int:
    require_extra("serve", "blockspec loadtest")
    from blockspec.serve.loadtest import DEFAULT_PROMPT, print_report
    from blockspec.serve.loadtest import run_loadtest as load

    prompt = args.prompt or DEFAULT_PROMPT
    if args.dataset:
        from blockspec.bench.datasets import load_benchmark_prompts

        prompt = [row["turns"][0] for row in load_benchmark_prompts(args.dataset, num_prompts=args.requests)]
    report = load(args.url, concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
                  prompt=prompt, timeout=args.timeout, model=args.model, api_key=api_key_of(args),
                  temperature=args.temperature)
    print_report(report, args.json)
    return 0 if report.errors == 0 else 1
