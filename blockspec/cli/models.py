"""`blockspec models`: list or prepare the known models."""

from __future__ import annotations


def add_models_command(commands) -> None:
    parser = commands.add_parser("models", help="list or prepare the known models that install offline")
    actions = parser.add_subparsers(metavar="ACTION", required=True)
    listing = actions.add_parser("list", help="show the known models and whether they are prepared")
    listing.set_defaults(run=run_models_list)
    prepare = actions.add_parser("prepare", help="install and convert a known model once")
    prepare.add_argument("name")
    prepare.add_argument("--force", action="store_true", help="convert again even if already prepared")
    prepare.set_defaults(run=run_models_prepare)


def run_models_list(args) -> int:
    from blockspec import hub

    for row in hub.list_models():
        state = f"prepared at {row['path']}" if row["prepared"] else "not prepared"
        default = " (default)" if row["default"] else ""
        print(f"{row['name']}{default}: {row['role']}, {row['size']}, {row['licence']}; {state}")
    return 0


def run_models_prepare(args) -> int:
    from blockspec import hub

    print(hub.prepare(args.name, force=args.force))
    return 0
