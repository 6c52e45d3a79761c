"""`blockspec export`: a draft in the layout another engine loads."""

from __future__ import annotations

EXPORT_CHOICES = ("vllm", "speculators", "hf", "gguf", "sglang")


def add_export_command(commands) -> None:
    parser = commands.add_parser("export", help="write a DFlash or EAGLE-3 draft in the layout another engine loads")
    parser.add_argument("draft", help="the draft's checkpoint directory")
    parser.add_argument("--to", required=True, choices=EXPORT_CHOICES,
                        help="vllm / speculators: vLLM's speculators layout; hf: the public layout (gguf and sglang "
                             "are refused with the reason)")
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--verifier", default=None, help="the target's name or path, recorded in the layout")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.set_defaults(run=run_export)


def run_export(args) -> int:
    from blockspec.models.export import export_draft

    print(export_draft(args.draft, args.to, args.out, verifier=args.verifier, force=args.force))
    return 0
