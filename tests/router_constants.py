"""Router constants for CPU tests: the FP32 reference as the only baseline, GQA-4 gated in,
one operating point "p" and, unless `graph=None`, a pkv-graph fit cheap enough to win."""

from __future__ import annotations

import dataclasses

from pkv.plan.costmodel import Constants, GraphFit


def cpu_constants(**changes) -> Constants:
    k = Constants(device="cpu", beta=1e9, launch_s=1e-6, sm_count=8, c_min=4.0,
                  baseline_ctas_per_head={"reference": 1.0}, margins=((1024, 1.05),), supported_groups=(4,),
                  min_context=64, min_tiles_per_split=1, operating_points={"p": {"bucket": 4, "workqueue": 4}},
                  graph=GraphFit(1e-7, 1e-10, 1e-10, 264, 4))
    return dataclasses.replace(k, **changes)
