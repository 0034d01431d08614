"""The overlapped objective's margin, fitted at calibration by replaying the router over the
calibration seed's measured steps (pkv.measure.overlapped_margin): the rule it applies is the
router's own (`promote`), it keeps the margin whose worst point serves best, and on the
committed calibration sweep it reproduces the committed constants' margin."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pkv.config.resolve import ConfigError, effective
from pkv.config.typed import Config
from pkv.measure import calibrate
from pkv.measure.calibrate import scheduled_routes
from pkv.measure.overlapped_margin import choose_margin, device_by_step, fit_overlapped_margin, score
from pkv.plan.costmodel import promote

ROOT = Path(__file__).resolve().parents[1]
BASES = ["flashinfer", "flashinfer-tc"]


def _point(est_ratio: float, true_ratio: float, steps: int = 4, t: float = 1e-4):
    """A point whose candidate `graph` is estimated est_ratio times cheaper than FlashInfer-TC
    and runs true_ratio times faster: (estimates by step, device by route)."""
    est = [(s, {"flashinfer": 2 * t, "flashinfer-tc": t, "graph": t / est_ratio}) for s in range(steps)]
    dev = {"flashinfer": {s: 2 * t for s in range(steps)}, "flashinfer-tc": {s: t for s in range(steps)},
           "graph": {s: t / true_ratio for s in range(steps)}}
    return est, dev


def test_promote_is_the_margin_rule():
    est = {"flashinfer": 1.0, "flashinfer-tc": 1.2, "graph": 0.97}
    assert promote(est, BASES, ["graph"], 1.03) == "graph"
    assert promote(est, BASES, ["graph"], 1.04) == "flashinfer"
    assert promote(est, BASES, [], 1.0) == "flashinfer"


def test_the_fit_keeps_the_margin_whose_worst_point_serves_best():
    # A: estimated 3 % cheaper, really 5 % faster (promote it: m <= 1.03);
    # B: estimated 1.5 % cheaper, really 4 % slower (keep FlashInfer: m > 1.015).
    (ea, da), (eb, db) = _point(1.03, 1.05), _point(1.015, 1 / 1.04)
    estimates, device = {("a", 1): ea, ("b", 8): eb}, {("a", 1): da, ("b", 8): db}
    fit = choose_margin(estimates, device, BASES)
    assert fit["margin"] == 1.03                      # ties between 1.02 and 1.03: the larger
    assert fit["worst"] == pytest.approx(1.0) and fit["points"] == {"a-b1": pytest.approx(1.0),
                                                                    "b-b8": pytest.approx(1.0)}
    assert score(estimates, device, BASES, 1.05)[("a", 1)] == pytest.approx(1 / 1.05)
    assert score(estimates, device, BASES, 1.0)[("b", 8)] == pytest.approx(1 / 1.04)


def test_points_without_every_route_measured_are_left_out():
    est, dev = _point(1.1, 1.1)
    dev.pop("graph")
    assert score({("a", 1): est}, {("a", 1): dev}, BASES, 1.0) == {}
    assert choose_margin({("a", 1): est}, {("a", 1): dev}, BASES) is None


def test_config_gives_the_margins_or_the_fit_not_both():
    cfg = effective(yaml.safe_load((ROOT / "config.yaml").read_text()), "paper")
    assert Config.from_dict(cfg).policy.fit_overlapped_margin
    cfg["policy"]["overlapped_margins"] = [{"max_active": 1024, "margin": 1.05}]
    with pytest.raises(ConfigError, match=r"^config\.yaml: policy: give overlapped_margins or fit"):
        Config.from_dict(cfg, "config.yaml")


def test_calibration_without_split_0_rows_fits_no_margin(monkeypatch):
    cfg = effective(yaml.safe_load((ROOT / "config.yaml").read_text()), "smoke")
    monkeypatch.setattr(calibrate, "sweep", lambda cfg, provisional: pd.DataFrame())
    monkeypatch.setattr(calibrate, "fit_constants", lambda constants, frame, *a: constants)
    got = calibrate.calibrate(cfg)[0]
    assert "overlapped_margins" not in got and "overlapped_margin_fit" not in got


def test_the_committed_sweep_refits_to_the_committed_margin():
    constants = json.loads((ROOT / "results" / "calibration" / "constants.json").read_text())
    if "overlapped_margin_fit" not in constants:
        pytest.skip("the committed run was calibrated with the config's margins (before the fit)")
    cfg = json.loads((ROOT / "results" / "config.json").read_text())
    frame = pd.read_parquet(ROOT / "results" / "raw" / "calibrate" / "calibration.parquet")
    got = fit_overlapped_margin(cfg, {k: v for k, v in constants.items() if not k.startswith("overlapped_")},
                                device_by_step(frame), sorted(scheduled_routes().values()))
    assert got["overlapped_margins"] == constants["overlapped_margins"]
    fit, kept = got["overlapped_margin_fit"], constants["overlapped_margin_fit"]
    assert fit["margin"] == kept["margin"] and fit["grid"] == kept["grid"]
    assert fit["points"] == pytest.approx(kept["points"])
    assert (fit["worst"], fit["geomean"]) == pytest.approx((kept["worst"], kept["geomean"]))
