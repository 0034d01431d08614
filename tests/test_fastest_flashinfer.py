"""The "fastest FlashInfer path" rule on synthetic frames: every ratio is over the fastest of
the FlashInfer paths measured beside it (planned CUDA-core and tensor-core decode, plan-free
XQA; FlashInfer's graph paths in the model step), and the tables name the path that won."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd

from pkv.engines import table
from pkv.report import model as rm
from pkv.report.ratios import ratios
from test_model_step import synthetic_frame


def serving_frame() -> pd.DataFrame:
    """Two seeds, four steps each: flashinfer-tc the fastest on wall, flashinfer-xqa on CUDA time."""
    times = {"flashinfer": (4.0, 2.0), "flashinfer-tc": (2.0, 1.5), "flashinfer-xqa": (3.0, 1.0),
             "pkv-graph": (1.0, 0.5)}   # engine: (wall ms, cuda ms) a step
    rows = [{"family": "bimodal", "max_active": 8, "seed": seed, "engine": e, "active": 8, "wall_s": w * 1e-3,
             "cuda_s": c * 1e-3, "graph_s": c * 1e-3} for seed in (1, 2) for e, (w, c) in times.items()
            for _ in range(4)]
    return pd.DataFrame(rows)


def test_xqa_is_a_baseline_of_every_ratio():
    assert "flashinfer-xqa" in table.baselines()
    r = ratios(serving_frame(), ["family", "max_active", "seed"])
    pkv = r[r["engine"] == "pkv-graph"]
    assert (pkv["wall_ratio"].round(6) == 2.0).all()     # over flashinfer-tc's wall (2 ms)
    assert (pkv["cuda_ratio"].round(6) == 2.0).all()     # over flashinfer-xqa's CUDA time (1 ms)
    assert set(r.loc[r["engine"] == "pkv-graph", "wall_base"]) == {"flashinfer-tc"}
    assert set(r.loc[r["engine"] == "pkv-graph", "cuda_base"]) == {"flashinfer-xqa"}


def test_without_xqa_the_ratios_are_as_before():
    f = serving_frame()
    r = ratios(f[f["engine"] != "flashinfer-xqa"], ["family", "max_active", "seed"])
    pkv = r[r["engine"] == "pkv-graph"]
    assert (pkv["cuda_ratio"].round(6) == 3.0).all() and set(pkv["cuda_base"]) == {"flashinfer-tc"}


def with_xqa_graph(frame: pd.DataFrame, wall: float, device: float) -> pd.DataFrame:
    """`frame` plus flashinfer-xqa-graph steps at `wall` and `device` times flashinfer-graph's."""
    x = frame[frame["engine"] == "flashinfer-graph"].copy()
    x["engine"] = "flashinfer-xqa-graph"
    x["wall_s"] *= wall
    x["device_s"] *= device
    x["route"] = "flashinfer-xqa-graph"
    return pd.concat([frame, x], ignore_index=True)


def test_model_step_ratios_take_the_faster_graph_path_and_name_it():
    """XQA's graph path half of the planned one's device time, 1.5x its wall: pkv-graph's device
    ratio is over XQA's, its wall ratio over the planned path's, and the column says so."""
    frame = with_xqa_graph(synthetic_frame(), wall=1.5, device=0.5)
    assert rm.ratio_bases(frame) == ["flashinfer-graph", "flashinfer-xqa-graph"]
    t = rm.t_model_step(SimpleNamespace(frame=frame))
    row = t[t["Engine"] == "pkv-graph"].iloc[0]
    assert row["Wall × fastest FlashInfer"] == "2.000±0.000"        # over flashinfer-graph's wall
    assert row["Device × fastest FlashInfer"] == "1.000±0.000"      # over flashinfer-xqa-graph's device time
    assert row["FlashInfer path (wall / device)"] == "flashinfer-graph / flashinfer-xqa-graph"
    assert list(t["Engine"]) == ["pkv-graph", "flashinfer-graph", "flashinfer-eager", "flashinfer-xqa-graph"]


