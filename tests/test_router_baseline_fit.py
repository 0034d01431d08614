"""Each FlashInfer route's own device fit (fixed + bytes + rows, on its
graph-replayed calibration rows), so the overlapped router tells FlashInfer's variants and
pkv-graph apart by the device time they take; constants without fits route as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pkv.config.resolve import load_config, shape_of
from pkv.core.shape import Shape
from pkv.measure import calibrate
from pkv.measure.calibrate import fit_baseline, fit_constants, fit_host_s
from pkv.plan.costmodel import BaselineFit, Constants, GraphFit, RouteCost, Router, baseline_cost, estimate
from router_constants import cpu_constants, fake_measure

ROOT = Path(__file__).resolve().parents[1]
SHAPE = Shape()
KVB = SHAPE.kv_bytes_per_token
CUDA_CORE = BaselineFit(8e-6, 1 / 3.2e12, 9e-6)    # slower per byte, like FlashInfer's CUDA-core decode
TENSOR = BaselineFit(11e-6, 1 / 4.4e12, 2e-6)


def fit_rows(engine: str, fit: BaselineFit, n=200, seed=0, host=4e-4, launch=9e-5) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        lens = rng.integers(1, int(rng.choice([2000, 30000, 130000])), size=int(rng.choice([1, 4, 8])))
        device = fit.device_s(RouteCost(engine, float(lens.sum() * KVB), 0.0, 1, 0.0, len(lens)))
        out.append({"engine": engine, "family": "bimodal", "max_active": 8, "split": 0, "step": i,
                    "active": len(lens), "total_tokens": int(lens.sum()), "graph_s": device,
                    "cuda_s": device + launch, "wall_s": device + launch + host})
    return pd.DataFrame(out)


def test_the_fit_recovers_known_coefficients_from_the_replayed_rows():
    frame = fit_rows("flashinfer", CUDA_CORE)
    got = fit_baseline(frame, "flashinfer", KVB)
    for key in BaselineFit.KEYS:
        assert got[key] == pytest.approx(getattr(CUDA_CORE, key), rel=1e-6), key
    assert got["rows"] == len(frame) and got["rms_log_err"] < 1e-9
    # Rows of the split runs (events only) beside them are not what it fits on.
    events_only = fit_rows("flashinfer", TENSOR, seed=3).assign(graph_s=np.nan, split=8)
    again = fit_baseline(pd.concat([frame, events_only]), "flashinfer", KVB)
    assert again["fixed_s"] == pytest.approx(CUDA_CORE.fixed_s, rel=1e-6) and again["rows"] == len(frame)
    assert fit_baseline(frame, "flashinfer-tc", KVB) is None


def test_host_time_is_wall_beyond_the_span_the_device_fit_uses():
    replayed = fit_rows("flashinfer", CUDA_CORE)                   # wall - graph = launch + host
    events = fit_rows("pkv-workqueue", TENSOR).assign(graph_s=np.nan)   # wall - cuda = host
    host = fit_host_s(pd.concat([replayed, events]))
    assert host["flashinfer"] == pytest.approx(4e-4 + 9e-5) and host["workqueue"] == pytest.approx(4e-4)


def test_estimates_use_the_fit_and_the_router_takes_the_faster_variant():
    k = cpu_constants(baseline_ctas_per_head={"flashinfer": 1.0, "flashinfer-tc": 1.0}, graph=None,
                      baseline_fit={"flashinfer": CUDA_CORE, "flashinfer-tc": TENSOR})
    lens = np.array([40000, 3000, 65000, 9000, 1000, 33000, 2000, 5000])
    for route, fit in (("flashinfer", CUDA_CORE), ("flashinfer-tc", TENSOR)):
        c = baseline_cost(route, SHAPE, lens, k)
        assert c.rows == len(lens) and estimate(c, k, "overlapped") == pytest.approx(fit.device_s(c))
    router = Router(SHAPE, k, ["flashinfer", "flashinfer-tc"], {}, objective="overlapped")
    assert router.decide(np.arange(8), lens).route == "flashinfer-tc"
    # Without fits the two variants are the roofline's: the same estimate at the same CTAs.
    old = Router(SHAPE, cpu_constants(baseline_ctas_per_head={"flashinfer": 1.0, "flashinfer-tc": 1.0}, graph=None),
                 ["flashinfer", "flashinfer-tc"], {}, objective="overlapped", cache=False)
    d = old.decide(np.arange(8), lens)
    assert d.estimates["flashinfer"] == d.estimates["flashinfer-tc"]


def test_constants_round_trip_and_old_constants_have_no_fits():
    committed = json.loads((ROOT / "results" / "calibration" / "constants.json").read_text())
    assert set(Constants.from_dict(committed).baseline_fit) == {"flashinfer", "flashinfer-tc"}
    old = {k: v for k, v in committed.items() if k not in ("graph", "baseline_fit")}   # no pkv-graph fit
    assert Constants.from_dict(old).baseline_fit == {} and Constants.from_dict(old).graph is None
    d = {**old, "graph": {**{k: 1e-6 for k in GraphFit.KEYS}, "num_ctas": 264, "min_tiles": 4},
         "baseline_fit": {"flashinfer": {**{k: getattr(CUDA_CORE, k) for k in BaselineFit.KEYS}, "rows": 9}}}
    assert Constants.from_dict(json.loads(json.dumps(d))).baseline_fit == {"flashinfer": CUDA_CORE}
    with pytest.raises(ValueError, match="out of range"):
        BaselineFit(-1.0, 0.0, 0.0)


def test_the_committed_sweep_refits_to_the_committed_constants():
    """The committed sweep (with its pkv-graph and split-0 baseline rows) gives the committed
    graph and baseline fits again; without those rows, neither fit."""
    committed = json.loads((ROOT / "results" / "calibration" / "constants.json").read_text())
    cal = pd.read_parquet(ROOT / "results" / "raw" / "calibrate" / "calibration.parquet")
    cfg = load_config(ROOT / "results" / "config.json")
    shape = shape_of(cfg)
    fitted = fit_constants(committed, cal, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    # The refit keeps the cut the committed constants name (their sweep ran on it).
    assert fitted["graph"] == pytest.approx({"piece_cost": 0, **committed["graph"]})
    assert set(fitted["baseline_fit"]) == set(committed["baseline_fit"])
    for name, fit in committed["baseline_fit"].items():
        assert fitted["baseline_fit"][name] == pytest.approx(fit)
    old = {k: v for k, v in committed.items() if k not in ("graph", "baseline_fit")}
    before = cal[(cal["engine"] != "pkv-graph") & (cal["split"] != 0)]
    refit = fit_constants(old, before, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    assert "baseline_fit" not in refit and "graph" not in refit


def test_the_split_0_run_replays_graphs_where_the_config_times_them(monkeypatch):
    import yaml

    from pkv.config.resolve import effective

    cfg = effective(yaml.safe_load((ROOT / "config.yaml").read_text()), "smoke")
    cfg["measure"]["graph"] = True

    runs = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(runs, {}))
    calibrate.sweep(cfg, cpu_constants(operating_points={}))
    seen = [(run[3], run[6]) for run in runs]
    assert seen and all(graph == (split == 0) for split, graph in seen) and any(g for _, g in seen)
