"""pkv-graph as a route of `adaptive`, on the CPU, costed by its
own fit (GraphFit) against pkv.plan.device_schedule's rule; the fit; the objective; old
constants without the fit; the spec option; the report's rows for several routers."""

import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pkv.config.resolve import load_config, point_key, shape_of
from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine, table
from pkv.engines.graph import GraphEngine
from pkv.measure.calibrate import fit_constants, fit_device_terms, fit_graph, operating_points
from pkv.measure.stages import build_engine, steps_of, synthetic_trace
from pkv.plan.costmodel import (
    GRAPH,
    OBJECTIVES,
    Constants,
    GraphFit,
    RouteCost,
    Router,
    choose,
    estimate,
    graph_cost,
    graph_counts,
)
from pkv.plan.device_schedule import graph_pieces
from pkv.plan.schedule import SplitPolicy, slot_bytes
from router_constants import cpu_constants, fake_measure

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "calibration" / "constants.json"
CALIBRATION = ROOT / "results" / "raw" / "calibrate" / "calibration.parquet"
SHAPE = Shape()
# An H200-like pkv-graph fit (a fixed latency + bytes at a few TB/s), merge states at the copy bandwidth.
FIT = GraphFit(11.4e-6, 1 / 4.27e12, 1 / 4.16e12, 264, 4)


def _without_graph(constants: dict) -> dict:
    """The committed constants without a pkv-graph fit (as a calibration without pkv-graph rows writes them)."""
    d = json.loads(json.dumps(constants))
    d.pop("graph", None)
    d["host_s"].pop("graph", None)
    for point in d.get("operating_points", {}).values():
        point.get("host_s", {}).pop("graph", None)
    return d


def _oracle(lens, h, num_ctas, min_tiles, piece_cost=0):
    pieces = graph_pieces(np.asarray(lens), h, num_ctas, min_tiles, piece_cost)
    return len({p.cta for p in pieces}), sum(p.slot != -1 for p in pieces)


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(0, 9000), min_size=1, max_size=40), h=st.sampled_from([1, 2, 8]),
       num_ctas=st.sampled_from([1, 3, 64, 264]), min_tiles=st.integers(1, 8), repeat=st.booleans(),
       piece_cost=st.sampled_from([0, 0, 1, 3]))
