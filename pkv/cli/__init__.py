"""The `pkv` command line: `main` dispatches to one module per command group."""

from pkv.cli.main import main

__all__ = ["main"]
