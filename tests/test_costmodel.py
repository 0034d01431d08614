"""The route policy of paper §3.5 with constructed constants: who wins where, margins, gates."""

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine, table
from pkv.plan.costmodel import (
    Constants,
    RouteCost,
    baseline_cost,
    bucket_cost,
    choose,
    eligible,
    estimate,
    workqueue_cost,
)
from pkv.plan.schedule import SplitPolicy, bucket_schedule, workqueue_schedule
from router_constants import cpu_constants

H200_LIKE = Constants(
    device="constructed", beta=4.0e12, launch_s=5e-6, sm_count=132, c_min=4.0,
    baseline_ctas_per_head={"flashinfer": 2.0, "flashinfer-tc": 4.0},
    margins=((3, 1.05), (6, 1.50), (1024, 1.05)), supported_groups=(4,), min_context=16384,
    min_tiles_per_split=4, operating_points={"bucketed-b1": {"bucket": 32, "workqueue": 32}},
)
SHAPE = Shape()


def test_estimate_is_the_paper_formula():
    c = RouteCost("r", kv_bytes=4.0e9, ctas=132 * 2, launches=3, merge_bytes=2.0e6)
    want = 4.0e9 / 4.0e12 * (4.0 / 2.0) + 3 * 5e-6 + 2.0e6 / 4.0e12
    assert estimate(c, H200_LIKE) == pytest.approx(want, rel=1e-12)
    # Past the occupancy target there is no stall factor.
    assert estimate(dataclasses.replace(c, ctas=132 * 8), H200_LIKE) == pytest.approx(want - 4.0e9 / 4.0e12, rel=1e-12)


def test_host_time_is_added_to_its_own_route_only():
    k = dataclasses.replace(H200_LIKE, host_s={"flashinfer": 5e-4, "workqueue": 1.5e-4})
    c = RouteCost("flashinfer", kv_bytes=4.0e9, ctas=132 * 8, launches=1, merge_bytes=0.0)
    assert estimate(c, k) == pytest.approx(estimate(c, H200_LIKE) + 5e-4, rel=1e-12)
    other = dataclasses.replace(c, route="flashinfer-tc")   # no calibrated H_r: costed at 0
    assert estimate(other, k) == estimate(other, H200_LIKE)


def test_host_time_promotes_a_route_that_only_ties_on_device_time():
    # Equal device work: the device-only model keeps the baseline (margin 1.05); FlashInfer's
    # planning cost per step makes the workqueue the cheaper route to serve.
    base = [RouteCost("flashinfer", 1e9, 132 * 4, 1, 0.0)]
    cand = [RouteCost("workqueue", 1e9, 132 * 4, 1, 0.0)]
    assert choose(base, cand, active=8, k=H200_LIKE).route == "flashinfer"
    k = dataclasses.replace(H200_LIKE, host_s={"flashinfer": 5e-4, "workqueue": 1.5e-4})
    d = choose(base, cand, active=8, k=k)
    assert d.route == "workqueue"
    assert d.estimates["flashinfer"] - d.estimates["workqueue"] == pytest.approx(3.5e-4, rel=1e-9)
    # ... and between the FlashInfer variants it picks the one cheaper on the host.
    both = [*base, dataclasses.replace(base[0], route="flashinfer-tc")]
    k = dataclasses.replace(H200_LIKE, host_s={"flashinfer": 5e-4, "flashinfer-tc": 4e-4})
    assert choose(both, [], active=8, k=k).route == "flashinfer-tc"


def test_calibrated_host_time_is_the_median_outside_the_device_span():
    from pkv.measure.calibrate import fit_host_s

    frame = pd.DataFrame({
        "engine": ["flashinfer"] * 3 + ["pkv-workqueue"] * 3,
        "wall_s": [6e-4, 7e-4, 9e-4, 3e-4, 2e-4, 2.5e-4],
        "cuda_s": [1e-4, 1e-4, 2e-4, 1e-4, 1e-4, 1e-4],
    })
    got = fit_host_s(frame)
    assert got.keys() == {"flashinfer", "workqueue"}   # keyed by route, as RouteCost names them
    assert got["flashinfer"] == pytest.approx(6e-4) and got["workqueue"] == pytest.approx(1.5e-4)
    # The CPU smoke profile times no CUDA events: nothing to fit, every route costed at 0.
    assert fit_host_s(frame.assign(cuda_s=np.nan)) == {}


