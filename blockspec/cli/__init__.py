"""The command line: one module per command, each thin over the library.

Importing it loads no torch or transformers: each command imports them when it runs.
"""

from __future__ import annotations

import argparse
import sys

from blockspec.cli.bench import add_bench_command
from blockspec.cli.demo import add_demo_command
from blockspec.cli.dllm import add_dllm_command
from blockspec.cli.export import add_export_command
from blockspec.cli.generate import add_generate_command
from blockspec.cli.models import add_models_command
from blockspec.cli.options import check_device
from blockspec.cli.serve import add_loadtest_command, add_serve_command
from blockspec.cli.train import add_train_draft_command
from blockspec.errors import BlockspecError

#: The commands, in the order the help lists them.
COMMANDS = (add_generate_command, add_models_command, add_train_draft_command, add_export_command, add_dllm_command,
            add_demo_command, add_bench_command, add_serve_command, add_loadtest_command)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    try:
        check_device(getattr(args, "device", None))
        return args.run(args) or 0
    except BlockspecError as error:
        return fail(str(error), 2)
    except KeyboardInterrupt:
        print("blockspec: interrupted", file=sys.stderr)
        return 130
    except OSError as error:  # the file system or the network refused: say what, and where
        return fail(str(error), 1)
    except Exception as error:
        if not is_damaged_weights(error):
            raise
        return fail(damaged_weights_message(error, args), 2)


def fail(message: str, code: int) -> int:
    """One line of error (a library's message over several lines joined into one)."""
    line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"blockspec: error: {line}", file=sys.stderr)
    return code


def is_damaged_weights(error: Exception) -> bool:
    """A safetensors file that does not parse (cut short by an interrupted download or copy)."""
    return type(error).__name__ == "SafetensorError"


def damaged_weights_message(error: Exception, args) -> str:
    """Which of the command's model directories holds the damaged file, if one can be named."""
    from blockspec.io import incomplete_safetensors

    for option in ("target", "draft", "model", "init", "assistant"):
        value = getattr(args, option, None)
        for path in incomplete_safetensors(value) if isinstance(value, str) else []:
            return f"{path} is incomplete or damaged ({error}): download or save the --{option} model again"
    return f"a model file is incomplete or damaged ({error}): download or save the model again"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blockspec",
                                     description="Lossless speculative decoding with DFlash drafters.")
    commands = parser.add_subparsers(metavar="COMMAND")
    for add_command in COMMANDS:
        add_command(commands)
    return parser
