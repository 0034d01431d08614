"""The kernel benchmark's table and figure from Parquet alone (pkv.report.kernels), on the CPU."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pkv.core import io
from pkv.core.units import K
from pkv.report.kernels import fit_b1, load, main, summary


def synthetic(tmp_path):
    rows = []
    for b, ctx in ((1, 4 * K), (1, 8 * K), (1, 64 * K), (16, 2 * K)):
        nbytes = b * ctx * 4096
        for engine, fixed, beta in (("pkv-graph", 5.0, 4400.0), ("flashinfer", 9.0, 3300.0),
                                    ("flashinfer-tc", 11.0, 4300.0), ("flashinfer-persistent", 13.0, 4300.0)):
            us = fixed + nbytes / (beta * 1e3)
            rows.append(dict(family="homogeneous", case=f"B{b} {ctx // K}K", batch=b, max_len=ctx, engine=engine,
                             graph_us=us, bytes=nbytes, frac_of_roofline=nbytes / us / 4.5e3 / 1e3))
    rows.append(dict(family="ragged", case="mix", batch=3, max_len=9000, engine="pkv-graph", graph_us=30.0,
                     bytes=50_000_000, frac_of_roofline=0.5))
    rows.append(dict(family="ragged", case="mix", batch=3, max_len=9000, engine="flashinfer-tc", graph_us=33.0,
                     bytes=50_000_000, frac_of_roofline=0.4))
    path = tmp_path / "sweep.parquet"
    io.write_parquet(pd.DataFrame(rows), path, {"command": "pkv bench kernels", "roofline_gbps": "4500"})
    return path


def test_fit_recovers_fixed_cost_and_bandwidth(tmp_path):
    frame, _ = load(synthetic(tmp_path))
    fixed, beta = fit_b1(frame, "pkv-graph")
    assert fixed == pytest.approx(5.0, abs=1e-6) and beta == pytest.approx(4400.0, rel=1e-6)


def test_ratio_is_faster_flashinfer_over_pkv(tmp_path):
    frame, _ = load(synthetic(tmp_path))
    s = summary(frame)
    best = min(9.0 + 4 * K * 4096 / 3.3e6, 11.0 + 4 * K * 4096 / 4.3e6)
    assert s.ratio["B1 4K"] == pytest.approx(best / (5.0 + 4 * K * 4096 / 4.4e6))
    assert s.ratio["mix"] == pytest.approx(1.1)


def test_table_and_figure_written(tmp_path):
    table, fig = tmp_path / "k.md", tmp_path / "k.png"
    assert main([str(synthetic(tmp_path)), "--table", str(table), "--figure", str(fig)]) == 0
    text = table.read_text()
    assert "Fixed cost per call (B1 fit, 4K–128K): **5.0 µs**" in text and "| mix |" in text
    assert fig.read_bytes()[:4] == b"\x89PNG"


def test_missing_or_foreign_parquet_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no kernel benchmark Parquet"):
        load(tmp_path / "nope.parquet")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="unreadable Parquet"):
        load(bad)
    other = tmp_path / "other.parquet"
    io.write_parquet(pd.DataFrame({"x": np.arange(3)}), other, {})
    with pytest.raises(ValueError, match="missing columns"):
        load(other)


def test_the_method_line_says_how_the_pools_were_allocated():
    from pkv.report.kernels import pools_note

    assert "16-bit and FP8 pools carved" in pools_note({"kv_pools": "arena-fp8"})   # FP8 copies in the arena
    assert "16-bit pools carved" in pools_note({"kv_pools": "arena"}) and "FP8" not in pools_note({"kv_pools": "arena"})
    assert pools_note({}) == ""
