"""Router regret table and accuracy figure, from the committed H200 Parquet (into a temp
folder: the committed results are never rewritten) and from constructed rows."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pkv.plan.costmodel import Constants
from pkv.report.router import build, margin_sentence, regret, regret_markdown

ROOT = Path(__file__).resolve().parents[1] / "results"


def _k():
    return Constants("t", 4e12, 1e-5, 132, 1.0, {"flashinfer": 4.0, "flashinfer-tc": 4.0}, ((1024, 1.05),), (4,), 1, 4)


def _rows(engine, wall, graph, route=None, steps=4, route_s=np.nan):
    return [dict(family="bimodal", max_active=4, seed=1, engine=engine, route=route or engine, step=i, active=4,
                 wall_s=wall, cuda_s=graph * 1.2, graph_s=graph, route_s=route_s) for i in range(steps)]


def test_regret_against_the_best_fixed_route_in_hindsight():
    frame = pd.DataFrame(_rows("flashinfer", 8e-4, 1.0e-4) + _rows("pkv-workqueue", 3e-4, 1.1e-4)
                         + _rows("pkv-bucket", 4e-4, 1.2e-4) + _rows("flashinfer-persistent", 1e-4, 0.5e-4)
                         + _rows("adaptive", 4e-4, 1.2e-4, route="pkv-bucket/s32", route_s=4e-6))
    r = regret(frame, _k()).iloc[0]
    # flashinfer-persistent is not a router candidate: never the "best fixed route".
    assert r.best_wall_route == "pkv-workqueue" and r.wall_regret == pytest.approx(0.75)
    assert r.best_device_route == "flashinfer" and r.device_regret == pytest.approx(1.0 / 1.2)
    assert r.route_us_median == pytest.approx(4.0) and r.routes == "pkv-bucket/s32"
    assert r.device_over_flashinfer == pytest.approx(1.0 / 1.2)   # over the faster FlashInfer measured
    text = regret_markdown(regret(frame, _k()), smoke=False)
    assert "| Bimodal B4 |" in text and "0.750 ✗" in text and "Wall bar met on 0 of 1" in text
    assert "device × FlashInfer" in text and "FlashInfer bar" not in text   # the serial router has no such bar


def test_the_overlapped_router_is_judged_against_flashinfer_too():
    frame = pd.DataFrame(_rows("flashinfer", 8e-4, 1.0e-4) + _rows("pkv-workqueue", 3e-4, 0.9e-4)
                         + _rows("adaptive:objective=overlapped", 9e-4, 1.05e-4, route="flashinfer"))
    text = regret_markdown(regret(frame, _k()), smoke=False, margin="Its margin, 1.02, was fitted.")
    assert "FlashInfer bar (≥ 0.98) on 0 of 1 (min 0.952)" in text and "0.952 ✗" in text
    assert "Its margin, 1.02, was fitted." in text


def test_the_margin_sentence_says_where_the_margin_came_from():
    fit = {"margin": 1.02, "worst": 0.9879, "geomean": 0.999}
    assert "1.02, was fitted at calibration on seed 7" in margin_sentence({"overlapped_margin_fit": fit,
                                                                         "calibration_seed": 7})
    assert "the config's" in margin_sentence({"overlapped_margins": [{"max_active": 1024, "margin": 1.05}]})
    assert "serial objective's margins" in margin_sentence({})


@pytest.mark.skipif(not (ROOT / "raw" / "serve").is_dir(), reason="no committed serving Parquet")
def test_from_committed_results(tmp_path):
    md, png = build(ROOT, tmp_path)
    assert md == tmp_path / "tables" / "router_regret.md" and png.stat().st_size > 10_000
    text = md.read_text()
    lines = [line for line in text.splitlines() if line.startswith("| ") and "trace" not in line]
    files = list((ROOT / "raw" / "serve").glob("*.parquet"))
    routers = sorted({line.split("|")[3].strip() for line in lines})
    assert routers and len(lines) == len(files) * len(routers)      # one row per trace-seed and router
    # Each router's summary counts its own rows (the serial one's bar on wall, the overlapped one's on device).
    for router in routers:
        rows = [line.split("|") for line in lines if line.split("|")[3].strip() == router]
        col = 6 if router == "adaptive" else 8
        met = sum("✗" not in r[col] for r in rows)
        label = "Wall bar met on" if router == "adaptive" else "Device bar (≥ 0.97) on"
        assert f"`{router}`: {label} {met} of {len(rows)}" in text, (router, met)
    assert text.rstrip().splitlines()[-1].startswith("Source: ")
