"""The PersistentKV kernel engines (pkv-bucket, pkv-masked, pkv-workqueue, pkv-fused).

prepare(step) does the host work a serving loop redoes per step (the schedule's launches
and their metadata) and ends with one host-to-device copy; run(q, plan) only queues
device work (no host sync, no H2D), so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.validate import check_kv
from pkv.engines.base import Engine, Plan
from pkv.engines.common import PinnedStaging, num_sms
from pkv.engines.cpu import build_schedule
from pkv.engines.table import info, pkv_engines
from pkv.plan.schedule import (
    Counters,
    Schedule,
    SplitPolicy,
    slot_bytes,
    slot_floats,
    split_bounds,
    workqueue_row_splits,
)

MODE_DIRECT, MODE_PARTIAL, MODE_FUSED, MODE_CLUSTER = 0, 1, 2, 3
MAX_SPLITS = 256  # kMaxSegSlots in csrc/pkv_decode.cu
MAX_CLUSTER_SPLITS = 16  # kMaxClusterSplits in csrc/pkv_decode.h
GROUPS = (1, 2, 4, 8)  # GQA groups the host-scheduled kernels take (launch_decode's group check)
# The decode op's named arguments past its tensors, in csrc/binding.cpp's schema order.
KERNEL_ARGS = ("seq_lens_off", "req_ids_off", "rows_off", "tasks_off", "seg_off", "num_rows", "splits", "num_slots",
               "bound_len", "group", "page_shift", "qo_indexed", "early_exit", "mode")


def default_policy(cache: PagedCache) -> SplitPolicy:
    """About two CTAs per SM for one row: the B1 operating point before calibration."""
    return SplitPolicy(max(1, 2 * num_sms(cache.device) // cache.shape.num_kv_heads))


@dataclass(frozen=True)
class KernelLaunch:
    """What one decode launch needs from a pkv.plan.schedule.Launch, built with few host ops.

    Grid launches carry no task array: the kernel derives each CTA's token range with
    pkv.plan.schedule.split_bounds from `splits` and the row's length (or `bound`).
    """

    queue: bool
    rows: np.ndarray                 # int32 launch row -> batch row
    splits: int
    bound: int                       # longest row of the launch (bound when row-local is off)
    num_tasks: int
    needs_merge: bool
    seg_offsets: np.ndarray | None   # int32 [rows * H + 1] when merging
    tasks: np.ndarray | None         # int32 [num_tasks, 5] in queue mode


def kernel_launches(kind: str, seq_lens: np.ndarray, num_kv_heads: int, policy: SplitPolicy) -> list[KernelLaunch]:
    """The launches of pkv.plan.schedule's `kind` schedule (same order, splits, tasks, slots)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    h = num_kv_heads
    if kind == "workqueue":
        longest = int(lens.max())
        row_splits = workqueue_row_splits(lens, policy)
        per_seg = np.repeat(row_splits, h)
        seg = np.zeros(len(per_seg) + 1, dtype=np.int64)
        np.cumsum(per_seg, out=seg[1:])
        total = int(seg[-1])
        seg_id = np.repeat(np.arange(len(per_seg)), per_seg)
        split = np.arange(total) - seg[seg_id]
        row = seg_id // h
        tasks = np.empty((total, 5), dtype=np.int32)
        tasks[:, 0], tasks[:, 1], tasks[:, 2] = row, seg_id % h, split
        tasks[:, 3], tasks[:, 4] = split_bounds(lens[row], row_splits[row], split)
        rows = np.arange(len(lens), dtype=np.int32)
        return [KernelLaunch(True, rows, int(row_splits.max()), longest, total, bool(row_splits.max() > 1),
                             seg.astype(np.int32), tasks)]
    if kind == "masked":
        groups = [(np.arange(len(lens), dtype=np.int32), int(lens.max()))]
    elif kind == "bucket":
        groups = [(np.flatnonzero(lens == n).astype(np.int32), int(n)) for n in np.unique(lens)[::-1]]
    else:
        raise ValueError(f"unknown schedule kind {kind!r}")
    out = []
    for rows, longest in groups:
        splits = policy.for_length(longest)
        n = len(rows) * h * splits
        seg = np.arange(0, n + 1, splits, dtype=np.int32) if splits > 1 else None
        out.append(KernelLaunch(False, rows, splits, longest, n, splits > 1, seg, None))
    return out


