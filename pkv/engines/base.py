"""What every engine offers: prepare(step) -> plan, run(q, plan[, layer]) -> out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.validate import check_lengths, check_query
from pkv.plan.schedule import Counters


@dataclass
class Plan:
    """Host-side result of prepare(): the route taken, its launch count and counters."""

    step: StepState
    route: str
    launches: int
    counters: Counters | None


class Engine(ABC):
    """Decode attention over a PagedCache for one step at a time.

    prepare() does the host work a serving loop redoes each step (metadata, planning);
    run() only launches device work. Both are inside the timed wall region. What a serving
    engine keeps across steps (device block tables and page ids, host index buffers,
    pinned staging, workspaces) is built once, in the constructor: an engine is built per
    cache, i.e. per trace.

    run(q, plan, layer) reads another PagedCache over the same page table and shape (a
    model's layer i, each with its own KV tensor and FP8 scales): one prepare() a step
    serves every layer, as a serving engine plans once for all its layers.

    `validate` (default on) checks each step's lengths and each query's shape in
    prepare()/run(). A serving engine does not run these checks per step, so the
    measurement loop runs them once per step outside the timed region and turns them off
    inside it, for every engine alike (pkv.measure.loop).
    """

    name: str = "engine"    # its row's key in pkv.engines.table (set by pkv.engines.registry.build)
    q_len: int = 1          # query tokens per row: run()'s q has active x q_len rows

    def __init__(self, cache: PagedCache, validate: bool = True):
        self.cache = cache
        self.validate = validate

    def check_step(self, step: StepState) -> None:
        if self.validate:
            reserved = self.cache.assignment.reserved_len[step.request_ids]
            check_lengths(step.seq_lens, reserved)

    def padded_rows(self, step: StepState, rows: int | None) -> int:
        """The rows a fixed-capacity engine runs `step` at: its own (`rows` None) or a padded
        bucket, between the step's size and the engine's `max_rows`."""
        rows = step.active if rows is None else int(rows)
        if not step.active <= rows <= self.max_rows:
            raise ValueError(f"{self.name}: a step of {step.active} rows padded to {rows} exceeds its capacity of "
                             f"{self.max_rows} rows (or is padded below its size)")
        return rows

    def check_query(self, q: torch.Tensor, plan: Plan) -> None:
        if self.validate:
            check_query(q, self.cache.shape, plan.step.active * self.q_len, self.cache.device)

    def layer(self, cache: PagedCache | None) -> PagedCache:
        """The cache run() reads: `cache` (a layer's, sharing this engine's page table) or its own."""
        if cache is None or cache is self.cache:
            return self.cache
        if self.validate and (cache.assignment is not self.cache.assignment or cache.shape != self.cache.shape
                              or cache.kv.shape != self.cache.kv.shape or cache.device != self.cache.device):
            raise ValueError(f"{self.name}: a layer's cache must share the engine's page table, shape and device")
        return cache

    @abstractmethod
    def prepare(self, step: StepState) -> Plan: ...

    @abstractmethod
    def run(self, q: torch.Tensor, plan: Plan, layer: PagedCache | None = None) -> torch.Tensor: ...
