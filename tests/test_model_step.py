"""The model-level decode step (pkv.measure.model_step) and its report (pkv.report.model), on the CPU.

The smoke run goes end to end (traces -> steps -> N layers with pkv-graph's CPU oracle
and the FP32 reference -> Parquet -> table and figure); the bucket and padding rules and
the report's arithmetic are checked on their own.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from pkv.engines import model as runners
from pkv.measure import model_step as ms
from pkv.report import model as rm
from pkv.core.harness import StepState
from pkv.core.io import read_meta, write_parquet
from pkv.core.paging import assign_pages, flashinfer_view


def test_bucket_of():
    buckets = [32, 1, 8]
    assert [ms.bucket_of(b, buckets) for b in (1, 2, 7, 8, 9, 31, 32)] == [1, 8, 8, 8, 32, 32, 32]
    for bad in (0, 33):
        with pytest.raises(ValueError, match="fits none of the batch buckets"):
            ms.bucket_of(bad, buckets)


def test_padded_flashinfer_view():
    assignment = assign_pages(np.array([40, 17, 3, 64, 5]), 16, 0.5, seed=7)
    step = StepState(0, np.array([3, 0, 2]), np.array([33, 40, 1], dtype=np.int32))
    real = flashinfer_view(assignment, step.request_ids, step.seq_lens)
    v = runners.padded_flashinfer_view(assignment, step, 8, pad_page=0)
    assert len(v.indptr) == 9 and len(v.last_page_len) == 8
    np.testing.assert_array_equal(v.indptr[:4], real.indptr)
    np.testing.assert_array_equal(v.indices[:real.indptr[-1]], real.indices)
    np.testing.assert_array_equal(v.last_page_len[:3], real.last_page_len)
    # Padding rows: one page each (page 0), one token on it.
    np.testing.assert_array_equal(np.diff(v.indptr)[3:], np.ones(5))
    np.testing.assert_array_equal(v.indices[real.indptr[-1]:], np.zeros(5))
    np.testing.assert_array_equal(v.last_page_len[3:], np.ones(5))
    assert v.indptr.dtype == v.indices.dtype == v.last_page_len.dtype == np.int32
    np.testing.assert_array_equal(runners.padded_flashinfer_view(assignment, step, 3).indptr, real.indptr)
    with pytest.raises(ValueError, match="cannot be padded"):
        runners.padded_flashinfer_view(assignment, step, 2)


def test_spread_steps_cover_the_whole_trace():
    from pkv.core.harness import decode_steps
    from pkv.core.traces import SyntheticSpec, synthetic

    trace = synthetic(SyntheticSpec("bimodal", 3, num_requests=6, decode_min=4, decode_max=9, scale=1 / 64))
    every = list(decode_steps(trace, 4))
    picked = ms.spread_steps(trace, 4, 5)
    assert [s.step for s in picked] == [every[i].step for i in np.linspace(0, len(every) - 1, 5).round().astype(int)]
    assert picked[0].step == every[0].step and picked[-1].step == every[-1].step
    assert [s.step for s in ms.spread_steps(trace, 4, 10_000)] == [s.step for s in every]


def test_model_shapes():
    assert ms.MODEL_SHAPES["llama-1b"] == ms.ModelShape("llama-1b", 16, 2048, 32, 8, 64, 8192)
    assert ms.MODEL_SHAPES["llama-8b"] == ms.ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336)
    assert ms.MODEL_SHAPES["llama-8b"].qkv == 6144
    with pytest.raises(ValueError, match="hidden"):
        ms.ModelShape("bad", 2, 100, 4, 2, 16, 64)


def test_adaptive_point():
    k = SimpleNamespace(operating_points={"bimodal-b4": {}, "bimodal-b8": {}, "zipf-b8": {}})
    assert ms.adaptive_point(k, "bimodal", 8, "fb") == "bimodal-b8"
    assert ms.adaptive_point(k, "bimodal", 32, "fb") == "bimodal-b8"
    assert ms.adaptive_point(k, "bimodal", 1, "fb") == "bimodal-b4"
    assert ms.adaptive_point(k, "external", 8, "fb") == "fb"


def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "raw" / "model_step" / "smoke.parquet"
    assert ms.main(["--smoke", "--out", str(out)]) == 0
    frame = pq.read_table(out).to_pandas()
    assert list(frame.columns) == list(ms.COLUMNS)
    assert set(frame["engine"]) == {"pkv-graph", "reference"}
    assert set(frame["kind"]) == {"step", "pipelined"}
    assert set(frame["family"]) == {"bimodal", "external"}
    steps = frame[frame["kind"] == "step"]
    assert not steps["failed"].any() and (steps["rel_err"] < 1e-3).all()
    assert steps["wall_s"].gt(0).all() and steps["prepare_s"].gt(0).all() and steps["device_s"].isna().all()
    pipe = frame[frame["kind"] == "pipelined"]
    assert (pipe["tokens"] > 0).all() and (pipe["wall_s"] > 0).all()
    meta = read_meta(out)
    for key in ("git_commit", "gpu", "torch", "config_hash", "command", "method", "skipped", "profile"):
        assert key in meta
    assert meta["profile"] == "smoke" and meta["skipped"] == "[]" and "--smoke" in meta["command"]

    md, png = tmp_path / "tables" / "model_step.md", tmp_path / "figures" / "model_step.png"
    assert rm.main(["--target", str(md), "--target", str(png)]) == 0
    text = md.read_text()
    assert "CPU smoke — not a performance result" in text and "| smoke " in text
    assert re.search(r"\| 0/\d+ +\|", text) and not re.search(r"\| [1-9]\d*/\d+ +\|", text)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_padded_steps_match_the_reference():
    """Steps of 2-4 rows run in bucket 8: pkv-graph (padded, its CPU oracle) equals the reference."""
    args = ms.build_parser().parse_args(["--smoke", "--out", "unused", "--families", "homogeneous",
                                         "--buckets", "1,8", "--steps", "2"])
    plan = ms.build_plan(args)
    frame, skipped = ms.run(plan, log=lambda m: None)
    assert skipped == []
    steps = frame[(frame["kind"] == "step") & (frame["max_active"] == 8)]
    padded = steps[steps["bucket"] == 8]
    assert len(padded) and (padded["active"] < 8).all() and 4 in set(padded["active"])
    assert not steps["failed"].any() and (steps["rel_err"] < 1e-3).all()


def test_a_wrong_attention_fails_the_check(monkeypatch):
    monkeypatch.setattr(runners.PkvGraphRunner, "attend", lambda self, bucket: (lambda q: torch.zeros_like(q)))
    args = ms.build_parser().parse_args(["--smoke", "--out", "unused", "--families", "bimodal", "--buckets", "4",
                                         "--steps", "2"])
    frame, _ = ms.run(ms.build_plan(args), log=lambda m: None)
    steps = frame[frame["kind"] == "step"]
    assert steps[steps["engine"] == "pkv-graph"]["failed"].all()
    assert not steps[steps["engine"] == "reference"]["failed"].any()


def test_budget_skips_jobs_and_names_them():
    args = ms.build_parser().parse_args(["--smoke", "--out", "unused", "--families", "bimodal", "--steps", "1",
                                         "--budget-s", "0"])
    frame, skipped = ms.run(ms.build_plan(args), log=lambda m: None)
    assert frame.empty and skipped == ["smoke/bimodal-20260623/B1", "smoke/bimodal-20260623/B4"]


def test_failures_drop_an_engine_or_a_job_and_keep_the_rest(monkeypatch):
    def broken_capture(self, bucket, step):
        raise RuntimeError("capture failed\nsecond line")

    monkeypatch.setattr(runners.PkvGraphRunner, "capture", broken_capture)
    args = ms.build_parser().parse_args(["--smoke", "--out", "unused", "--families", "bimodal,azure", "--buckets", "2",
                                         "--steps", "1"])
    plan = ms.build_plan(args)
    real = ms.measure_job

    def measure_job(plan, model, cache, job, *rest):
        if job.family == "external":
            raise ValueError("measurement failed")
        return real(plan, model, cache, job, *rest)

    monkeypatch.setattr(ms, "measure_job", measure_job)
    dropped = {}
    frame, skipped = ms.run(plan, log=lambda m: None, dropped=dropped)
    assert set(frame["engine"]) == {"reference"} and set(frame["family"]) == {"bimodal"}
    assert dropped == {"pkv-graph": "RuntimeError: capture failed",
                       "smoke/azure-AzureLLMInferenceTrace_conv": "ValueError: measurement failed"}


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "nope"], "unknown model shape"),
    (["--engines", "flashinfer-graph"], "runs engines from"),
    (["--buckets", "0,4"], "positive"),
])
def test_bad_arguments_are_one_line(tmp_path, capsys, argv, message):
    assert ms.main(["--smoke", "--out", str(tmp_path / "x.parquet"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pkv.measure.model_step: error: ") and message in err[0]
    assert not (tmp_path / "x.parquet").exists()


# ---------------------------------------------------------------- the report on a synthetic frame


def synthetic_frame() -> pd.DataFrame:
    """Two seeds; pkv-graph takes half of flashinfer-graph's wall and device time per step and
    pipelines at 1.5x its throughput; one failed check."""
    rows = []
    times = {"pkv-graph": (1.0, 0.5, 3.0), "flashinfer-graph": (2.0, 1.0, 2.0), "flashinfer-eager": (4.0, 2.0, 1.0)}
    for seed in (1, 2):
        for engine, (wall, dev, pipe) in times.items():
            base = {c: None for c in ms.COLUMNS}
            base.update(stage="model_step", model="llama-1b", layers=16, hidden=2048, head_dim=64, num_qo_heads=32,
                        num_kv_heads=8, mlp=8192, dtype="float16", trace=f"bimodal-{seed}", family="bimodal",
                        seed=seed, max_active=8, bucket=8, engine=engine, route=engine,
                        launch="eager" if engine.endswith("eager") else "graph")
            for step in range(3):
                rows.append({**base, "kind": "step", "step": step, "active": 8, "total_tokens": 8000 + step,
                             "max_len": 1000, "steps": 1, "tokens": 8, "wall_s": wall * 1e-3 * (1 + 0.1 * step),
                             "prepare_s": 20e-6, "device_s": dev * 1e-3 * (1 + 0.1 * step), "rel_err": 1e-4,
                             "max_rel_err": 2e-4, "failed": engine == "pkv-graph" and seed == 2 and step == 1})
            rows.append({**base, "kind": "pipelined", "step": -1, "active": 8, "total_tokens": 24003, "max_len": 1000,
                         "steps": 3, "tokens": 24, "wall_s": 24 / (1000 * pipe), "prepare_s": math.nan,
                         "device_s": math.nan, "rel_err": math.nan, "max_rel_err": math.nan, "failed": False})
    return pd.DataFrame(rows, columns=list(ms.COLUMNS)).astype(ms.COLUMNS)


def test_report_ratios_on_a_synthetic_frame(tmp_path):
    frame = synthetic_frame()
    t = rm.t_model_step(SimpleNamespace(frame=frame))
    assert list(t["Engine"]) == ["pkv-graph", "flashinfer-graph", "flashinfer-eager"]
    row = t.iloc[0]
    assert row["Wall × flashinfer-graph"] == "2.000±0.000" and row["Device × flashinfer-graph"] == "2.000±0.000"
    assert row["Pipelined × flashinfer-graph"] == "1.500±0.000"
    assert row["Wall ms"] == "1.100" and row["Pipelined tok/s"] == "3000" and row["Prepare µs"] == "20.0"
    assert row["Check fails"] == "1/6" and row["Seeds"] == 2
    assert t.iloc[2]["Wall × flashinfer-graph"] == "0.500±0.000"

    write_parquet(frame, tmp_path / "raw" / "model_step" / "a.parquet",
                  {"gpu": "NVIDIA H200", "profile": "paper", "command": "python3 -m pkv.measure.model_step --out x",
                   "skipped": '["llama-8b/zipf-1/B32"]'})
    md, png = tmp_path / "tables" / "model_step.md", tmp_path / "figures" / "model_step.png"
    rm.write_targets(tmp_path, [md, png])
    text = md.read_text()
    assert "not a performance result" not in text and "NVIDIA H200" in text
    assert "skipped past the time budget: llama-8b/zipf-1/B32" in text and "python3 -m pkv.measure.model_step" in text
    assert png.stat().st_size > 1000


def test_report_refuses_a_missing_stage_and_mixed_gpus(tmp_path):
    with pytest.raises(ValueError, match="no Parquet"):
        rm.load(tmp_path)
    frame = synthetic_frame()
    for name, gpu in (("a", "NVIDIA H200"), ("b", "NVIDIA H100")):
        write_parquet(frame, tmp_path / "raw" / "model_step" / f"{name}.parquet", {"gpu": gpu})
    with pytest.raises(ValueError, match="several GPU models"):
        rm.load(tmp_path)