@dataclass
class LaunchArgs:
    """Kernel arguments of one decode launch (and its merge), offsets into the metadata.

    `kernel` holds the decode op's named arguments (csrc/binding.cpp's schema) past its
    tensors: metadata offsets (-1 = absent) and launch dimensions."""

    kernel: dict
    num_rows: int
    num_slots: int
    mode: int
    rows_off: int
    seg_off: int
    gather: bool  # bucket launch without indexed Q/O: index_select Q, index_copy_ O


class PkvPlan(Plan):
    """A PersistentKV step plan. Its counters come from the full pkv.plan.schedule Schedule,
    built on first access: diagnostics stay out of the serving path that prepare() times."""

    def __init__(self, step: StepState, route: str, launches: int, counter_args: tuple, meta: torch.Tensor,
                 args: list[LaunchArgs], partial: torch.Tensor, counters_buf: torch.Tensor,
                 gather_rows: list[torch.Tensor]):
        self.step, self.route, self.launches = step, route, launches
        self.meta, self.args, self.partial, self.counters_buf, self.gather_rows = (
            meta, args, partial, counters_buf, gather_rows)
        self._counter_args = counter_args
        self._schedule: Schedule | None = None
        self._counters: Counters | None = None

    @property
    def schedule(self) -> Schedule:
        if self._schedule is None:
            kind, h, policy, row_local = self._counter_args[:4]
            self._schedule = build_schedule(kind, self.step.seq_lens, h, policy, row_local)
        return self._schedule

    @property
    def counters(self) -> Counters:
        if self._counters is None:
            shape, sms, extra, clustered = self._counter_args[4:]
            c = self.schedule.counters(shape, self.step.seq_lens, sms, extra)
            # Cluster-merged launches have no merge launch and keep their states on chip.
            self._counters = dataclasses.replace(c, merge_launches=c.merge_launches - len(clustered),
                                                 merge_bytes=c.merge_bytes - sum(clustered) * slot_bytes(shape))
        return self._counters


