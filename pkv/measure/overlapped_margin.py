"""The router replayed over the calibration seed's measured steps: each operating point's
device scales and the overlapped objective's promotion margin
(`policy.fit_overlapped_margin: true`), both fitted at calibration.

Device scales (`with_device_scale`): at each serving point, every route's measured device time
over its estimate, summed over the point's steps (the split-0 run's graph replays), stored as
`operating_points[point]["device_scale"]`; `Constants.at` applies it (pkv.plan.costmodel
says why). The margin is fitted after them, on the scaled estimates.

A margin m keeps FlashInfer wherever the best PersistentKV estimate is less than m times
cheaper. A margin set by argument (the fits' combined error) can keep FlashInfer where
a PersistentKV route is both estimated and measured ahead by a few per cent, which costs the
overlapped router its bar at that point; so the margin is measured, not argued.
Here the router itself is replayed over the calibration sweep's own steps (the calibration
seed, every serving point, the split-0 run whose rows hold each route's graph-replayed device time
per step): under each margin of MARGIN_GRID, the overlapped router's routes (the frozen
constants' estimates, `pkv.plan.costmodel.promote`) cost the sum of the chosen routes'
measured times, against each fixed route's sum over the same steps. The margin kept is the one
whose worst serving point is closest to its best fixed route; ties go to the higher geometric
mean over points, then to the larger margin (FlashInfer kept where nothing says otherwise).
No held-out seed is read.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd

from pkv.config.resolve import point_key, shape_of
from pkv.config.typed import Config
from pkv.engines.table import pkv_routes
from pkv.measure.stages import steps_of, synthetic_trace
from pkv.measure.sweep_rows import device_s
from pkv.plan.costmodel import Constants, Router, promote
from pkv.plan.schedule import SplitPolicy

MARGIN_GRID = tuple(round(1.0 + 0.01 * i, 2) for i in range(51))     # 1.00 .. 1.50


def device_by_step(frame: pd.DataFrame) -> dict:
    """(family, max_active) -> route -> {step: device seconds (graph replay, else events, else
    wall)} of the sweep's split-0 run: the times a margin is scored on."""
    kinds, out = pkv_routes(), {}
    if "split" not in frame:
        return out
    rows = frame[frame["split"] == 0]
    for (family, batch, engine), r in rows.groupby(["family", "max_active", "engine"], sort=True):
        out.setdefault((family, int(batch)), {})[kinds.get(engine, engine)] = dict(zip(r["step"].tolist(), device_s(r)))
    return out


def estimates_by_step(cfg: Config, k: Constants, scheduled: list[str]) -> dict:
    """(family, max_active) -> [(step, {route: overlapped estimate})] for the calibration
    sweep's steps, as the adaptive engine's router sees them (its baselines, the
    `scheduled` routes at their frozen splits, pkv-graph on the grid it was fitted on)."""
    shape = shape_of({"shape": cfg.to_dict()["shape"]})
    graph = (k.graph.num_ctas, k.graph.min_tiles, k.graph.piece_cost) if k.graph is not None else None
    out = {}
    for p in cfg.serving:
        point = point_key(p.family, p.max_active)
        kp = k.at(point)
        policies = {kind: SplitPolicy(kp.split(point, kind), kp.min_tiles_per_split) for kind in scheduled}
        router = Router(shape, kp, list(kp.baseline_ctas_per_head), policies, cache=False, objective="overlapped",
                        graph=graph)
        trace = synthetic_trace(cfg, p.family, cfg.seeds.calibration)
        out[(p.family, p.max_active)] = [(st.step, router.decide(st.request_ids, st.seq_lens).estimates)
                                         for st in steps_of(trace, p.max_active, cfg.calibration.max_steps)]
    return out


