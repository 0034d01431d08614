"""Router constants for CPU tests (the FP32 reference as the only baseline, GQA-4 gated in,
one operating point "p" and, unless `graph=None`, a pkv-graph fit cheap enough to win), and a
stand-in for the calibration sweep's measurements."""

from __future__ import annotations

import dataclasses

import pandas as pd

from pkv.plan.costmodel import Constants, GraphFit


def cpu_constants(**changes) -> Constants:
    k = Constants(device="cpu", beta=1e9, launch_s=1e-6, sm_count=8, c_min=4.0,
                  baseline_ctas_per_head={"reference": 1.0}, margins=((1024, 1.05),), supported_groups=(4,),
                  min_context=64, min_tiles_per_split=1, operating_points={"p": {"bucket": 4, "workqueue": 4}},
                  graph=GraphFit(1e-7, 1e-10, 1e-10, 264, 4))
    return dataclasses.replace(k, **changes)


def fake_measure(seen: list, fastest: dict):
    """A stand-in for pkv.measure.loop.measure that records each run (job, engines and the
    scheduled engines' splits) and returns one row per engine, the wall time least at
    `fastest[kind]` (the split the grid should choose for that route)."""
    def run(job, cache, steps, engines, *a, **kw):
        splits = {name: e.policy.splits for name, e in engines.items() if hasattr(e, "policy")}
        seen.append((job.family, job.max_active, job.seed, job.split, tuple(engines), splits, kw.get("graph")))
        rows = [{"engine": name, "family": job.family, "max_active": job.max_active, "split": job.split, "active": 1,
                 "wall_s": 1.0 + abs(job.split - fastest.get(name.removeprefix("pkv-"), job.split))}
                for name in engines]
        return pd.DataFrame(rows)
    return run
