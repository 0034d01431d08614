"""The `pkv` command (also `python -m pkv`).

Each module in COMMANDS adds its subcommands via add_commands(); only the module of the
command being run is imported, so `pkv --help`, `pkv report` and `pkv trace` start
without torch. Every option's help shows its default.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import pkv

# Command -> (module that adds it, one-line help for `pkv --help`). Each module defines
# add_commands(subparsers) and gives every parser a `func(args) -> int` default;
# tests/test_cli.py checks that this table and the modules agree.
COMMANDS = {
    "trace": ("pkv.cli.trace", "inspect request traces"),
    "freeze-config": ("pkv.cli.pipeline", "write the resolved experiment config every command reads"),
    "build-kernels": ("pkv.cli.pipeline", "build every kernel the run loads, side by side, before it measures"),
    "calibrate": ("pkv.cli.pipeline", "fit and freeze the cost-model constants (calibration seed only)"),
    "measure": ("pkv.cli.pipeline", "run one measurement job of a pipeline stage"),
    "nsight": ("pkv.cli.pipeline", "capture the short B8 trace under Nsight Compute (ncu) to CSV"),
    "report": ("pkv.cli.pipeline", "regenerate tables and figures from the Parquet under RESULTS_DIR"),
    "compare": ("pkv.cli.pipeline", "a run's tables beside the committed reference run's (ratios side by side)"),
    "nsight-parse": ("pkv.measure.nsight", "parse an ncu CSV capture into per-invocation Parquet (Table 5)"),
    "bench": ("pkv.cli.bench", "benchmarks"),
}
COMMAND_MODULES = list(dict.fromkeys(module for module, _ in COMMANDS.values()))
# Commands that may use the GPU: the warm worker (pkv/cli/worker.py) runs them in a child
# that has FlashInfer and its CUDA context loaded before the command starts.
GPU_COMMANDS = frozenset({"build-kernels", "calibrate", "measure", "nsight", "bench"})


class DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option that has a default worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, [], argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subparsers (at any depth) show defaults too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        # An option with a default but no help text still shows its default.
        if kwargs.get("help") is None and args and str(args[0]).startswith("-") \
                and kwargs.get("default") not in (None, False, []):
            kwargs["help"] = "(default: %(default)s)"
        return super().add_argument(*args, **kwargs)


class VersionAction(argparse.Action):
    """--version, computed only when asked for: it imports torch, which `pkv --help` must not."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version, commit, torch, CUDA and FlashInfer, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(pkv.version_line())
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every command listed; only `command`'s module is imported (all of
    them when `command` is None, none for an unknown one)."""
    parser = Parser(prog="pkv", description="PersistentKV: paged decode attention experiments")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    modules = COMMAND_MODULES if command is None else [COMMANDS[command][0]] if command in COMMANDS else []
    for name in modules:
        importlib.import_module(name).add_commands(sub)
    for name, (_, text) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=text, add_help=False)   # listed in --help; its module loads when run
    return parser


def _command(argv: list[str]) -> str | None:
    """The command word of argv (the first argument that is not an option), if known."""
    for arg in argv:
        if not arg.startswith("-"):
            return arg if arg in COMMANDS else None
    return None


# Packages of the `pipeline` extra (pyproject.toml) and those they bring (yaml, jsonschema): a
# kernel-only install (`pip install pkv`, pkv.api alone) lacks them.
PIPELINE_PACKAGES = frozenset({"pandas", "pyarrow", "seaborn", "matplotlib", "snakemake", "tqdm", "tabulate", "yaml",
                               "jsonschema"})


def missing_package(e: ModuleNotFoundError, command: str | None) -> str:
    """One line for a command whose package is not installed: which extra brings it."""
    name = (e.name or "").split(".")[0]
    what = f"`pkv {command}`" if command else "pkv"
    if name in PIPELINE_PACKAGES:
        return (f"{what} needs {name}, from the pipeline extra, which this install lacks (the kernels alone); "
                "install it with: pip install 'pkv[pipeline]' (or, in a checkout, pip install -e '.[pipeline]')")
    return f"{what} needs the Python package {name!r}, which is not installed"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    try:
        args = build_parser(command or "").parse_args(argv)
        return int(args.func(args) or 0)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "pkv":   # pkv's own module: a broken install, not a missing extra
            raise
        print(f"pkv: error: {missing_package(e, command)}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        # Bad input ends in one line on stderr, never a traceback.
        print(f"pkv: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