def test_model_step_fp8_16_bit_ratio_takes_the_faster_path_too():
    frame = with_xqa_graph(synthetic_frame(kv=True), wall=1.0, device=0.25)
    t = rm.t_model_step(SimpleNamespace(frame=frame))
    fp8 = t[(t["KV"] == "fp8") & (t["Engine"] == "pkv-graph")].iloc[0]
    assert fp8["Device × fastest FlashInfer 16-bit"] == "1.000±0.000"    # XQA 16-bit: a quarter of planned


def test_one_graph_path_keeps_the_table_as_it_was():
    t = rm.t_model_step(SimpleNamespace(frame=synthetic_frame()))
    assert "FlashInfer path (wall / device)" not in t and "Wall × flashinfer-graph" in t


def test_base_path_names_the_winner_per_timing():
    from pkv.report.ratios import base_path

    r = ratios(serving_frame(), ["family", "max_active", "seed"])
    assert base_path(r[r["engine"] == "pkv-graph"]) == "flashinfer-tc / flashinfer-xqa"
    split = pd.DataFrame({"wall_base": ["flashinfer-tc", "flashinfer-xqa", "flashinfer-xqa"],
                          "cuda_base": ["flashinfer-xqa"] * 3})
    assert base_path(split) == "flashinfer-xqa 2/3, flashinfer-tc 1/3 / flashinfer-xqa"


def kernel_rows(family: str, times: dict, **extra) -> list[dict]:
    return [{"family": family, "case": case, "engine": e, "graph_us": us, "bytes": 1e6, "frac_of_roofline": 0.5,
             "batch": 1, "max_len": 4096, **extra} for case, per in times.items() for e, us in per.items()]


def test_the_kernel_tables_name_the_fastest_flashinfer_path():
    from pkv.report.fp8 import kernel_summary
    from pkv.report.kernels import summary

    times = {"B1 1K": {"pkv-graph": 10.0, "flashinfer": 14.0, "flashinfer-tc": 12.0, "flashinfer-xqa": 9.0},
             "B8 32K": {"pkv-graph": 100.0, "flashinfer": 140.0, "flashinfer-tc": 110.0, "flashinfer-xqa": 120.0}}
    s = summary(pd.DataFrame(kernel_rows("homogeneous", times)))
    assert list(s["best_path"]) == ["flashinfer-xqa", "flashinfer-tc"]
    assert list(s["ratio"].round(3)) == [0.9, 1.1]
    rows = []
    for kv, policy in (("auto", ""), ("fp8", "tensor")):
        rows += kernel_rows("fp8", times, kv_dtype=kv, fp8_policy=policy)
    f = pd.DataFrame(rows).rename(columns={"case": "point"})
    k = kernel_summary(f)
    assert list(k["flashinfer fp8 path"]) == ["flashinfer-xqa", "flashinfer-tc"]
    assert list(k["flashinfer 16-bit"]) == [9.0, 110.0]


def test_tables_name_the_path_where_xqa_ran_and_keep_earlier_runs_columns():
    from pkv.report import kernels
    from pkv.report.ratios import names_path

    assert names_path(["flashinfer", "flashinfer-tc", "flashinfer-xqa", "pkv-graph"])
    assert not names_path(["flashinfer", "flashinfer-tc", "pkv-graph"]) and not names_path(["reference"])
    times = {"B1 1K": {"pkv-graph": 10.0, "flashinfer": 14.0, "flashinfer-tc": 12.0, "flashinfer-xqa": 9.0}}
    frame = pd.DataFrame(kernel_rows("homogeneous", times))
    text = kernels.table(frame, {})
    assert "| fastest FlashInfer |" in text and "| flashinfer-xqa | 0.900 |" in text
    before = kernels.table(frame[frame["engine"] != "flashinfer-xqa"], {})
    assert "fastest FlashInfer" not in before and "| 1.200 |" in before
