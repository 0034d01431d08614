"""`adaptive`: the cost-model router (paper §3.5) over the baseline and PersistentKV engines.

prepare() estimates T_r for every candidate route from the step's lengths and the frozen
constants (closed-form counts, a few numpy ops on B lengths), then prepares only the
chosen engine; run() runs that engine's plan, so a
CUDA graph of run() captures exactly the chosen route.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkv.cache import PagedCache
from pkv.costmodel import Constants, baseline_cost, bucket_cost, choose, eligible, workqueue_cost
from pkv.engines.base import Engine, Plan
from pkv.harness import StepState
from pkv.schedule import SplitPolicy

PKV_ROUTES = {"bucket": bucket_cost, "workqueue": workqueue_cost}


@dataclass
class AdaptivePlan(Plan):
    engine: Engine
    inner: Plan
    estimate_s: float


class AdaptiveEngine(Engine):
    name = "adaptive"

    def __init__(self, cache: PagedCache, constants: Constants, point: str):
        from pkv.engines import make_engine  # the registry imports this module

        super().__init__(cache)
        self.k = constants
        self.baselines = {name: make_engine(name, cache) for name in constants.baseline_ctas_per_head}
        # Gated-out GQA groups never build PersistentKV engines (their kernels may not exist).
        self.policies, self.pkv = {}, {}
        if cache.shape.group in constants.supported_groups:
            cpu = {} if cache.kv.is_cuda else {"num_sms": constants.sm_count}
            for kind in PKV_ROUTES:
                self.policies[kind] = SplitPolicy(constants.split(point, kind), constants.min_tiles_per_split)
                self.pkv[kind] = make_engine(f"pkv-{kind}", cache, self.policies[kind], **cpu)

    def prepare(self, step: StepState) -> AdaptivePlan:
        self.check_step(step)
        shape, lens = self.cache.shape, step.seq_lens.tolist()   # the cost functions take ints
        base = [baseline_cost(name, shape, lens, self.k) for name in self.baselines]
        cands = []
        if self.pkv and eligible(shape, lens, self.k):
            cands = [PKV_ROUTES[kind](shape, lens, policy) for kind, policy in self.policies.items()]
        decision = choose(base, cands, step.active, self.k)
        engine = self.pkv.get(decision.route) or self.baselines[decision.route]
        inner = engine.prepare(step)
        # Counters stay with the inner plan (GPU engines compute them lazily, off the timed path).
        return AdaptivePlan(step, inner.route, inner.launches, None, engine, inner, decision.estimate_s)

    def run(self, q: torch.Tensor, plan: AdaptivePlan) -> torch.Tensor:
        return plan.engine.run(q, plan.inner)
