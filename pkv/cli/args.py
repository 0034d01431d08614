"""Checked argument types for the `pkv` commands: a bad flag value is refused by argparse
in one line that names the flag ("argument --step-ms: must be a finite number > 0, got
'nan'"), before anything is built or measured."""

from __future__ import annotations

import argparse
import math

SEED_MAX = 2**32 - 1   # as the schema's seeds (workflow/schemas/config.schema.yaml)


def integer(lo: int, hi: int | None = None):
    """An int in lo..hi; its text must be an integer ("4", not "4.0")."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < lo or (hi is not None and value > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def positive_number(hi: float = math.inf):
    """A finite float > 0 (and <= hi): NaN and infinities are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not 0 < value <= hi or not math.isfinite(value):
            bound = "> 0" if hi == math.inf else f"in (0, {hi}]"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


seed = integer(0, SEED_MAX)
