"""The host-scheduled routes' own device fits (RouteFit: the roofline's terms with each
route's coefficients, on its graph-replayed calibration rows at the frozen split).

The shared roofline's C_min and lambda are fitted on CUDA events of the split grid, whose
span holds the host's launch submission, so they overprice the scheduled routes' device
time and the overlapped router would keep FlashInfer where a scheduled route is faster.
Constants without route fits use the shared roofline; the committed constants have them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pkv.config.resolve import load_config, shape_of
from pkv.core.shape import Shape
from pkv.measure.calibrate import fit_constants, fit_device_terms, fit_host_s, fit_route, operating_points
from pkv.plan.costmodel import OBJECTIVES, Constants, RouteCost, RouteFit, Router, bucket_cost, estimate, workqueue_cost
from pkv.plan.schedule import TILE_TOKENS, SplitPolicy, num_tiles

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "calibration" / "constants.json"
CALIBRATION = ROOT / "results" / "raw" / "calibrate" / "calibration.parquet"
SHAPE = Shape()
SMS = 132
# Synthetic H200-like fits: streaming at a few TB/s past about one CTA per SM, a few us per
# launch (the fits below recover them from rows made with them).
WORKQUEUE = RouteFit(1.7e-5, 2.34e-13, 0.8, 2e-12, 0.0)
BUCKET = RouteFit(4.7e-6, 2.46e-13, 0.9, 0.0, 4.4e-6)


def _rows(engine: str, kind: str, fit: RouteFit, n=240, seed=0, split=0, host=2e-4, launch=5e-5) -> pd.DataFrame:
    """Steps of a route at one split: device time from `fit`, events `launch` above it, wall `host` above that."""
    rng = np.random.default_rng(seed)
    cost_of = {"workqueue": workqueue_cost, "bucket": bucket_cost}[kind]
    out = []
    for i in range(n):
        lens = rng.integers(1, int(rng.choice([2000, 30000, 130000])), size=int(rng.choice([1, 4, 8])))
        c = cost_of(SHAPE, lens, SplitPolicy(int(rng.choice([4, 12, 24, 48])), 4))
        device = fit.device_s(c, SMS)
        out.append({"engine": engine, "family": "bimodal", "max_active": 8, "split": split, "step": i,
                    "active": len(lens), "total_tokens": int(lens.sum()), "useful_kv_bytes": c.kv_bytes,
                    "decode_ctas": c.ctas, "merge_bytes": c.merge_bytes, "launches": c.launches,
                    "task_kv_bytes": c.task_bytes,
                    "graph_s": device, "cuda_s": device + launch, "wall_s": device + launch + host})
    return pd.DataFrame(out)


def test_the_fit_recovers_known_coefficients_from_the_replayed_split_0_rows():
    frame = _rows("pkv-workqueue", "workqueue", WORKQUEUE)
    got = fit_route(frame, "pkv-workqueue", SMS)
    for key in RouteFit.KEYS:
        assert got[key] == pytest.approx(getattr(WORKQUEUE, key), rel=1e-6, abs=1e-18), key
    assert got["rows"] == len(frame) and got["rms_log_err"] < 1e-9
    # The split grid's rows (events only, a split of their own) beside them are not what it fits on.
    grid = _rows("pkv-workqueue", "workqueue", BUCKET, seed=3, split=8).assign(graph_s=np.nan)
    again = fit_route(pd.concat([frame, grid]), "pkv-workqueue", SMS)
    assert again["rows"] == len(frame) and again["fixed_s"] == pytest.approx(WORKQUEUE.fixed_s, rel=1e-6)
    # A sweep without the route's split-0 rows: no fit.
    assert fit_route(grid, "pkv-workqueue", SMS) is None
    assert fit_route(frame, "pkv-bucket", SMS) is None


def test_the_fit_recovers_the_longest_task_term_and_older_rows_fit_none():
    """With few CTAs a step waits for its longest task. The fit recovers that
    term's coefficient; rows without the column (`task_kv_bytes`) fit it as 0, and
    constants without the key load with 0 (their estimates unchanged)."""
    fit = dataclasses.replace(WORKQUEUE, c_min=0.5, s_per_task_byte=6e-12)
    frame = _rows("pkv-workqueue", "workqueue", fit, seed=11)
    got = fit_route(frame, "pkv-workqueue", SMS)
    for key in RouteFit.KEYS:
        assert got[key] == pytest.approx(getattr(fit, key), rel=1e-6, abs=1e-18), key
    older = fit_route(frame.drop(columns=["task_kv_bytes"]), "pkv-workqueue", SMS)
    assert older["s_per_task_byte"] == 0.0 and older["rms_log_err"] > 1e-3
    legacy = {key: getattr(WORKQUEUE, key) for key in RouteFit.KEYS if key != "s_per_task_byte"}
    assert RouteFit.from_dict(legacy) == WORKQUEUE and WORKQUEUE.s_per_task_byte == 0.0
    lens = np.array([30000, 900, 700, 500])
    c = workqueue_cost(SHAPE, lens, SplitPolicy(8, 4))
    # The longest row's 8 chunks are the longest tasks: ceil(tiles / 8) tiles of one KV head.
    assert c.task_bytes == -(-num_tiles(30000) // 8) * TILE_TOKENS * SHAPE.kv_bytes_per_head_token
    assert fit.device_s(c, SMS) - WORKQUEUE.device_s(c, SMS) == pytest.approx(
        c.kv_bytes * WORKQUEUE.s_per_kv_byte * (max(1, 0.5 / (c.ctas / SMS)) - max(1, 0.8 / (c.ctas / SMS)))
        + c.task_bytes * 6e-12, rel=1e-9)


def test_a_fit_that_prices_some_step_at_zero_is_no_fit():
    """Timings explained by merge bytes alone (the CPU smoke's can be) would cost a step
    without a split at zero: no route fit then, the shared roofline instead."""
    rng = np.random.default_rng(5)
    n = 48
    merge = rng.uniform(1e4, 1e6, n)
    frame = pd.DataFrame({"engine": "pkv-workqueue", "split": 0, "useful_kv_bytes": rng.uniform(1e6, 1e9, n),
                          "decode_ctas": rng.integers(8, 500, n).astype(float), "merge_bytes": merge,
                          "launches": 2, "graph_s": merge * 1e-9, "cuda_s": merge * 1e-9 + 5e-5,
                          "wall_s": merge * 1e-9 + 2e-4})
    assert fit_route(frame, "pkv-workqueue", SMS) is None
    frame["graph_s"] += 4e-6                      # a fixed cost too: a fit (fixed and 2 launches are collinear)
    fit = fit_route(frame, "pkv-workqueue", SMS)
    assert fit["fixed_s"] + 2 * fit["s_per_launch"] == pytest.approx(4e-6, rel=1e-3)


def test_estimates_use_the_route_fit_under_both_objectives():
    # With the longest task's term: the router's plain-int (8 rows) and numpy (60 rows)
    # counts of it are the cost functions'.
    fits = {"workqueue": dataclasses.replace(WORKQUEUE, s_per_task_byte=5e-12),
            "bucket": dataclasses.replace(BUCKET, s_per_task_byte=7e-12)}
    k = dataclasses.replace(Constants.load(COMMITTED), route_fit=fits, host_s={"workqueue": 2e-4, "bucket": 1.5e-4})
    few = np.array([40000, 3000, 65000, 9000, 1000, 33000, 2000, 5000], dtype=np.int32)
    many = np.random.default_rng(2).integers(1, 70000, size=60).astype(np.int32)
    policies = {"bucket": SplitPolicy(16, 4), "workqueue": SplitPolicy(12, 4)}
    for lens in (few, many):
        for objective in OBJECTIVES:
            router = Router(SHAPE, k, list(k.baseline_ctas_per_head), policies, cache=False, objective=objective)
            got = router.decide(np.arange(len(lens)), lens).estimates
            for kind, cost in (("bucket", bucket_cost), ("workqueue", workqueue_cost)):
                c = cost(SHAPE, lens, policies[kind])
                assert c.task_bytes > 0
                want = fits[kind].device_s(c, k.sm_count) + (k.host_s[kind] if objective == "serial" else 0.0)
                assert got[kind] == pytest.approx(want, rel=1e-12) == estimate(c, k, objective)
    lens = few
    # Without the fit (constants with no route_fit): the shared roofline (C_min, lambda).
    assert set(Constants.load(COMMITTED).route_fit) == {"workqueue", "bucket"}
    old = dataclasses.replace(Constants.load(COMMITTED), route_fit={})
    c = workqueue_cost(SHAPE, lens, policies["workqueue"])
    assert estimate(c, old, "overlapped") == pytest.approx(
        c.kv_bytes / old.beta * max(1.0, old.c_min / (c.ctas / old.sm_count)) + c.launches * old.launch_s
        + c.merge_bytes / old.beta, rel=1e-12)


def test_replayed_route_fit_reorders_homogeneous_b1():
    """The committed run's homogeneous B1 step (one row of ~32.8K tokens): the shared roofline
    (CUDA-event fit, whose span holds the host's launch submission) costs the workqueue above
    its route fit, made on the calibration seed's replayed rows; the route fit orders it against
    FlashInfer-TC as graph replay measured on every held-out seed of the committed sweep, and
    lands within 5 % of that measurement on each."""
    k = Constants.load(COMMITTED).at("homogeneous-b1")
    lens = np.array([32785], dtype=np.int32)
    policies = {kind: SplitPolicy(k.split("homogeneous-b1", kind), k.min_tiles_per_split)
                for kind in ("bucket", "workqueue")}
    before = Router(SHAPE, dataclasses.replace(k, route_fit={}), list(k.baseline_ctas_per_head), policies, cache=False,
                    objective="overlapped")
    roofline = before.decide(np.arange(1), lens).estimates
    after = Router(SHAPE, k, list(k.baseline_ctas_per_head), policies, cache=False, objective="overlapped")
    est = after.decide(np.arange(1), lens).estimates
    assert roofline["workqueue"] > est["workqueue"]
    served = pd.concat([pd.read_parquet(f)
                        for f in sorted((ROOT / "results" / "raw" / "serve").glob("homogeneous-b1-*"))])
    medians = served.groupby(["engine", "seed"])["graph_s"].median()
    measured, tc = medians["pkv-workqueue"], medians["flashinfer-tc"]
    assert set(measured.index) == set(load_config(ROOT / "results" / "config.json")["seeds"]["heldout"])
    assert ((measured < tc).all() and est["workqueue"] < est["flashinfer-tc"]) or \
        ((measured > tc).all() and est["workqueue"] > est["flashinfer-tc"])
    assert est["workqueue"] == pytest.approx(measured.to_numpy(), rel=0.05)


def test_split_0_rows_leave_the_grid_fits_and_add_the_route_fits():
    """The sweep's split-0 rows of the scheduled routes (the replayed run at the frozen split)
    leave the operating points and C_min / lambda as the split grid gave them; fit_constants
    adds the route fits and takes H_r of those routes beyond the replayed span."""
    with_fits = json.loads(COMMITTED.read_text())
    committed = {key: v for key, v in with_fits.items() if key != "route_fit"}
    full = pd.read_parquet(CALIBRATION)
    # The sweep without the scheduled routes' split-0 rows.
    cal = full[~(full["engine"].isin(["pkv-workqueue", "pkv-bucket"]) & (full["split"] == 0))]
    cfg = load_config(ROOT / "results" / "config.json")
    shape = shape_of(cfg)
    extra = pd.concat([_rows("pkv-workqueue", "workqueue", WORKQUEUE, n=64),
                       _rows("pkv-bucket", "bucket", BUCKET, n=64)])
    both = pd.concat([cal, extra.reindex(columns=cal.columns)], ignore_index=True)
    assert operating_points(both) == operating_points(cal)
    beta = committed["beta_bytes_per_s"]
    assert fit_device_terms(both, beta, SMS) == fit_device_terms(cal, beta, SMS)
    fitted = fit_constants(committed, both, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    k = Constants.from_dict(json.loads(json.dumps(fitted)))
    assert k.route_fit["workqueue"].fixed_s == pytest.approx(WORKQUEUE.fixed_s, rel=1e-6)
    assert k.route_fit["bucket"].s_per_launch == pytest.approx(BUCKET.s_per_launch, rel=1e-6)
    assert fit_host_s(both)["workqueue"] == pytest.approx(2e-4 + 5e-5)     # wall - graph replay
    # That sweep refits without route fits; the committed one refits to the committed fits.
    plain = fit_constants(committed, cal, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    assert "route_fit" not in plain
    again = Constants.from_dict(json.loads(json.dumps(
        fit_constants(committed, full, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads))))
    want = Constants.from_dict(with_fits)
    # Same predictions (the coefficients of collinear terms, e.g. fixed and launches of a route
    # that always launches twice, may trade off at float precision).
    for lens in ([32785], [40000, 3000, 65000, 9000], [1000] * 8):
        for kind, cost in (("bucket", bucket_cost), ("workqueue", workqueue_cost)):
            c = cost(shape, np.asarray(lens, dtype=np.int32), SplitPolicy(12, 4))
            assert again.route_fit[kind].device_s(c, SMS) == pytest.approx(want.route_fit[kind].device_s(c, SMS),
                                                                           rel=1e-6)


def test_constants_round_trip_and_refuse_a_bad_fit():
    d = {**json.loads(COMMITTED.read_text()),
         "route_fit": {"workqueue": {**dataclasses.asdict(WORKQUEUE), "rows": 256, "rms_log_err": 0.03}}}
    assert Constants.from_dict(json.loads(json.dumps(d))).route_fit == {"workqueue": WORKQUEUE}
    with pytest.raises(ValueError, match="out of range"):
        RouteFit(1e-6, 1e-13, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="out of range"):
        RouteFit(-1e-6, 1e-13, 1.0, 0.0, 0.0)
    assert RouteCost("workqueue", 1e6, 0.0, 1, 0.0).ctas == 0.0
    assert WORKQUEUE.device_s(RouteCost("workqueue", 1e6, 0.0, 1, 0.0), SMS) == pytest.approx(
        WORKQUEUE.fixed_s + 1e6 * WORKQUEUE.s_per_kv_byte * WORKQUEUE.c_min)
