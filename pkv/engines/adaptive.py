"""`adaptive`: the cost-model router (paper §3.5) over the baseline and PersistentKV engines.

prepare() takes the step's route from pkv.plan.costmodel.Router (estimates of T_r for every
candidate route from the step's lengths and the frozen constants, cached on a step
signature), then prepares only the chosen engine; run() runs that engine's plan, so a
CUDA graph of run() captures exactly the chosen route. The decision's own host time is
the plan's `route_s` (a column of every serving row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pkv.core.cache import PagedCache
from pkv.plan.costmodel import Constants, Router
from pkv.engines.table import pkv_routes
from pkv.engines.base import Engine, Plan
from pkv.core.harness import StepState
from pkv.plan.schedule import SplitPolicy



@dataclass
class AdaptivePlan(Plan):
    engine: Engine
    inner: Plan
    estimate_s: float
    route_s: float = float("nan")   # host seconds the routing decision took


class AdaptiveEngine(Engine):
    name = "adaptive"

    def __init__(self, cache: PagedCache, constants: Constants, point: str, validate: bool = True,
                 cache_decisions: bool = True):
        from pkv.engines import make_engine  # the registry imports this module

        self.inner_engines: list[Engine] = []
        super().__init__(cache, validate)
        self.k = constants.at(point)
        self.baselines = {name: make_engine(name, cache) for name in self.k.baseline_ctas_per_head}
        # Gated-out GQA groups never build PersistentKV engines (their kernels may not exist).
        self.policies, self.pkv = {}, {}
        if cache.shape.group in self.k.supported_groups:
            cpu = {} if cache.kv.is_cuda else {"num_sms": self.k.sm_count}
            for name, kind in pkv_routes().items():
                self.policies[kind] = SplitPolicy(self.k.split(point, kind), self.k.min_tiles_per_split)
                self.pkv[kind] = make_engine(name, cache, self.policies[kind], **cpu)
        self.inner_engines = [*self.baselines.values(), *self.pkv.values()]
        self.validate = validate
        self.router = Router(cache.shape, self.k, self.baselines, self.policies, cache=cache_decisions)

    @property
    def validate(self) -> bool:
        return self._validate

    @validate.setter
    def validate(self, flag: bool) -> None:
        # The chosen engine's checks follow the router's: one switch for the whole route.
        self._validate = flag
        for engine in self.inner_engines:
            engine.validate = flag

    def prepare(self, step: StepState) -> AdaptivePlan:
        self.check_step(step)
        t0 = time.perf_counter()
        decision = self.router.decide(step.request_ids, step.seq_lens)
        route_s = time.perf_counter() - t0
        engine = self.pkv.get(decision.route) or self.baselines[decision.route]
        if self._validate:
            engine.validate = False    # checked once above
            inner = engine.prepare(step)
            engine.validate = True
        else:
            inner = engine.prepare(step)
        # Counters stay with the inner plan (GPU engines compute them lazily, off the timed path).
        return AdaptivePlan(step, inner.route, inner.launches, None, engine, inner, decision.estimate_s, route_s)

    def run(self, q: torch.Tensor, plan: AdaptivePlan) -> torch.Tensor:
        return plan.engine.run(q, plan.inner)


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import no_policy

    no_policy(name, policy)
    return AdaptiveEngine(cache, **options)
