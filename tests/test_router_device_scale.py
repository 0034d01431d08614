"""Each operating point's device scales, fitted at calibration by replaying the
router over the calibration seed's steps (pkv.measure.overlapped_margin.with_device_scale):
measured over estimated device time per route, applied by Constants.at to the device term
only, and refitted from the committed calibration sweep as the identity it is in-sample."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest

from pkv.config.typed import Config
from pkv.measure.calibrate import scheduled_routes
from pkv.measure.overlapped_margin import device_by_step, estimates_by_step, fit_device_scale, with_device_scale
from pkv.plan.costmodel import Constants, RouteCost, choose, estimate
from pkv.report.router import margin_sentence
from router_constants import cpu_constants

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "results" / "calibration" / "constants.json"


def test_the_scale_is_measured_over_estimated_on_the_steps_measured():
    estimates = {("a", 1): [(0, {"graph": 1e-4, "workqueue": 2e-4}), (1, {"graph": 3e-4, "workqueue": 2e-4})],
                 ("b", 8): [(0, {"graph": 1e-4})]}
    device = {("a", 1): {"graph": {0: 1.2e-4, 1: 3.2e-4}, "workqueue": {1: 1.8e-4}}}
    got = fit_device_scale(estimates, device)
    assert got == {("a", 1): {"graph": pytest.approx(4.4 / 4.0), "workqueue": pytest.approx(0.9)}}


def test_at_applies_the_point_scale_to_the_device_term_only():
    k = cpu_constants(host_s={"graph": 5e-6},
                      operating_points={"p": {"bucket": 4, "workqueue": 4, "device_scale": {"graph": 1.5}}})
    cost = RouteCost("graph", kv_bytes=1e6, ctas=264, launches=1, merge_bytes=0.0)
    device = k.graph.device_s(cost)
    assert estimate(cost, k, "overlapped") == pytest.approx(device)            # no point: factor 1
    here = k.at("p")
    assert here.device_scale == {"graph": 1.5}
    assert estimate(cost, here, "overlapped") == pytest.approx(1.5 * device)
    assert estimate(cost, here, "serial") == pytest.approx(1.5 * device + 5e-6)
    assert k.at("elsewhere") is k


def test_a_scale_moves_the_decision_between_near_routes():
    k = cpu_constants(operating_points={"p": {"bucket": 4, "workqueue": 4, "device_scale": {"graph": 1.2}}})
    base = [RouteCost("reference", 2e6, 8, 1, 0.0, 1)]
    cands = [RouteCost("graph", 1e6, 264, 1, 0.0)]
    plain = choose(base, cands, 1, dataclasses.replace(k, margins=((1024, 1.0),)), "overlapped")
    scaled = choose(base, cands, 1, dataclasses.replace(k.at("p"), margins=((1024, 1.0),)), "overlapped")
    assert plain.estimates["graph"] * 1.2 == pytest.approx(scaled.estimates["graph"])
    assert scaled.estimates["reference"] == pytest.approx(plain.estimates["reference"])


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), "1.1"])
def test_a_scale_out_of_range_is_refused_on_load(bad, tmp_path):
    with pytest.raises(ValueError, match="device scale out of range at p"):
        cpu_constants(operating_points={"p": {"bucket": 4, "workqueue": 4, "device_scale": {"graph": bad}}})
    d = json.loads(COMMITTED.read_text())
    d["operating_points"]["zipf-b8"]["device_scale"] = {"graph": bad}
    path = tmp_path / "constants.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"constants\.json: .*device scale out of range at zipf-b8"):
        Constants.load(path)


def test_without_measured_steps_the_constants_are_kept():
    constants = json.loads(COMMITTED.read_text())
    assert with_device_scale({}, constants, {}, ["bucket", "workqueue"]) is constants


def test_the_committed_sweep_scales_every_point_to_its_measured_time():
    """In-sample, scaled estimates sum to the measured device time of every route and point."""
    constants = json.loads(COMMITTED.read_text())
    cfg = Config.of(json.loads((ROOT / "results" / "config.json").read_text()))
    frame = pd.read_parquet(ROOT / "results" / "raw" / "calibrate" / "calibration.parquet")
    device, scheduled = device_by_step(frame), sorted(scheduled_routes().values())
    got = with_device_scale(cfg, constants, device, scheduled)
    k = Constants.from_dict(got)
    scaled = estimates_by_step(cfg, k, scheduled)
    assert set(scaled) == {(p.family, p.max_active) for p in cfg.serving}
    for point, steps in scaled.items():
        routes = {r for _, est in steps for r in est}
        assert routes <= set(device[point]) and "graph" in routes
        for route in routes:
            measured = device[point][route]
            total = sum(est[route] for s, est in steps if s in measured)
            assert total == pytest.approx(sum(measured[s] for s, _ in steps if s in measured), rel=1e-9)
    # Refitting scaled constants starts from the unscaled estimates: the same scales again.
    assert with_device_scale(cfg, got, device, scheduled) == got


def test_the_router_table_names_the_scales_where_the_constants_carry_them():
    constants = json.loads(COMMITTED.read_text())
    for point in constants["operating_points"].values():   # constants without scales
        point.pop("device_scale", None)
    plain = margin_sentence(constants)
    assert "scaled by" not in plain
    constants["operating_points"]["zipf-b8"]["device_scale"] = {"graph": 1.068, "workqueue": 0.971}
    constants["operating_points"]["uniform-b8"]["device_scale"] = {"graph": 0.969}
    scaled = margin_sentence(constants)
    assert scaled.startswith(plain) and "(0.969-1.068)." in scaled
    without_fit = {k: v for k, v in constants.items() if k != "overlapped_margin_fit"}
    assert margin_sentence(without_fit).endswith(scaled[len(plain):])   # whatever the margin's source
