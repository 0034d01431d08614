"""Every committed table and figure is a `pkv report` target, and every table regenerates
from the committed Parquet byte for byte (CPU, no torch)."""

from pathlib import Path

import pytest

from pkv.report.tables import _build_target, targets

RESULTS = Path(__file__).resolve().parents[1] / "results"
COMMITTED = sorted(p for p in [*RESULTS.glob("tables/*"), *RESULTS.glob("figures/*")]
                   if p.name != "comparison.md")


def test_every_committed_file_is_a_target():
    known = set(targets(RESULTS))
    assert COMMITTED and not [p for p in COMMITTED if p not in known]


@pytest.mark.parametrize("path", [p for p in COMMITTED if p.suffix in (".md", ".tex")], ids=lambda p: p.name)
def test_table_regenerates_byte_for_byte(path):
    assert _build_target(RESULTS, path, {}) == path.read_bytes()


@pytest.mark.parametrize("path", [p for p in COMMITTED if p.suffix == ".png"], ids=lambda p: p.name)
def test_figure_renders(path):
    # PNG bytes depend on the matplotlib/freetype build, so a figure is checked to render, not compared.
    assert _build_target(RESULTS, path, {})[:8] == b"\x89PNG\r\n\x1a\n"
