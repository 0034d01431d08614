"""`pkv-graph`: the decode with no host plan (csrc/graph_decode.h, docs/graph-decode.md).

prepare() writes the step's lengths and block-table row ids into one pinned buffer and
issues one host-to-device copy; the kernel decides the split on the GPU. Every buffer the
kernel reads has a fixed address and the grid is fixed by capacity, so run() can be
captured once in a CUDA graph and replayed for any later step of up to `rows` rows:
prepare(step, rows=B_pad) pads the step with zero-length rows, which the kernel skips
(their outputs are left unwritten).

On a CPU cache the same rule runs through pkv.kernels.reference.run_schedule
(pkv.plan.device_schedule.graph_schedule), the oracle CI tests.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.engines.base import Engine, Plan
from pkv.engines.common import PinnedStaging, check_queries, pdl_supported
from pkv.kernels.reference import run_schedule
from pkv.plan.costmodel import graph_cost
from pkv.plan.device_schedule import (
    GRAPH_MAX_ROWS,
    GRAPH_MIN_TILES,
    MAX_COUNTER_STRIDE,
    MAX_PIECE_COST,
    MAX_SPIN_NS,
    PIECE_COST,
    SHORT_TILES,
    Queries,
    graph_schedule,
)
from pkv.plan.schedule import Counters, slot_floats

HEAD_DIMS = (64, 128, 256)
FP8_HEAD_DIMS = (64, 128)   # kFp8MaxHeadDim in csrc/graph_decode.h: the FP8 kernels built
PAGE_SCALE_MIN_PAGE = 16    # kChunk in csrc/attend.cuh: one page factor per 16-token chunk
MAX_GROUP = 16          # kMaxGroup in csrc/attend.cuh (8 at head_dim 256)
CTAS_PER_SM = {64: 3, 128: 2, 256: 1}   # AttendCfg<D>::kCtasPerSm in csrc/attend.cuh
CPU_NUM_CTAS = 264      # the H200's 132 SMs x 2: the CPU oracle cuts steps like the reference GPU


def check_graph_shape(shape, scales=None) -> None:
    if shape.dtype not in ("float16", "bfloat16"):
        raise ValueError(f"pkv-graph supports float16 and bfloat16 queries, got {shape.dtype}")
    if shape.head_dim not in HEAD_DIMS:
        raise ValueError(f"pkv-graph supports head_dim {HEAD_DIMS}, got {shape.head_dim}")
    if shape.fp8 and shape.head_dim not in FP8_HEAD_DIMS:
        raise ValueError(f"pkv-graph is built with an FP8 cache for head_dim {FP8_HEAD_DIMS}, got {shape.head_dim}")
    if scales is not None and scales.policy == "page" and shape.page_size < PAGE_SCALE_MIN_PAGE:
        raise ValueError(f"pkv-graph reads per-page FP8 scales on pages of >= {PAGE_SCALE_MIN_PAGE} tokens, "
                         f"got page_size {shape.page_size} (use the 'tensor' policy)")
    limit = 8 if shape.head_dim == 256 else MAX_GROUP
    if not 1 <= shape.group <= limit:
        raise ValueError(f"pkv-graph supports GQA groups 1..{limit} at head_dim {shape.head_dim}, got {shape.group}")


class GraphPlan(Plan):
    """A pkv-graph step plan: `rows` the kernel scans (the step, or its padded bucket). Its
    counters are the device rule's (pkv.plan.costmodel.graph_counts: CTAs with work, the cut
    segments' partial states), computed on first access, off the path prepare() times."""

    def __init__(self, step: StepState, route: str, launches: int, rows: int, counter_args: tuple):
        self.step, self.route, self.launches, self.rows = step, route, launches, rows
        self._counter_args = counter_args
        self._counters: Counters | None = None

    @property
    def counters(self) -> Counters:
        if self._counters is None:
            shape, num_ctas, min_tiles, num_sms, piece_cost, queries, short_tiles = self._counter_args
            cost = graph_cost(shape, self.step.seq_lens, num_ctas, min_tiles, piece_cost, queries, short_tiles)
            self._counters = Counters(1, 0, 0, int(cost.ctas), num_ctas - int(cost.ctas), num_sms,
                                      int(cost.kv_bytes), int(cost.kv_bytes), int(cost.merge_bytes),
                                      int(cost.task_bytes))
        return self._counters


