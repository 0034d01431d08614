"""GPU engines over one PagedCache: the PersistentKV kernels, FlashInfer, and SDPA repack.

Every engine splits its work the same way: prepare(step) does the host work a serving
loop redoes per step (schedule, metadata, FlashInfer's plan) and ends with at most one
host-to-device copy; run(q, plan) only queues device work (no host sync, no H2D), so
it can be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pkv.cache import PagedCache
from pkv.engines.base import Engine, Plan
from pkv.engines.cpu import build_schedule
from pkv.harness import StepState
from pkv.paging import flashinfer_view
from pkv.schedule import Launch, Schedule, SplitPolicy
from pkv.validate import check_kv

PKV_ENGINES = {"pkv-bucket": "bucket", "pkv-masked": "masked", "pkv-workqueue": "workqueue", "pkv-fused": "workqueue"}
OTHER_ENGINES = ("flashinfer", "flashinfer-tc", "flashinfer-persistent", "sdpa-repack")
MODE_DIRECT, MODE_PARTIAL, MODE_FUSED = 0, 1, 2


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_policy(cache: PagedCache) -> SplitPolicy:
    """About two CTAs per SM for one row: the B1 operating point before calibration."""
    return SplitPolicy(max(1, 2 * num_sms(cache.device) // cache.shape.num_kv_heads))


def to_device_int32(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Concatenate int32 host arrays into pinned memory and issue one async H2D copy."""
    total = sum(len(p) for p in parts)
    host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=True)
    view = host.numpy()
    pos = 0
    for p in parts:
        view[pos:pos + len(p)] = p
        pos += len(p)
    return host.to(device, non_blocking=True)


@dataclass
class LaunchArgs:
    """Kernel arguments of one decode launch (and its merge), offsets into the metadata."""

    offs: list[int]
    dims: list[int]
    num_rows: int
    num_slots: int
    mode: int
    rows_off: int
    seg_off: int
    gather: bool  # bucket launch without indexed Q/O: index_select Q, index_copy_ O


@dataclass
class PkvPlan(Plan):
    meta: torch.Tensor = None
    args: list[LaunchArgs] = field(default_factory=list)
    schedule: Schedule | None = None
    partial: torch.Tensor | None = None
    counters_buf: torch.Tensor | None = None
    gather_rows: list[torch.Tensor] = field(default_factory=list)