def _costs(lens, splits):
    lens = np.asarray(lens, dtype=np.int32)
    base = [baseline_cost(b, SHAPE, lens, H200_LIKE) for b in H200_LIKE.baseline_ctas_per_head]
    policy = SplitPolicy(splits, 4)
    return base, [bucket_cost(SHAPE, lens, policy), workqueue_cost(SHAPE, lens, policy)]


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 5000), min_size=1, max_size=12), splits=st.integers(1, 40),
       min_tiles=st.integers(1, 6), kv_heads=st.sampled_from([1, 2, 8]))
def test_closed_form_costs_match_the_schedules(lens, splits, min_tiles, kv_heads):
    shape = Shape(8, kv_heads, 16, 4, "float16")
    lens = np.array(lens, dtype=np.int32)
    policy = SplitPolicy(splits, min_tiles)
    for cost, schedule in ((bucket_cost, bucket_schedule), (workqueue_cost, workqueue_schedule)):
        c = schedule(lens, kv_heads, policy).counters(shape, lens, 1)
        got = cost(shape, lens, policy)
        assert (got.ctas, got.launches, got.merge_bytes, got.kv_bytes, got.task_bytes) == (
            c.decode_ctas, c.launches, c.merge_bytes, c.read_kv_bytes, c.task_kv_bytes), cost.__name__


def test_b1_long_context_routes_to_persistentkv_splitting():
    base, cands = _costs([65536], splits=32)
    d = choose(base, cands, active=1, k=H200_LIKE)
    assert d.route in ("bucket", "workqueue")
    # The faster FlashInfer variant (more CTAs per head) is the one it had to beat.
    assert d.estimates["flashinfer-tc"] < d.estimates["flashinfer"]
    assert d.estimates["flashinfer-tc"] >= 1.05 * d.estimate_s


def test_ragged_b8_prefers_workqueue_over_bucket_fan_out():
    lens = [60000, 3000, 5000, 7000, 40000, 2000, 4100, 6100]
    base, cands = _costs(lens, splits=20)
    d = choose(base, cands, active=8, k=H200_LIKE)
    assert d.estimates["workqueue"] < d.estimates["bucket"]
    assert d.route in ("workqueue", "flashinfer-tc")


def test_margin_depends_on_active_count():
    base = [RouteCost("flashinfer", 1e9, 132 * 4, 1, 0)]
    cand = [RouteCost("workqueue", 1e9, 132 * 4, 1, 0)]
    t = estimate(base[0], H200_LIKE)
    # A candidate 1.2x faster clears the B8 margin (1.05) but not the B4 one (1.50).
    cand = [dataclasses.replace(cand[0], kv_bytes=(t / 1.2 - 5e-6) * 4.0e12)]
    assert choose(base, cand, active=8, k=H200_LIKE).route == "workqueue"
    assert choose(base, cand, active=4, k=H200_LIKE).route == "flashinfer"
    assert choose(base, cand, active=2, k=H200_LIKE).route == "workqueue"
    assert H200_LIKE.margin(5000) == 1.05   # past the last row: the last margin


def test_the_overlapped_objective_promotes_by_its_own_margins_where_given():
    """policy.overlapped_margins (optional): the overlapped objective's margins; absent, both
    objectives promote by `margins` (the committed constants)."""
    base = [RouteCost("flashinfer", 1e9, 132 * 4, 1, 0)]
    t = estimate(base[0], H200_LIKE)
    cand = [RouteCost("workqueue", (t / 1.03 - 5e-6) * 4.0e12, 132 * 4, 1, 0)]    # 3 % faster on the device
    for objective in ("serial", "overlapped"):
        assert choose(base, cand, active=1, k=H200_LIKE, objective=objective).route == "flashinfer"
    k = dataclasses.replace(H200_LIKE, overlapped_margins=((3, 1.0), (6, 1.5), (1024, 1.05)))
    assert choose(base, cand, active=1, k=k, objective="overlapped").route == "workqueue"
    assert choose(base, cand, active=1, k=k, objective="serial").route == "flashinfer"
    assert choose(base, cand, active=4, k=k, objective="overlapped").route == "flashinfer"
    assert (k.margin(1, "overlapped"), k.margin(1), k.margin(5000, "overlapped")) == (1.0, 1.05, 1.05)
    d = {"device": "d", "beta_bytes_per_s": 4e12, "launch_overhead_s": 5e-6, "sm_count": 132, "c_min": 1.0,
         "baseline_ctas_per_head": {"flashinfer": 2.0}, "margins": [{"max_active": 1024, "margin": 1.05}],
         "supported_groups": [4], "min_context": 1, "min_tiles_per_split": 4}
    assert Constants.from_dict(d).overlapped_margins == ()
    d["overlapped_margins"] = [{"max_active": 3, "margin": 1.0}, {"max_active": 1024, "margin": 1.02}]
    assert Constants.from_dict(d).overlapped_margins == ((3, 1.0), (1024, 1.02))


