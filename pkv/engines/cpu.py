"""Engines that run anywhere torch does: the FP32 reference and the task-list engine."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.engines.base import Engine, Plan
from pkv.engines.table import REFERENCE
from pkv.kernels.reference import attention_reference, run_schedule
from pkv.plan.schedule import Schedule, SplitPolicy, bucket_schedule, masked_schedule, workqueue_schedule


@dataclass
class TablePlan(Plan):
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    schedule: Schedule | None = None


class ReferenceEngine(Engine):
    """Eq. 1 in FP32, one row at a time."""

    def prepare(self, step: StepState) -> TablePlan:
        self.check_step(step)
        ids = torch.as_tensor(step.request_ids, device=self.cache.device)
        return TablePlan(step, self.name, step.active, None, self.cache.block_table[ids],
                         torch.as_tensor(step.seq_lens))

    def run(self, q: torch.Tensor, plan: TablePlan, layer: PagedCache | None = None) -> torch.Tensor:
        self.check_query(q, plan)
        return attention_reference(q, self.layer(layer).values(), plan.block_table, plan.seq_lens).to(q.dtype)


def build_schedule(kind: str, seq_lens, num_kv_heads: int, policy: SplitPolicy, row_local: bool = True) -> Schedule:
    if kind == "bucket":
        return bucket_schedule(seq_lens, num_kv_heads, policy, row_local)
    if kind == "masked":
        return masked_schedule(seq_lens, num_kv_heads, policy, row_local)
    if kind == "workqueue":
        return workqueue_schedule(seq_lens, num_kv_heads, policy)
    raise ValueError(f"unknown schedule kind {kind!r}")


class TaskListEngine(Engine):
    """The PersistentKV algorithm in torch: the scheduler's tasks, then the segmented merge."""

    def __init__(self, cache, kind: str, policy: SplitPolicy, row_local: bool = True, indexed_qo: bool = True,
                 early_exit: bool = True, num_sms: int = 1, validate: bool = True):
        super().__init__(cache, validate)
        # early_exit changes only how the kernels spend time, not the math executed here.
        self.kind, self.policy, self.row_local, self.num_sms = kind, policy, row_local, num_sms
        self.indexed_qo, self.early_exit = indexed_qo, early_exit

    def prepare(self, step: StepState) -> TablePlan:
        self.check_step(step)
        schedule = build_schedule(self.kind, step.seq_lens, self.cache.shape.num_kv_heads, self.policy, self.row_local)
        # Without indexed Q/O each bucket launch needs a gather of Q and a scatter of O.
        extra = 0 if self.indexed_qo or self.kind != "bucket" else 2 * len(schedule.launches)
        counters = schedule.counters(self.cache.shape, step.seq_lens, self.num_sms, extra)
        ids = torch.as_tensor(step.request_ids, device=self.cache.device)
        return TablePlan(step, f"{self.name}/s{self.policy.splits}", counters.launches, counters,
                         self.cache.block_table[ids], torch.as_tensor(step.seq_lens), schedule)

    def run(self, q: torch.Tensor, plan: TablePlan, layer: PagedCache | None = None) -> torch.Tensor:
        self.check_query(q, plan)
        return run_schedule(q, self.layer(layer).values(), plan.block_table, plan.seq_lens, plan.schedule).to(q.dtype)


def build(name, info, cache, policy=None, **options):
    """The reference (any device), or a pkv-* engine's task-list stand-in on a CPU cache."""
    if name == REFERENCE:
        return ReferenceEngine(cache, **options)
    from pkv.plan.schedule import SplitPolicy

    return TaskListEngine(cache, info.kind, policy or SplitPolicy(8), **options)