def fit_device_scale(estimates: dict, device: dict) -> dict:
    """(family, max_active) -> {route: measured / estimated device seconds, each summed over
    the point's steps measured for that route}; routes without a positive sum are left out."""
    out = {}
    for point, steps in estimates.items():
        dev, scales = device.get(point, {}), {}
        for route in sorted({r for _, est in steps for r in est}):
            times = dev.get(route, {})
            pairs = [(est[route], times[s]) for s, est in steps if route in est and s in times]
            est_s, meas_s = sum(e for e, _ in pairs), sum(m for _, m in pairs)
            if est_s > 0 and meas_s > 0 and math.isfinite(meas_s / est_s):
                scales[route] = float(meas_s / est_s)
        if scales:
            out[point] = scales
    return out


def with_device_scale(cfg: Config | dict, constants: dict, device: dict, scheduled: list[str]) -> dict:
    """`constants` with each serving point's `device_scale` (fit_device_scale of the unscaled
    estimates against `device`, device_by_step of the sweep); as given without measured steps."""
    if not device:
        return constants
    points = {p: {k: v for k, v in op.items() if k != "device_scale"}
              for p, op in constants.get("operating_points", {}).items()}
    k = Constants.from_dict({**constants, "operating_points": points})
    for (family, batch), scales in fit_device_scale(estimates_by_step(Config.of(cfg), k, scheduled), device).items():
        points.setdefault(point_key(family, batch), {})["device_scale"] = scales
    return {**constants, "operating_points": points}


def score(estimates: dict, device: dict, baselines: list[str], margin: float) -> dict:
    """(family, max_active) -> the overlapped router's device throughput over the best fixed
    route's (both summed over the point's steps), under `margin`. Points or steps without a
    measured time for every route are left out."""
    ratios = {}
    for point, steps in estimates.items():
        dev = device.get(point, {})
        routes = sorted({r for _, est in steps for r in est})
        usable = [(s, est) for s, est in steps if all(s in dev.get(r, {}) for r in est)]
        if not usable or not all(r in dev for r in routes):
            continue
        chosen = sum(dev[promote(est, [b for b in baselines if b in est], [r for r in est if r not in baselines],
                                 margin)][s] for s, est in usable)
        fixed = min(sum(dev[r][s] for s, _ in usable) for r in routes)
        ratios[point] = fixed / chosen
    return ratios


def choose_margin(estimates: dict, device: dict, baselines: list[str], grid=MARGIN_GRID) -> dict | None:
    """The fit: {"margin", "worst", "geomean", "points": {point: ratio}} of the best margin of
    `grid` (module docstring), or None where no point has every route measured."""
    best = None
    for m in grid:
        ratios = score(estimates, device, baselines, m)
        if not ratios:
            return None
        worst = min(ratios.values())
        geomean = math.exp(float(np.mean(np.log(list(ratios.values())))))
        key = (worst, geomean, m)
        if best is None or key > best[0]:
            best = (key, ratios)
    (worst, geomean, m), ratios = best
    return {"margin": m, "worst": worst, "geomean": geomean, "grid": [grid[0], grid[-1], len(grid)],
            "points": {f"{f}-b{b}": r for (f, b), r in sorted(ratios.items())}}


def fit_overlapped_margin(cfg: Config | dict, constants: dict, device: dict, scheduled: list[str]) -> dict | None:
    """constants.json's `overlapped_margins` (one row: the fitted margin for every batch) and
    `overlapped_margin_fit` (what it was chosen on), or None without measured steps. `device`:
    (family, max_active) -> route -> {step: device seconds} of the sweep's split-0 run
    (device_by_step); `scheduled`: the host-scheduled route kinds."""
    if not device:
        return None
    k = dataclasses.replace(Constants.from_dict(constants), overlapped_margins=())
    fit = choose_margin(estimates_by_step(Config.of(cfg), k, scheduled), device, list(k.baseline_ctas_per_head))
    if fit is None:
        return None
    top = max(m for m, _ in k.margins)
    return {"overlapped_margins": [{"max_active": top, "margin": fit["margin"]}], "overlapped_margin_fit": fit}