class PkvEngine(Engine):
    """Split decode over the native block table; schedules from pkv.plan.schedule."""

    def __init__(self, cache: PagedCache, name: str, policy: SplitPolicy | None = None, indexed_qo: bool = True,
                 row_local: bool = True, early_exit: bool = True, cluster_merge: bool = False, validate: bool = True):
        super().__init__(cache, validate)
        s = cache.shape
        check_kv(cache.kv, s)
        if not cache.kv.is_cuda:
            raise ValueError(f"{name} needs the KV cache on a CUDA device")
        if s.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{name} supports float16 and bfloat16, got {s.dtype}")
        if s.head_dim not in (64, 128):
            raise ValueError(f"{name} supports head_dim 64 and 128, got {s.head_dim}")
        if s.group not in GROUPS:
            raise ValueError(f"{name} supports GQA group sizes {', '.join(map(str, GROUPS))}, got {s.group}")
        self.name, self.kind, self.fused = name, pkv_engines()[name], info(name).merge == "fused"
        self.policy = policy or default_policy(cache)
        if self.policy.splits > MAX_SPLITS:
            raise ValueError(f"{name} supports at most {MAX_SPLITS} splits, got {self.policy.splits}")
        self.indexed_qo, self.row_local, self.early_exit = indexed_qo, row_local, early_exit
        # Ablation: grid launches of <= 16 splits merge inside one thread-block cluster (no
        # merge launch). Off by default: slower in most cases (docs/perf-notes.md).
        self.cluster_merge = cluster_merge
        self.num_sms = num_sms(cache.device)
        self.page_shift = s.page_size.bit_length() - 1
        self._partial = torch.empty(0, dtype=torch.float32, device=cache.device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=cache.device)
        self._empty_i32 = torch.empty(0, dtype=torch.int32, device=cache.device)
        self._staging = PinnedStaging(cache.device)   # pinned metadata buffers, reused every step
        self.ops = _kernel_ops()

    def prepare(self, step: StepState) -> PkvPlan:
        self.check_step(step)
        s = self.cache.shape
        launches = kernel_launches(self.kind, step.seq_lens, s.num_kv_heads, self.policy)
        gathers = self.kind == "bucket" and not self.indexed_qo
        batch = len(step.seq_lens)
        parts = [np.asarray(step.seq_lens, dtype=np.int32), np.asarray(step.request_ids, dtype=np.int32)]
        pos = 2 * batch
        args, max_slots, max_segs = [], 0, 0
        for launch in launches:
            rows_off, pos = pos, pos + len(launch.rows)
            parts.append(launch.rows)
            if not launch.needs_merge:
                mode = MODE_DIRECT
            elif self.fused:
                mode = MODE_FUSED
            elif self.cluster_merge and not launch.queue and launch.splits <= MAX_CLUSTER_SPLITS:
                mode = MODE_CLUSTER
            else:
                mode = MODE_PARTIAL
            seg_off = tasks_off = -1
            if mode in (MODE_PARTIAL, MODE_FUSED):
                seg_off, pos = pos, pos + len(launch.seg_offsets)
                parts.append(launch.seg_offsets)
                max_slots = max(max_slots, launch.num_tasks)
                max_segs = max(max_segs, len(launch.seg_offsets) - 1)
            if launch.queue:
                tasks_off, pos = pos, pos + launch.tasks.size
                parts.append(launch.tasks.ravel())
            kernel = dict(seq_lens_off=0, req_ids_off=batch, rows_off=-1 if launch.queue else rows_off,
                          tasks_off=tasks_off, seg_off=seg_off if mode == MODE_FUSED else -1,
                          num_rows=len(launch.rows), splits=launch.splits, num_slots=launch.num_tasks,
                          bound_len=0 if (launch.queue or self.row_local) else launch.bound, group=s.group,
                          page_shift=self.page_shift, qo_indexed=not gathers, early_exit=bool(self.early_exit),
                          mode=mode)
            args.append(LaunchArgs(kernel, len(launch.rows), launch.num_tasks, mode, rows_off, seg_off, gathers))

        meta = self._staging.upload(parts)
        need = max_slots * slot_floats(s) + 4  # + the acc block's 16-byte alignment
        if max_slots and self._partial.numel() < need:
            self._partial = torch.empty(need, dtype=torch.float32, device=self.cache.device)
        if self.fused and self._counters.numel() < max_segs:
            self._counters = torch.zeros(max_segs, dtype=torch.int32, device=self.cache.device)
        gather_rows = [meta[a.rows_off:a.rows_off + a.num_rows].long() for a in args] if gathers else []
        merges = sum(a.mode == MODE_PARTIAL for a in args)
        launches_total = len(args) + merges + (2 * len(args) if gathers else 0)
        clustered = [a.num_slots for a in args if a.mode == MODE_CLUSTER]
        counter_args = (self.kind, s.num_kv_heads, self.policy, self.row_local, s, self.num_sms,
                        2 * len(args) if gathers else 0, clustered)
        return PkvPlan(step, f"{self.name}/s{self.policy.splits}", launches_total, counter_args, meta, args,
                       self._partial, self._counters, gather_rows)

    def run(self, q: torch.Tensor, plan: PkvPlan, layer: PagedCache | None = None) -> torch.Tensor:
        self.check_query(q, plan)
        s, kv = self.cache.shape, self.layer(layer).kv
        out = torch.empty_like(q)
        for k, a in enumerate(plan.args):
            if a.gather:
                q_in = q.index_select(0, plan.gather_rows[k])
                o = torch.empty_like(q_in)
            else:
                q_in, o = q, out
            self.ops.decode(q_in, kv, self.cache.block_table, plan.meta, o,
                            plan.partial if a.mode != MODE_DIRECT else self._empty_f32(),
                            plan.counters_buf if a.mode == MODE_FUSED else self._empty_i32, **a.kernel)
            if a.mode == MODE_PARTIAL:
                self.ops.merge(plan.partial, plan.meta, o, a.seg_off, a.rows_off, a.num_rows, s.num_kv_heads,
                               a.num_slots, s.group, 0 if a.gather else 1)
            if a.gather:
                out.index_copy_(0, plan.gather_rows[k], o)
        return out

    def _empty_f32(self) -> torch.Tensor:
        return self._partial[:0]


def _kernel_ops():
    from pkv.kernels.loader import ops

    return ops()


def build(name, info, cache, policy=None, **options):
    """A host-scheduled engine: the kernels on a CUDA cache, the task-list engine on a CPU one."""
    from pkv.engines.registry import check_options

    if "splits" in options:   # a spec's fixed split count (pkv-workqueue:splits=16)
        policy = SplitPolicy(options.pop("splits"))
    if not cache.kv.is_cuda:
        from pkv.engines.cpu import build as cpu_build

        return cpu_build(name, info, cache, policy, **options)
    check_options(name, options, set(info.options) - {"num_sms"})
    return PkvEngine(cache, name, policy, **options)
