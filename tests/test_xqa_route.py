"""flashinfer-xqa as a route of the adaptive router: a config baseline is calibrated like
FlashInfer's planned variants (its own device fit on its graph-replayed rows, its host time
per step, its CTAs per head), and the router picks it where it is the cheapest route."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_router_baseline_fit import fit_rows

from pkv.core.shape import Shape
from pkv.engines import table
from pkv.measure.calibrate import fit_baseline, fit_host_s
from pkv.plan.costmodel import BaselineFit, Router
from router_constants import cpu_constants

SHAPE = Shape()
KVB = SHAPE.kv_bytes_per_token
CUDA_CORE = BaselineFit(8e-6, 1 / 3.2e12, 9e-6)   # planned CUDA-core decode
TENSOR = BaselineFit(11e-6, 1 / 4.4e12, 2e-6)    # planned tensor-core decode
XQA = BaselineFit(6e-6, 1 / 3.6e12, 1e-6)        # plan-free: less fixed cost, slower per byte at long rows
ROUTES = ["flashinfer", "flashinfer-tc", "flashinfer-xqa"]


def rows(engine: str, fit: BaselineFit, host: float, n=120, seed=0) -> pd.DataFrame:
    return fit_rows(engine, fit, n=n, seed=seed, host=host, launch=5e-6)


def test_xqa_is_calibrated_like_every_flashinfer_route():
    frame = pd.concat([rows("flashinfer-tc", TENSOR, 5e-4), rows("flashinfer-xqa", XQA, 6e-5, seed=1)])
    got = fit_baseline(frame, "flashinfer-xqa", KVB)
    for key in BaselineFit.KEYS:
        assert got[key] == pytest.approx(getattr(XQA, key), rel=1e-6), key
    host = fit_host_s(frame)
    assert host["flashinfer-xqa"] == pytest.approx(6e-5 + 5e-6) and host["flashinfer-tc"] == pytest.approx(5e-4 + 5e-6)


def constants(**changes):
    return cpu_constants(baseline_ctas_per_head={r: 1.0 for r in ROUTES}, graph=None,
                         baseline_fit={"flashinfer": CUDA_CORE, "flashinfer-tc": TENSOR, "flashinfer-xqa": XQA},
                         host_s={"flashinfer": 5e-4, "flashinfer-tc": 5e-4, "flashinfer-xqa": 6e-5}, **changes)


def test_the_router_takes_xqa_where_it_is_the_cheapest_route():
    short = np.array([900, 1200, 700, 2000])
    serial = Router(SHAPE, constants(), ROUTES, {}, cache=False)
    d = serial.decide(np.arange(4), short)
    assert d.route == "flashinfer-xqa" and set(ROUTES) <= set(d.estimates)
    # On device time alone and one long row, the planned tensor-core decode's bytes are cheaper.
    overlapped = Router(SHAPE, constants(), ROUTES, {}, objective="overlapped", cache=False)
    assert overlapped.decide(np.arange(1), np.array([120000])).route == "flashinfer-tc"


def test_the_route_set_is_the_calibrated_baselines_and_the_pkv_routes():
    """The adaptive engine routes over the constants' baselines (calibration writes every config
    baseline there) and the table's PersistentKV routes; XQA is a baseline, not a pkv route."""
    assert "flashinfer-xqa" in table.baselines() and "flashinfer-xqa" not in table.pkv_routes()
    k = constants()
    assert set(k.baseline_ctas_per_head) == set(ROUTES)
    router = Router(SHAPE, k, list(k.baseline_ctas_per_head), {}, cache=False)
    assert router.baselines == tuple(ROUTES)