class GraphEngine(Engine):
    """window_left (-1: off), q_len (query tokens per row: q is [rows * q_len, Hq, D]) and sinks
    (float32 [Hq]) are the layer's attention (pkv.plan.device_schedule.Queries, docs/api.md).
    short_tiles: a step of at most this many tiles a CTA over half the grid runs on half of it
    (pkv.plan.device_schedule.grid_ctas; 0: off)."""

    def __init__(self, cache: PagedCache, max_rows: int | None = None, ctas_per_sm: int | None = None,
                 min_tiles: int = GRAPH_MIN_TILES, num_sms: int | None = None,
                 piece_cost: int = PIECE_COST, counter_stride: int = 1, spin_ns: int = 0, pdl: bool | None = None,
                 window_left: int = -1, q_len: int = 1, sinks=None, short_tiles: int = SHORT_TILES):
        super().__init__(cache)
        s = cache.shape
        if isinstance(sinks, (list, tuple)):
            sinks = torch.tensor(sinks, dtype=torch.float32)
        check_queries(q_len, window_left, sinks, s.num_qo_heads)
        self.queries = Queries.of(s.group, s.head_dim, q_len, window_left)
        self.sinks = None if sinks is None else sinks.to(cache.device).contiguous()
        self.gpu = cache.kv.is_cuda
        if self.gpu:
            check_graph_shape(s, cache.scales)
        self.max_rows = int(max_rows or min(GRAPH_MAX_ROWS, cache.assignment.num_requests))
        if not 1 <= self.max_rows <= GRAPH_MAX_ROWS:
            raise ValueError(f"pkv-graph holds 1..{GRAPH_MAX_ROWS} rows a step, got max_rows={self.max_rows}")
        if min_tiles < 1:
            raise ValueError(f"min_tiles must be >= 1, got {min_tiles}")
        self.min_tiles = min_tiles
        if not 0 <= piece_cost <= MAX_PIECE_COST:
            raise ValueError(f"piece_cost is 0..{MAX_PIECE_COST} set-up units a short segment's piece costs in "
                             f"the cut (0: tiles only), got {piece_cost}")
        self.piece_cost = int(piece_cost)
        if not (isinstance(short_tiles, int) and short_tiles >= 0):
            raise ValueError(f"short_tiles is >= 0 tiles a CTA over half the grid (0: off), got {short_tiles!r}")
        self.short_tiles = short_tiles
        # The in-grid merge's diagnosis options (csrc/graph_merge.cuh, spin_pause): where the
        # segments' counters sit (ints apart) and the mergers' spin back-off (ns a poll).
        if not (1 <= counter_stride * self.queries.blocks <= MAX_COUNTER_STRIDE and 0 <= spin_ns <= MAX_SPIN_NS):
            raise ValueError(f"counter_stride x query blocks ({self.queries.blocks}) is 1..{MAX_COUNTER_STRIDE} and "
                             f"spin_ns 0..{MAX_SPIN_NS}, got {counter_stride} and {spin_ns}")
        self.counter_stride, self.spin_ns = int(counter_stride), int(spin_ns)
        # Launched as a programmatic dependent where the GPU has it (csrc/graph_decode.h says what
        # it reads before the previous kernel is done: the step's metadata and older tokens).
        self.pdl = pdl_supported(cache.device) if pdl is None else bool(pdl) and pdl_supported(cache.device)
        if self.gpu:
            sms = num_sms or torch.cuda.get_device_properties(cache.device).multi_processor_count
            self.num_ctas = (ctas_per_sm or CTAS_PER_SM[s.head_dim]) * sms
        else:
            sms = num_sms or CPU_NUM_CTAS // 2
            self.num_ctas = (ctas_per_sm or 2) * num_sms if num_sms else CPU_NUM_CTAS
        self._counter_args = (s, self.num_ctas, min_tiles, sms, self.piece_cost, self.queries, short_tiles)
        dev = cache.device
        slots = 2 * self.num_ctas
        self.partial = torch.empty(slots * slot_floats(s) * self.queries.block + 4, dtype=torch.float32, device=dev)
        self.counters = torch.zeros(self.max_rows * s.num_kv_heads * MAX_COUNTER_STRIDE, dtype=torch.int32,
                                    device=dev)
        # [lengths | request ids] of one step, at a fixed address (a captured graph reads it),
        # filled through pinned buffers reused across steps; padding rows are zeros.
        self.meta = torch.zeros(2 * self.max_rows, dtype=torch.int32, device=dev)
        self._staging = PinnedStaging(dev, capacity=2 * self.max_rows)
        self._zeros = np.zeros(self.max_rows, dtype=np.int32)
        self.ops = None
        if self.gpu:
            from pkv.kernels.loader import ops

            self.ops = ops()

    def prepare(self, step: StepState, rows: int | None = None) -> GraphPlan:
        self.check_step(step)
        rows = self.padded_rows(step, rows)
        pad = self._zeros[:rows - step.active]
        self._staging.upload([step.seq_lens, pad, step.request_ids, pad], out=self.meta)
        return GraphPlan(step, self.name, 1, rows, self._counter_args)

    def run(self, q: torch.Tensor, plan: GraphPlan, layer: PagedCache | None = None) -> torch.Tensor:
        ql = self.queries.q_len
        if q.shape[0] != plan.rows * ql:
            raise ValueError(f"{self.name}: q has {q.shape[0]} rows, the plan {plan.rows} rows x q_len {ql}")
        c = self.layer(layer)
        out = torch.empty_like(q)
        if self.gpu:
            r, sc = plan.rows, c.scales     # FP8: the layer's scales, read per call
            scales = {} if sc is None else {"page_scales": sc.page_factors, "k_scale": sc.k_scale,
                                            "v_scale": sc.v_scale}
            self.ops.graph_decode(q, c.kv, self.cache.block_table, self.meta[:r], self.meta[r:2 * r], out,
                                  self.partial, self.counters, self.num_ctas, self.min_tiles, **scales,
                                  piece_cost=self.piece_cost, counter_stride=self.counter_stride, spin_ns=self.spin_ns,
                                  pdl=self.pdl, window_left=self.queries.window_left, q_len=ql, sinks=self.sinks,
                                  short_tiles=self.short_tiles)
            return out
        b = plan.step.active
        if ql > 1 and (np.asarray(plan.step.seq_lens)[:b] < ql).any():
            raise ValueError(f"{self.name}: a row of q_len {ql} holds at least {ql} tokens (its drafts), got "
                             f"{int(np.min(plan.step.seq_lens))}")
        lens = torch.as_tensor(np.asarray(plan.step.seq_lens, dtype=np.int32))
        table = self.cache.block_table[torch.as_tensor(plan.step.request_ids)]
        schedule = graph_schedule(plan.step.seq_lens, self.cache.shape.num_kv_heads, self.num_ctas, self.min_tiles,
                                  self.piece_cost, self.queries, self.short_tiles)
        out[:b * ql] = run_schedule(q[:b * ql], c.values(), table, lens, schedule, queries=self.queries,
                                    sinks=self.sinks).to(q.dtype)
        return out


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import check_options, no_policy

    no_policy(name, policy)
    check_options(name, options, info.options)
    return GraphEngine(cache, **options)
