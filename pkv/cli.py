"""The `pkv` command. Each module in COMMAND_MODULES adds its subcommands via add_commands()."""

from __future__ import annotations

import argparse
import importlib
import sys

# Modules that add subcommands; each defines add_commands(subparsers) and gives every
# parser a `func(args) -> int` default.
COMMAND_MODULES = ["pkv.trace_cli", "pkv.pipeline_cli", "pkv.nsight", "pkv.bench", "pkv.report_router"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pkv", description="PersistentKV: paged decode attention experiments")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as e:
        # Bad input ends in one line on stderr, never a traceback.
        print(f"pkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
