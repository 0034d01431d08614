"""`adaptive`: the cost-model router (paper §3.5) over the baseline and PersistentKV engines.

prepare() takes the step's route from pkv.plan.costmodel.Router (estimates of T_r for every
candidate route from the step's lengths and the frozen constants, cached on a step
signature), then prepares only the chosen engine; run() runs that engine's plan, so a
CUDA graph of run() captures exactly the chosen route. The decision's own host time is
the plan's `route_s` (a column of every serving row).

Routes: the constants' FlashInfer baselines, the host-scheduled PersistentKV routes at
their frozen splits, and pkv-graph where the constants carry its fit (constants
without one never build it). `objective` (spec `adaptive:objective=overlapped`) is what the
router minimizes: serial (device + host time, the default) or overlapped (device time).
prepare(step, rows=B_pad) pads a step the router sends to pkv-graph to a bucket's rows:
that plan reads only the engine's fixed buffers, so a CUDA graph of run() captured for
the bucket replays any later step routed there (tests/gpu/test_router_gpu.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.engines.base import Engine, Plan
from pkv.engines.table import pkv_engines, pkv_routes
from pkv.plan.costmodel import GRAPH, Constants, Router
from pkv.plan.schedule import SplitPolicy


@dataclass
class AdaptivePlan(Plan):
    engine: Engine
    inner: Plan
    estimate_s: float
    route_s: float = float("nan")   # host seconds the routing decision took


class AdaptiveEngine(Engine):
    def __init__(self, cache: PagedCache, constants: Constants, point: str, validate: bool = True,
                 cache_decisions: bool = True, objective: str = "serial"):
        from pkv.engines import make_engine  # the registry imports this module

        self.inner_engines: list[Engine] = []
        super().__init__(cache, validate)
        self.k = constants.at(point)
        self.objective = objective
        self.baselines = {name: make_engine(name, cache) for name in self.k.baseline_ctas_per_head}
        # Gated-out GQA groups never build PersistentKV engines (their kernels may not exist).
        self.policies, self.pkv = {}, {}
        graph = None
        if cache.shape.group in self.k.supported_groups:
            cpu = {} if cache.kv.is_cuda else {"num_sms": self.k.sm_count}
            scheduled = pkv_engines()
            for name, kind in pkv_routes().items():
                if name in scheduled:
                    self.policies[kind] = SplitPolicy(self.k.split(point, kind), self.k.min_tiles_per_split)
                    self.pkv[kind] = make_engine(name, cache, self.policies[kind], **cpu)
                elif kind == GRAPH and self.k.graph is not None and _graph_runs(cache):
                    # The grid the calibration fitted on (on the CPU, the oracle's default grid).
                    g = self.k.graph
                    self.pkv[kind] = make_engine(name, cache, min_tiles=g.min_tiles, piece_cost=g.piece_cost)
                    graph = (self.pkv[kind].num_ctas, g.min_tiles, g.piece_cost)
        self.inner_engines = [*self.baselines.values(), *self.pkv.values()]
        self.validate = validate
        self.router = Router(cache.shape, self.k, self.baselines, self.policies, cache=cache_decisions,
                             objective=objective, graph=graph)

    @property
    def validate(self) -> bool:
        return self._validate

    @validate.setter
    def validate(self, flag: bool) -> None:
        # The chosen engine's checks follow the router's: one switch for the whole route.
        self._validate = flag
        for engine in self.inner_engines:
            engine.validate = flag

    def prepare(self, step: StepState, rows: int | None = None) -> AdaptivePlan:
        """The routed plan; `rows` pads the pkv-graph route to a bucket (other routes run the step's rows)."""
        self.check_step(step)
        t0 = time.perf_counter()
        decision = self.router.decide(step.request_ids, step.seq_lens)
        route_s = time.perf_counter() - t0
        engine = self.pkv.get(decision.route) or self.baselines[decision.route]
        extra = {"rows": rows} if rows is not None and decision.route == GRAPH else {}
        if self._validate:
            engine.validate = False    # checked once above
            inner = engine.prepare(step, **extra)
            engine.validate = True
        else:
            inner = engine.prepare(step, **extra)
        # Counters stay with the inner plan (GPU engines compute them lazily, off the timed path).
        return AdaptivePlan(step, inner.route, inner.launches, None, engine, inner, decision.estimate_s, route_s)

    def run(self, q: torch.Tensor, plan: AdaptivePlan, layer: PagedCache | None = None) -> torch.Tensor:
        return plan.engine.run(q, plan.inner, self.layer(layer))


def _graph_runs(cache: PagedCache) -> bool:
    """Whether pkv-graph has a kernel for this cache (16-bit only here: the router is no FP8 reader)."""
    from pkv.engines.graph import check_graph_shape

    if not cache.kv.is_cuda:
        return True                 # the CPU oracle runs any shape
    try:
        check_graph_shape(cache.shape, cache.scales)
    except ValueError:
        return False
    return True


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import no_policy

    no_policy(name, policy)
    return AdaptiveEngine(cache, **options)