def test_graph_counts_are_the_device_rule(lens, h, num_ctas, min_tiles, repeat, piece_cost):
    """CTAs with work and the cut segments' partial states, as graph_pieces lists them."""
    if repeat:
        lens = lens[: len(lens) // 2 + 1] * 2
    if sum(lens) == 0:
        lens = [*lens[:-1], 1]
    want = _oracle(lens, h, num_ctas, min_tiles, piece_cost)
    assert graph_counts(lens, h, num_ctas, min_tiles, piece_cost) == want          # a list: the plain-int path
    assert graph_counts(np.asarray(lens), h, num_ctas, min_tiles, piece_cost) == want   # an array: numpy's


@pytest.mark.parametrize("seed", range(12))
def test_router_costs_pkv_graph_from_the_device_schedule(seed):
    """The Router's pkv-graph estimate is GraphFit over the oracle's counts (and H_graph when serial)."""
    rng = np.random.default_rng(seed)
    batch = int(rng.choice([1, 4, 8, 33, 100]))
    lens = rng.integers(1, int(rng.choice([500, 8000, 70000])), size=batch).astype(np.int32)
    k = dataclasses.replace(Constants.load(COMMITTED), graph=FIT, host_s={"graph": 7e-5})
    ctas, states = _oracle(lens, SHAPE.num_kv_heads, FIT.num_ctas, FIT.min_tiles)
    device = FIT.fixed_s + lens.sum() * SHAPE.kv_bytes_per_token * FIT.s_per_kv_byte \
        + states * slot_bytes(SHAPE) * FIT.s_per_merge_byte
    for objective, host in (("serial", 7e-5), ("overlapped", 0.0)):
        router = Router(SHAPE, k, list(k.baseline_ctas_per_head), {}, cache=False, objective=objective,
                        graph=(FIT.num_ctas, FIT.min_tiles))
        got = router.decide(np.arange(batch), lens).estimates[GRAPH]
        assert got == pytest.approx(device + host, rel=1e-12)
    c = graph_cost(SHAPE, lens, FIT.num_ctas, FIT.min_tiles, FIT.piece_cost)
    assert (c.ctas, c.merge_bytes) == (ctas, states * slot_bytes(SHAPE))


def test_graph_plan_counters_are_the_device_rule():
    cache = _cache()
    engine = make_engine("pkv-graph", cache)
    step = _step([301, 77, 150])
    c = engine.prepare(step).counters
    ctas, states = _oracle(step.seq_lens, cache.shape.num_kv_heads, engine.num_ctas, engine.min_tiles)
    assert (c.decode_ctas, c.decode_ctas + c.empty_ctas) == (ctas, engine.num_ctas)
    assert c.merge_bytes == states * slot_bytes(cache.shape)
    assert c.useful_kv_bytes == c.read_kv_bytes == 528 * cache.shape.kv_bytes_per_token


# ---------------------------------------------------------------- the fit


def _graph_rows(fit: GraphFit, n=300, seed=0, shape=SHAPE):
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        lens = rng.integers(1, int(rng.choice([2000, 30000, 130000])), size=int(rng.choice([1, 4, 8]))).tolist()
        c = graph_cost(shape, lens, fit.num_ctas, fit.min_tiles)
        rows.append({"engine": "pkv-graph", "family": "bimodal", "max_active": 8, "split": 0, "step": i,
                     "active": len(lens), "total_tokens": sum(lens), "decode_ctas": c.ctas,
                     "empty_ctas": fit.num_ctas - c.ctas, "useful_kv_bytes": c.kv_bytes, "merge_bytes": c.merge_bytes,
                     "launches": 1, "cuda_s": fit.device_s(c), "wall_s": fit.device_s(c) + 6e-5})
    return pd.DataFrame(rows)


def test_graph_fit_recovers_known_constants():
    frame = _graph_rows(FIT)
    got = fit_graph(frame, FIT.min_tiles)
    for key in ("fixed_s", "s_per_kv_byte", "s_per_merge_byte"):
        assert got[key] == pytest.approx(getattr(FIT, key), rel=1e-6), key
    assert (got["num_ctas"], got["min_tiles"], got["rows"]) == (264, 4, len(frame)) and got["rms_log_err"] < 1e-9
    # No merge cost in the data: the non-negative fit says 0, not a negative slope.
    flat = dataclasses.replace(FIT, s_per_merge_byte=0.0)
    assert fit_graph(_graph_rows(flat, seed=1))["s_per_merge_byte"] == pytest.approx(0.0, abs=1e-18)
    assert fit_graph(frame[frame["engine"] == "nope"]) is None


def test_graph_rows_join_the_sweep_without_moving_the_other_fits():
    """pkv-graph's rows (and the baselines' split-0 rows beside them) leave the operating
    points and C_min / lambda as they were; fit_constants adds the graph fit and H_graph."""
    committed = _without_graph(json.loads(COMMITTED.read_text()))
    cal = pd.read_parquet(CALIBRATION)
    cal = cal[(cal["engine"] != "pkv-graph") & (cal["split"] != 0)]       # the sweep without pkv-graph's run
    cfg = load_config(ROOT / "results" / "config.json")
    shape = shape_of(cfg)
    graph = _graph_rows(FIT, n=64, shape=shape).assign(family="bimodal", max_active=8)
    base = cal[(cal["engine"].isin(cfg["baselines"])) & (cal["split"] == cal["split"].min())].assign(split=0)
    both = pd.concat([cal, base, graph.reindex(columns=cal.columns)], ignore_index=True)
    assert operating_points(both) == operating_points(cal)
    assert (fit_device_terms(both, committed["beta_bytes_per_s"], 132)
            == fit_device_terms(cal, committed["beta_bytes_per_s"], 132))
    fitted = fit_constants(committed, both, cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    assert fitted["host_s"]["graph"] == pytest.approx(6e-5)
    k = Constants.from_dict(json.loads(json.dumps(fitted)))
    assert k.graph.fixed_s == pytest.approx(FIT.fixed_s, rel=1e-6)
    assert "graph" not in fit_constants(committed, cal, cfg["baselines"], shape.kv_bytes_per_token,
                                        shape.num_kv_heads)


def test_the_sweep_runs_pkv_graph_once_per_point_on_the_calibration_seed(monkeypatch):
    """Per serving point: the scheduled routes at every split of the grid, then the baselines,
    pkv-graph and the scheduled routes once more (split 0), these at the splits the grid
    chose, all on the calibration seed."""
    import yaml

    from pkv.config.resolve import effective
    from pkv.measure import calibrate

    cfg = effective(yaml.safe_load((ROOT / "config.yaml").read_text()), "smoke")
    grid = cfg["calibration"]["split_grid"]
    fastest = {"workqueue": grid[-1], "bucket": grid[0]}
    seen = []
    monkeypatch.setattr(calibrate, "measure", fake_measure(seen, fastest))
    frame = calibrate.sweep(cfg, cpu_constants(operating_points={}))
    assert {s[2] for s in seen} == {cfg["seeds"]["calibration"]}
    for p in cfg["serving"]:
        runs = [(split, engines, splits) for f, b, _, split, engines, splits, _ in seen
                if (f, b) == (p["family"], p["max_active"])]
        assert runs == [*((s, ("reference", "pkv-workqueue", "pkv-bucket"), {"pkv-workqueue": s, "pkv-bucket": s})
                          for s in grid),
                        (0, ("reference", "pkv-graph", "pkv-workqueue", "pkv-bucket"),
                         {"pkv-workqueue": fastest["workqueue"], "pkv-bucket": fastest["bucket"]})]
    # The split-0 rows are not a split of the grid: the operating points are the grid's choice.
    assert all(v == {"workqueue": fastest["workqueue"], "bucket": fastest["bucket"]}
               for v in operating_points(frame).values())


# ---------------------------------------------------------------- old constants, objective


def test_old_constants_have_no_graph_route_and_route_as_before():
    k = Constants.from_dict(_without_graph(json.loads(COMMITTED.read_text())))
    assert k.graph is None
    cfg = load_config(ROOT / "results" / "config.json")
    shape = shape_of(cfg)
    checked = 0
    for p in cfg["serving"]:
        point = point_key(p["family"], p["max_active"])
        kp = k.at(point)
        policies = {kind: SplitPolicy(kp.split(point, kind), kp.min_tiles_per_split)
                    for kind in ("bucket", "workqueue")}
        plain = Router(shape, kp, list(kp.baseline_ctas_per_head), policies, cache=False)
        offered = Router(shape, kp, list(kp.baseline_ctas_per_head), policies, cache=False, graph=(264, 4))
        assert offered.graph is None
        for s in steps_of(synthetic_trace(cfg, p["family"], cfg["seeds"]["heldout"][0]), p["max_active"], 64):
            a, b = plain.decide(s.request_ids, s.seq_lens), offered.decide(s.request_ids, s.seq_lens)
            assert (a.route, a.estimates) == (b.route, b.estimates)
            checked += 1
    assert checked > 300
    with pytest.raises(ValueError, match="no pkv-graph fit"):
        estimate(RouteCost(GRAPH, 1e6, 8, 1, 0.0), k)


def test_adaptive_with_old_constants_builds_no_graph_route():
    engine = make_engine("adaptive", _cache(), constants=cpu_constants(graph=None), point="p")
    assert GRAPH not in engine.pkv and engine.router.graph is None
    assert engine.prepare(_step([301, 77, 150])).route != "pkv-graph"


def test_adaptive_cuts_pkv_graph_as_its_fit_was_calibrated():
    """The graph route is built, and its states counted, with the fit's min_tiles and piece_cost."""
    fit = GraphFit(1e-7, 1e-10, 1e-10, 264, 2, piece_cost=3)
    engine = make_engine("adaptive", _cache(), constants=cpu_constants(graph=fit), point="p")
    assert (engine.pkv[GRAPH].min_tiles, engine.pkv[GRAPH].piece_cost) == (2, 3)
    assert engine.router.graph[1:] == (2, 3)
    assert GraphFit.from_dict({k: getattr(fit, k) for k in GraphFit.KEYS if k != "piece_cost"}).piece_cost == 0


def test_objective_switches_the_decision_where_host_time_dominates():
    """pkv-graph slower on the device, far cheaper on the host: serial takes it, overlapped not."""
    k = cpu_constants(graph=GraphFit(1.5e-3, 0.0, 0.0, 264, 4),
                       host_s={"reference": 2e-3, "graph": 6e-5, "bucket": 5e-3, "workqueue": 5e-3})
    base = [RouteCost("reference", 1e6, 64, 1, 0.0)]          # 1 ms + 1 us on the device
    graph = [RouteCost(GRAPH, 1e6, 64, 1, 0.0)]
    serial, overlapped = choose(base, graph, 3, k, "serial"), choose(base, graph, 3, k, "overlapped")
    assert serial.route == GRAPH and overlapped.route == "reference"
    assert serial.estimates["reference"] - overlapped.estimates["reference"] == pytest.approx(2e-3)
    assert serial.estimates[GRAPH] - overlapped.estimates[GRAPH] == pytest.approx(6e-5)
    # The same through the engine: the objective reaches the router.
    cache = _cache()
    step = _step([301, 77, 150])
    plans = {o: make_engine("adaptive", cache, constants=k, point="p", objective=o).prepare(step) for o in OBJECTIVES}
    assert plans["serial"].route == "pkv-graph"
    assert plans["overlapped"].route != "pkv-graph"
    with pytest.raises(ValueError, match="router objective"):
        make_engine("adaptive", cache, constants=k, point="p", objective="overlaped")


def test_a_step_routed_to_pkv_graph_runs_its_oracle_and_matches_the_reference():
    cache = _cache()
    engine = make_engine("adaptive", cache, constants=cpu_constants(), point="p")
    step = _step([301, 77, 150])
    plan = engine.prepare(step)
    assert plan.route == "pkv-graph" and isinstance(plan.engine, GraphEngine)
    assert plan.estimate_s == engine.router.decide(step.request_ids, step.seq_lens).estimate_s
    q = cache.query(3, seed=1)
    ref = make_engine("reference", cache)
    torch.testing.assert_close(engine.run(q, plan).float(), ref.run(q, ref.prepare(step)).float(), atol=2e-3, rtol=0)
    # Padded to a bucket (the CUDA-graph path): the oracle scans the step's rows only.
    padded = engine.prepare(step, rows=8)
    assert padded.inner.rows == 8
    q8 = torch.cat([q, cache.query(5, seed=2)])
    torch.testing.assert_close(engine.run(q8, padded)[:3].float(), ref.run(q, ref.prepare(step)).float(), atol=2e-3,
                               rtol=0)


# ---------------------------------------------------------------- cache and decision time


def test_cached_decision_equals_the_uncached_one_with_the_graph_route(capsys):
    """On recorded steps of every serving point, both objectives, H200-like constants
    with a graph fit; reports the median decision time (asserts none)."""
    cfg = load_config(ROOT / "results" / "config.json")
    shape = shape_of(cfg)
    k0 = dataclasses.replace(Constants.load(COMMITTED), graph=FIT,
                             host_s={**Constants.load(COMMITTED).host_s, "graph": 7e-5})
    checked, taken, times = 0, set(), []
    for objective in OBJECTIVES:
        for p in cfg["serving"]:
            point = point_key(p["family"], p["max_active"])
            k = k0.at(point)
            policies = {kind: SplitPolicy(k.split(point, kind), k.min_tiles_per_split)
                        for kind in ("bucket", "workqueue")}
            seeds = cfg["seeds"]
            for seed in (seeds["calibration"], seeds["heldout"][0], seeds["heldout"][-1]):
                cached = Router(shape, k, list(k.baseline_ctas_per_head), policies, objective=objective, graph=(264, 4))
                uncached = cached.uncached()
                for s in steps_of(synthetic_trace(cfg, p["family"], seed), p["max_active"], 64):
                    t0 = time.perf_counter()
                    got = cached.decide(s.request_ids, s.seq_lens)
                    times.append(time.perf_counter() - t0)
                    want = uncached.decide(s.request_ids, s.seq_lens)
                    assert got.route == want.route, (objective, point, seed, s.step)
                    assert got.estimate_s == pytest.approx(want.estimate_s, rel=0.05)
                    taken.add(got.route)
                    checked += 1
    assert checked > 2000 and GRAPH in taken
    with capsys.disabled():   # reported, not asserted: a CPU test's timing says nothing of the H200 host
        print(f"\nrouter decision with the graph route, cached: median {1e6 * statistics.median(times):.1f} us, "
              f"p90 {1e6 * float(np.percentile(times, 90)):.1f} us over {len(times)} steps; routes {sorted(taken)}")


# ---------------------------------------------------------------- the spec option


def test_objective_is_a_spec_option_and_a_misspelling_is_refused():
    assert table.parse_spec("adaptive:objective=overlapped") == ("adaptive", {"objective": "overlapped"})
    assert table.parse_spec("adaptive") == ("adaptive", {})
    assert table.ENUM_OPTIONS["objective"] == OBJECTIVES
    pattern = re.compile(table.spec_pattern())
    assert pattern.match("adaptive:objective=overlapped") and pattern.match("adaptive:objective=serial")
    assert not pattern.match("adaptive:objective=overlaped") and not pattern.match("adaptive:objective=Serial")
    with pytest.raises(ValueError, match="objective is one of serial, overlapped"):
        table.parse_spec("adaptive:objective=overlaped")
    with pytest.raises(ValueError, match="takes no option 'objectiv'"):
        table.parse_spec("adaptive:objectiv=serial")
    with pytest.raises(ValueError, match="takes no option 'objective'"):
        table.parse_spec("pkv-graph:objective=serial")
    with pytest.raises(ValueError, match="key=true, key=false or key=<integer>"):
        table.parse_spec("pkv-graph:min_tiles=serial")
    engine = build_engine("adaptive:objective=overlapped", _cache(), cpu_constants(), "p")
    assert engine.router.objective == "overlapped"


# ---------------------------------------------------------------- the report


def test_report_rows_for_both_objectives_and_pkv_graph(tmp_path):
    from pkv.core.io import write_parquet
    from pkv.measure.loop import COLUMNS
    from pkv.report.router import candidates, regret, regret_markdown
    from pkv.report.tables import build_report

    def rows(engine, wall, dev, route=None, seed=20260623):
        base = {c: math.nan for c in COLUMNS}
        base.update(stage="serve", trace=f"bimodal-{seed}", family="bimodal", max_active=8, seed=seed, engine=engine,
                    route=route or engine, split=0, group=4, layers=1, kv_dtype="auto", active=8, total_tokens=40000,
                    max_len=9000, launches=1, max_abs_err=0.0, mean_abs_err=0.0)
        return [{**base, "step": s, "wall_s": wall, "cuda_s": dev, "graph_s": dev} for s in range(3)]

    frame = pd.DataFrame(rows("flashinfer", 8e-4, 2.0e-4) + rows("flashinfer-tc", 8e-4, 1.8e-4)
                         + rows("pkv-workqueue", 4e-4, 2.0e-4) + rows("pkv-graph", 3e-4, 1.9e-4)
                         + rows("adaptive", 3e-4, 1.9e-4, "pkv-graph")
                         + rows("adaptive:objective=overlapped", 8e-4, 1.8e-4, "flashinfer-tc"),
                         columns=list(COLUMNS)).astype(COLUMNS)
    old = _k_report(None)
    assert "pkv-graph" not in candidates(frame, old)          # no fit: not a candidate in hindsight
    new = _k_report(FIT)
    r = regret(frame, new).set_index("router")
    assert list(r.index) == ["adaptive", "adaptive:objective=overlapped"]
    assert r.loc["adaptive", "best_wall_route"] == "pkv-graph" and r.loc["adaptive", "wall_regret"] == pytest.approx(1)
    assert r.loc["adaptive:objective=overlapped", "device_regret"] == pytest.approx(1.0)
    text = regret_markdown(regret(frame, new), smoke=False, graph=True)
    assert re.search(r"\| router +\| routes taken", text) and "bucket, workqueue and graph routes" in text
    # The overlapped router is judged on device time only: its wall ratio carries no mark.
    assert "`adaptive:objective=overlapped`: Device bar (≥ 0.97) on 1 of 1" in text
    overlapped_row = next(line for line in text.splitlines() if "| adaptive:objective=overlapped |" in line)
    assert "✗" not in overlapped_row
    assert not re.search(r"\| router +\| routes taken", regret_markdown(
        regret(frame[frame.engine != "adaptive:objective=overlapped"], new), smoke=False))
    meta = {"gpu": "NVIDIA H200", "profile": "paper", "torch": "2.11", "flashinfer": "0.7.2.post1", "cuda": "12.8",
            "config_hash": "c", "constants_hash": "k", "git_commit": "g"}
    write_parquet(frame, tmp_path / "raw" / "serve" / "bimodal-b8-20260623.parquet", meta)
    target = tmp_path / "tables" / "serving.md"
    build_report(tmp_path, [target])
    lines = [line for line in target.read_text().splitlines() if line.startswith("| Bimodal B8")]
    assert [line.split("|")[2].strip() for line in lines] == ["pkv-graph", "flashinfer-tc"]
    assert lines[0].startswith("| Bimodal B8 ") and "· objective=overlapped" in lines[1]


# ---------------------------------------------------------------- helpers


def _k_report(fit):
    return Constants("t", 4e12, 1e-5, 132, 1.0, {"flashinfer": 4.0, "flashinfer-tc": 4.0}, ((1024, 1.05),), (4,), 1,
                     4, graph=fit)


_SHAPE = Shape(8, 2, 16, 4, "float16")


def _cache(shape=_SHAPE, lens=(301, 77, 150, 40, 40, 40, 40, 40)):
    a = assign_pages(np.array(lens), shape.page_size, 0.5, seed=3)
    return PagedCache.random(shape, a, "cpu", seed=3)


def _step(lens):
    return StepState(0, np.arange(len(lens)), np.array(lens, dtype=np.int32))