def test_calibration_copies_the_overlapped_margins_from_the_config(monkeypatch):
    from pathlib import Path

    import yaml

    from pkv.config.resolve import effective, load_schema, validate_config
    from pkv.config.typed import Config
    from pkv.measure import calibrate

    root = Path(__file__).resolve().parents[1]
    cfg = effective(yaml.safe_load((root / "config.yaml").read_text()), "smoke")
    monkeypatch.setattr(calibrate, "sweep", lambda cfg, provisional: pd.DataFrame())
    monkeypatch.setattr(calibrate, "fit_constants", lambda constants, frame, *a: constants)
    cfg["policy"].pop("overlapped_margins", None)   # absent (and nothing to fit on): the constants have none either
    assert "overlapped_margins" not in calibrate.calibrate(cfg)[0]
    cfg["policy"].pop("fit_overlapped_margin")      # given instead of fitted (tests/test_overlapped_margin.py)
    cfg["policy"]["overlapped_margins"] = [{"max_active": 3, "margin": 1.0}, {"max_active": 1024, "margin": 1.05}]
    validate_config(cfg, load_schema(), "test")
    assert Config.of(cfg).policy.overlapped_margins[0].margin == 1.0
    got = calibrate.calibrate(cfg)[0]
    assert got["overlapped_margins"] == cfg["policy"]["overlapped_margins"]
    assert Constants.from_dict({**got, "baseline_ctas_per_head": {"reference": 1.0}}).margin(1, "overlapped") == 1.0


def test_gates_group_and_context():
    long = np.array([65536], dtype=np.int32)
    assert eligible(SHAPE, long, H200_LIKE)
    assert not eligible(SHAPE, np.array([16383], dtype=np.int32), H200_LIKE)
    assert not eligible(Shape(32, 32), long, H200_LIKE)      # G = 1
    assert not eligible(Shape(32, 4), long, H200_LIKE)       # G = 8
    base, _ = _costs([65536], 32)
    assert choose(base, [], active=1, k=H200_LIKE).route == "flashinfer-tc"


def test_constants_reject_nonsense():
    with pytest.raises(ValueError):
        dataclasses.replace(H200_LIKE, beta=0.0)
    with pytest.raises(ValueError, match="negative host time"):
        dataclasses.replace(H200_LIKE, host_s={"flashinfer": -1e-6})
    with pytest.raises(ValueError, match="no frozen operating point"):
        H200_LIKE.split("zipf-b8", "workqueue")
    assert H200_LIKE.split("bucketed-b1", table.info("pkv-fused").split_route) == 32


# ---------------------------------------------------------------- the adaptive engine on the CPU

TINY = Shape(8, 2, 16, 4, "float16")


def _cpu_constants(**changes):
    return cpu_constants(**{"graph": None, **changes})   # constants without a pkv-graph fit


def _cache(shape=TINY, lens=(301, 77, 150)):
    a = assign_pages(np.array(lens), shape.page_size, 0.5, seed=3)
    return PagedCache.random(shape, a, "cpu", seed=3)


def _step(lens):
    return StepState(0, np.arange(len(lens)), np.array(lens, dtype=np.int32))


def test_adaptive_routes_long_low_occupancy_steps_to_persistentkv_and_stays_exact():
    cache = _cache()
    eng = make_engine("adaptive", cache, constants=_cpu_constants(), point="p")
    step = _step([301, 77, 150])
    plan = eng.prepare(step)
    assert plan.route.startswith("pkv-") and plan.estimate_s > 0
    q = cache.query(3, seed=1)
    ref = make_engine("reference", cache)
    torch.testing.assert_close(eng.run(q, plan).float(), ref.run(q, ref.prepare(step)).float(), atol=2e-3, rtol=0)


def test_adaptive_respects_the_gates():
    cache = _cache()
    short = _cpu_constants(min_context=10_000)
    assert make_engine("adaptive", cache, constants=short, point="p").prepare(
        _step([301, 77, 150])).route == "reference"
    g1 = _cache(Shape(8, 8, 16, 4, "float16"))
    eng = make_engine("adaptive", g1, constants=_cpu_constants(), point="p")
    assert not eng.pkv   # gated groups never build PersistentKV engines
    assert eng.prepare(_step([301, 77, 150])).route == "reference"


def test_adaptive_respects_the_margin():
    cache = _cache()
    huge = _cpu_constants(margins=((1024, 1e6),))
    assert make_engine("adaptive", cache, constants=huge, point="p").prepare(_step([301, 77, 150])).route == "reference"