class PkvEngine(Engine):
    """Split decode over the native block table; schedules from pkv.schedule."""

    def __init__(self, cache: PagedCache, name: str, policy: SplitPolicy | None = None, indexed_qo: bool = True,
                 row_local: bool = True, early_exit: bool = True):
        super().__init__(cache)
        s = cache.shape
        check_kv(cache.kv, s)
        if not cache.kv.is_cuda:
            raise ValueError(f"{name} needs the KV cache on a CUDA device")
        if s.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"{name} supports float16 and bfloat16, got {s.dtype}")
        if s.head_dim not in (64, 128):
            raise ValueError(f"{name} supports head_dim 64 and 128, got {s.head_dim}")
        if s.group not in (1, 2, 4, 8):
            raise ValueError(f"{name} supports GQA group sizes 1, 2, 4, 8, got {s.group}")
        self.name, self.kind, self.fused = name, PKV_ENGINES[name], name == "pkv-fused"
        self.policy = policy or default_policy(cache)
        self.indexed_qo, self.row_local, self.early_exit = indexed_qo, row_local, early_exit
        self.num_sms = num_sms(cache.device)
        self.page_shift = s.page_size.bit_length() - 1
        self._partial = torch.empty(0, dtype=torch.float32, device=cache.device)
        self._counters = torch.zeros(0, dtype=torch.int32, device=cache.device)
        self._empty_i32 = torch.empty(0, dtype=torch.int32, device=cache.device)
        self.ops = _kernel_ops()

    def prepare(self, step: StepState) -> PkvPlan:
        self.check_step(step)
        s = self.cache.shape
        h = s.num_kv_heads
        schedule = build_schedule(self.kind, step.seq_lens, h, self.policy, self.row_local)
        gathers = self.kind == "bucket" and not self.indexed_qo
        extra = 2 * len(schedule.launches) if gathers else 0
        counters = schedule.counters(s, step.seq_lens, self.num_sms, extra)

        parts = [np.asarray(step.seq_lens, dtype=np.int32), np.asarray(step.request_ids, dtype=np.int32)]
        pos = len(step.seq_lens) * 2
        args, max_slots, max_segs = [], 0, 0
        for launch in schedule.launches:
            rows_off, pos = pos, pos + len(launch.rows)
            parts.append(launch.rows)
            mode = MODE_DIRECT if not launch.needs_merge else (MODE_FUSED if self.fused else MODE_PARTIAL)
            seg_off = -1
            if mode != MODE_DIRECT:
                seg_off, pos = pos, pos + len(launch.seg_offsets)
                parts.append(launch.seg_offsets)
            tasks_off = -1
            if launch.kind == "queue":
                tasks_off, pos = pos, pos + launch.tasks.size
                parts.append(launch.tasks.ravel())
            args.append(self._launch_args(launch, 0, len(step.seq_lens), rows_off, seg_off, tasks_off, mode, gathers))
            max_slots = max(max_slots, launch.num_tasks if mode != MODE_DIRECT else 0)
            max_segs = max(max_segs, len(launch.seg_offsets) - 1)

        meta = to_device_int32(parts, self.cache.device)
        if self._partial.numel() < max_slots * s.group * (s.head_dim + 2):
            self._partial = torch.empty(max_slots * s.group * (s.head_dim + 2), dtype=torch.float32,
                                        device=self.cache.device)
        if self.fused and self._counters.numel() < max_segs:
            self._counters = torch.zeros(max_segs, dtype=torch.int32, device=self.cache.device)
        gather_rows = [meta[a.rows_off:a.rows_off + a.num_rows].long() for a in args] if gathers else []
        return PkvPlan(step, f"{self.name}/s{self.policy.splits}", counters.launches, counters, meta=meta,
                       args=args, schedule=schedule, partial=self._partial, counters_buf=self._counters,
                       gather_rows=gather_rows)

    def _launch_args(self, launch: Launch, seq_off: int, batch: int, rows_off: int, seg_off: int, tasks_off: int,
                     mode: int, gather: bool) -> LaunchArgs:
        s = self.cache.shape
        queue = launch.kind == "queue"
        offs = [seq_off, seq_off + batch, -1 if queue else rows_off, tasks_off, seg_off if mode == MODE_FUSED else -1]
        bound = 0 if (queue or self.row_local) else int(launch.bound_len[0])
        dims = [len(launch.rows), launch.splits, launch.num_tasks, bound, s.group, self.page_shift,
                0 if gather else 1, int(self.early_exit), mode]
        return LaunchArgs(offs, dims, len(launch.rows), launch.num_tasks, mode, rows_off, seg_off, gather)

    def run(self, q: torch.Tensor, plan: PkvPlan) -> torch.Tensor:
        self.check_query(q, plan)
        s = self.cache.shape
        out = torch.empty_like(q)
        for k, a in enumerate(plan.args):
            if a.gather:
                q_in = q.index_select(0, plan.gather_rows[k])
                o = torch.empty_like(q_in)
            else:
                q_in, o = q, out
            self.ops.decode(q_in, self.cache.kv, self.cache.block_table, plan.meta, o,
                            plan.partial if a.mode != MODE_DIRECT else self._partial,
                            plan.counters_buf if a.mode == MODE_FUSED else self._empty_i32, a.offs, a.dims)
            if a.mode == MODE_PARTIAL:
                self.ops.merge(plan.partial, plan.meta, o, a.seg_off, a.rows_off, a.num_rows, s.num_kv_heads,
                               a.num_slots, s.group, 0 if a.gather else 1)
            if a.gather:
                out.index_copy_(0, plan.gather_rows[k], o)
        return out


def _kernel_ops():
    from pkv.kernels import ops

    return ops()


class FlashInferEngine(Engine):
    """FlashInfer's paged decode over the same kv tensor (layout HND), planned once per step."""

    def __init__(self, cache: PagedCache, name: str):
        super().__init__(cache)
        check_kv(cache.kv, cache.shape)
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(f"engine {name!r} needs flashinfer ({e})") from e
        self.name = name
        self.num_sms = num_sms(cache.device)
        self._workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=cache.device)
        if name == "flashinfer-persistent":
            self.wrapper = flashinfer.BatchAttention(kv_layout="HND", device=str(cache.device))
        else:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_tensor_cores=name == "flashinfer-tc")

    def prepare(self, step: StepState) -> Plan:
        self.check_step(step)
        s = self.cache.shape
        view = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        indptr, indices, last = (torch.from_numpy(a) for a in (view.indptr, view.indices, view.last_page_len))
        dt = s.torch_dtype
        if self.name == "flashinfer-persistent":
            # Host indptr/lengths (its plan reads them on the host), device page ids.
            qo_indptr = torch.arange(step.active + 1, dtype=torch.int32)
            lens = torch.from_numpy(np.asarray(step.seq_lens, dtype=np.int32))
            self.wrapper.plan(qo_indptr, indptr, indices.to(self.cache.device), lens, s.num_qo_heads,
                              s.num_kv_heads, s.head_dim, s.head_dim, s.page_size, causal=False,
                              q_data_type=dt, kv_data_type=dt)
        else:
            self.wrapper.plan(indptr, indices, last, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size,
                              q_data_type=dt, kv_data_type=dt)
        return Plan(step, self.name, 1, None)

    def run(self, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        self.check_query(q, plan)
        out = self.wrapper.run(q, self.cache.kv)
        return out[0] if isinstance(out, tuple) else out


@dataclass
class RepackPlan(Plan):
    pages: list[torch.Tensor] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)


class SdpaRepackEngine(Engine):
    """Gather each row's pages into contiguous K,V, then torch SDPA (the framework baseline)."""

    name = "sdpa-repack"

    def __init__(self, cache: PagedCache):
        super().__init__(cache)
        check_kv(cache.kv, cache.shape)

    def prepare(self, step: StepState) -> RepackPlan:
        self.check_step(step)
        p = self.cache.shape.page_size
        used = -(-np.asarray(step.seq_lens, dtype=np.int64) // p)
        table = self.cache.block_table_host[step.request_ids]
        parts = [table[i, :u] for i, u in enumerate(used)]
        flat = to_device_int32(parts, self.cache.device).long()
        offs = np.concatenate([[0], np.cumsum(used)])
        pages = [flat[int(offs[i]):int(offs[i + 1])] for i in range(len(used))]
        return RepackPlan(step, self.name, 2 * len(used), None, pages, [int(x) for x in step.seq_lens])

    def run(self, q: torch.Tensor, plan: RepackPlan) -> torch.Tensor:
        self.check_query(q, plan)
        s = self.cache.shape
        out = torch.empty_like(q)
        for i, (pages, n) in enumerate(zip(plan.pages, plan.lens)):
            kv = self.cache.kv.index_select(0, pages)  # [n_pages, 2, H, P, D]
            kv = kv.permute(1, 2, 0, 3, 4).reshape(2, s.num_kv_heads, -1, s.head_dim)[:, :, :n]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[i, :, None, :][None], kv[0][None], kv[1][None], scale=1.0 / math.sqrt(s.head_dim), enable_gqa=True)
            out[i] = o[0, :, 0]
        return out


def make_gpu_engine(name: str, cache: PagedCache, policy: SplitPolicy | None = None, **options) -> Engine:
    if not cache.kv.is_cuda:
        raise ValueError(f"engine {name!r} needs the KV cache on a CUDA device")
    if name in PKV_ENGINES:
        unknown = set(options) - {"indexed_qo", "row_local", "early_exit"}
        if unknown:
            raise ValueError(f"unknown options for {name}: {sorted(unknown)}")
        return PkvEngine(cache, name, policy, **options)
    if options:
        raise ValueError(f"engine {name!r} takes no options, got {sorted(options)}")
    if name in ("flashinfer", "flashinfer-tc", "flashinfer-persistent"):
        return FlashInferEngine(cache, name)
    if name == "sdpa-repack":
        return SdpaRepackEngine(cache)
    raise ValueError(f"unknown engine {name!r}; choose from {sorted(PKV_ENGINES) + list(OTHER_ENGINES)}")
