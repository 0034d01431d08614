"""The public decode as one compile-safe torch op: `torch.ops.pkv_api.paged_decode`.

Registered with torch.library.custom_op: it mutates `out`, `lse` and `workspace` and
returns nothing, and its fake (meta) kernel checks the inputs and does nothing else, so
torch.compile(fullgraph=True) traces a model that calls it and CUDA graphs capture it.
Both kernels run the same checks (`check_args`), so a bad input is one ValueError at
trace time and in eager mode alike, before anything is launched.

On CUDA it launches `torch.ops.pkv.graph_decode_paged` (csrc/binding.cpp); on the CPU it
runs the kernel's split rule through the FP32 oracle (pkv.plan.device_schedule +
pkv.kernels.reference), which is what CI tests. The kernel's engine-internal arguments
(partial states, merge counters, grid size, min_tiles) live in one `workspace` tensor
(`make_workspace`) that the wrapper sizes once; a functional call passes None and gets a
fresh one.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import torch

from pkv.core.shape import Shape
from pkv.engines.common import check_queries
from pkv.engines.graph import CPU_NUM_CTAS, CTAS_PER_SM, check_graph_shape
from pkv.plan.device_schedule import (
    GRAPH_MAX_ROWS,
    GRAPH_MIN_TILES,
    MAX_COUNTER_STRIDE,
    PIECE_COST,
    SHORT_TILES,
    Queries,
    graph_schedule,
)

QUERY_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}
FP8 = torch.float8_e4m3fn
ALIGN = 16   # bytes: the kernel's cp.async reads 16-byte pieces of every token row


@cache
def num_ctas(device: torch.device, head_dim: int) -> int:
    """The kernel's grid on `device`: CTAs/SM at this head_dim x SMs (the CPU oracle cuts like the H200)."""
    if device.type != "cuda":
        return CPU_NUM_CTAS
    return torch.cuda.get_device_properties(device).multi_processor_count * CTAS_PER_SM.get(head_dim, 1)


def partial_floats(ctas: int, group: int, head_dim: int) -> int:
    """FP32 words of the partial states: 2 per CTA, m | l | acc with acc 16-byte aligned (pkv::acc_offset)."""
    slots = 2 * ctas
    return (2 * slots * group + 3) // 4 * 4 + slots * group * head_dim


def state_rows(num_qo_heads: int, num_kv_heads: int, head_dim: int, q_len: int) -> int:
    """Query rows of one partial state: G x the query tokens of one pass (Queries.block)."""
    group = num_qo_heads // num_kv_heads
    return group * Queries.of(group, head_dim, q_len).block


def make_workspace(max_rows: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                   device: torch.device | str, q_len: int = 1) -> torch.Tensor:
    """The op's scratch for steps of up to `max_rows` rows of `q_len` query tokens each (split with
    the same q_len): float32 [partial | row ids | counters].

    Row ids are 0..max_rows-1 (block_table row r serves batch row r); the counters start at
    zero and the kernel rearms them, so the workspace is reused by every later call (and
    graph replay) without being cleared."""
    if not 1 <= max_rows <= GRAPH_MAX_ROWS:
        raise ValueError(f"pkv decode holds 1..{GRAPH_MAX_ROWS} rows a step, got {max_rows}")
    check_queries(q_len, -1, None, num_qo_heads, "pkv decode")
    device = torch.device(device)
    n = partial_floats(num_ctas(device, head_dim), state_rows(num_qo_heads, num_kv_heads, head_dim, q_len), head_dim)
    ws = torch.zeros(n + max_rows * (1 + num_kv_heads * MAX_COUNTER_STRIDE), dtype=torch.float32, device=device)
    ws[n:n + max_rows].view(torch.int32).copy_(torch.arange(max_rows, dtype=torch.int32, device=device))
    return ws


def split_workspace(ws: torch.Tensor, rows: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                    q_len: int = 1):
    """(partial, row ids [rows], counters [rows * Hkv * MAX_COUNTER_STRIDE]) views of a workspace; ValueError
    if it is too small."""
    n = partial_floats(num_ctas(ws.device, head_dim), state_rows(num_qo_heads, num_kv_heads, head_dim, q_len),
                       head_dim)
    per_row = num_kv_heads * MAX_COUNTER_STRIDE
    capacity = (ws.numel() - n) // (1 + per_row)
    if rows > capacity:
        raise ValueError(f"the workspace holds {max(capacity, 0)} rows of {num_qo_heads} query / {num_kv_heads} KV "
                         f"heads of dim {head_dim} at q_len {q_len}, the call {rows} (make it with make_workspace "
                         f"for this shape and q_len)")
    ids = ws[n:n + capacity].view(torch.int32)
    counters = ws[n + capacity:n + capacity * (1 + per_row)].view(torch.int32)
    return ws[:n], ids[:rows], counters[:rows * per_row]


def _fail(what: str) -> None:
    raise ValueError(f"pkv decode: {what}")


def check_args(q, k, v, block_table, seq_lens, workspace, out, lse, sm_scale, logits_soft_cap, k_scale,
               v_scale, window_left=-1, q_len=1, sinks=None) -> Shape:
    """Every refusal of the op, before launch (shapes, dtypes, devices, strides, limits); returns the Shape."""
    if q.dim() != 3:
        _fail(f"q must be [batch * q_len, num_qo_heads, head_dim], got {list(q.shape)}")
    if q.dtype not in QUERY_DTYPES:
        _fail(f"q must be float16 or bfloat16, got {q.dtype}")
    rows_q, hq, d = q.shape
    check_queries(q_len, window_left, sinks, int(hq), "pkv decode")
    if rows_q % q_len:
        _fail(f"q holds q_len={q_len} query tokens per row: its {rows_q} rows are not a multiple of it")
    batch = rows_q // q_len
    pages, hkv, page, dk = k.shape
    fp8 = k.dtype == FP8
    if k.dtype not in (q.dtype, FP8):
        _fail(f"the KV cache must be q's dtype ({q.dtype}) or float8_e4m3fn, got {k.dtype}")
    for name, t in (("kv_cache", k), ("block_table", block_table), ("seq_lens", seq_lens), ("out", out),
                    ("lse", lse), ("workspace", workspace), ("sinks", sinks)):
        if t is not None and t.device != q.device:
            _fail(f"{name} is on {t.device}, q on {q.device}: every input must be on one device")
    if dk != d:
        _fail(f"q has head_dim {d}, the KV cache {dk}")
    if hq % hkv:
        _fail(f"q's {hq} heads are not a multiple of the KV cache's {hkv} KV heads (is the layout right?)")
    if not 1 <= batch <= GRAPH_MAX_ROWS:
        _fail(f"a call holds 1..{GRAPH_MAX_ROWS} rows, got {batch}")
    # int(): under torch.compile with dynamic shapes these are symbolic; the kernel is built per value anyway.
    shape = Shape(num_qo_heads=int(hq), num_kv_heads=int(hkv), head_dim=int(d), page_size=int(page),
                  dtype=QUERY_DTYPES[q.dtype], kv_dtype="fp8" if fp8 else "auto")   # refuses a page size not 2^k
    check_graph_shape(shape)                           # head dims, group sizes, FP8 head dims
    if k.stride() != v.stride():
        _fail(f"K and V must have the same strides, got {k.stride()} and {v.stride()}")
    if k.stride(3) != 1:
        _fail(f"the KV cache's head_dim must be contiguous (stride 1), got stride {k.stride(3)}")
    if any(s * k.element_size() % ALIGN for s in k.stride()[:3]):
        _fail(f"every KV page, head and token must start on a {ALIGN}-byte boundary, got element strides "
              f"{k.stride()[:3]} of {k.element_size()} bytes")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.shape[0] != batch:
        _fail(f"block_table must be int32 [batch={batch}, max_pages], got {block_table.dtype} "
              f"{list(block_table.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32 or seq_lens.shape[0] != batch:
        _fail(f"seq_lens must be int32 [batch={batch}], got {seq_lens.dtype} {list(seq_lens.shape)}")
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens), ("q", q)):
        if not t.is_contiguous():
            _fail(f"{name} must be contiguous")
    if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        _fail(f"out must be a contiguous {q.dtype} {list(q.shape)}, got {'' if out.is_contiguous() else 'strided '}"
              f"{out.dtype} {list(out.shape)}")
    if lse is not None and (lse.shape != (rows_q, hq) or lse.dtype != torch.float32 or not lse.is_contiguous()):
        _fail(f"lse must be a contiguous float32 [{rows_q}, {hq}], got {lse.dtype} {list(lse.shape)}")
    if sinks is not None and not sinks.is_contiguous():
        _fail("sinks must be contiguous")
    if workspace is not None and (workspace.dtype != torch.float32 or workspace.dim() != 1):
        _fail("workspace must be a 1-D float32 tensor from make_workspace")
    # A scale or cap of inf (or NaN) would make every output NaN: each must be finite.
    if not (sm_scale > 0 and math.isfinite(sm_scale)) or not (logits_soft_cap >= 0 and math.isfinite(logits_soft_cap)):
        _fail(f"sm_scale must be finite and > 0, logits_soft_cap finite and >= 0, got {sm_scale} and {logits_soft_cap}")
    if not (k_scale > 0 and v_scale > 0 and math.isfinite(k_scale) and math.isfinite(v_scale)):
        _fail(f"k_scale and v_scale must be finite and > 0, got {k_scale} and {v_scale}")
    if not fp8 and (k_scale != 1.0 or v_scale != 1.0):
        _fail(f"k_scale and v_scale read an FP8 cache; this cache is {k.dtype}")
    return shape


def _check_values(view_pages: int, page: int, block_table: torch.Tensor, lens: np.ndarray, q_len: int = 1) -> None:
    # Only where the values are on the host already (the CPU path): the GPU path never syncs.
    if (lens < 0).any() or (lens > block_table.shape[1] * page).any():
        _fail(f"seq_lens must be in 0..{block_table.shape[1] * page} (block_table width x page size), "
              f"got {lens.min()}..{lens.max()}")
    if ((lens > 0) & (lens < q_len)).any():
        _fail(f"a row of q_len {q_len} holds its {q_len} query tokens in the cache: seq_lens must be 0 or >= "
              f"{q_len}, got {lens[lens > 0].min()}")
    used = np.concatenate([block_table[i, :-(-int(n) // page)].numpy() for i, n in enumerate(lens)]
                          + [np.zeros(0, np.int32)])
    if len(used) and (used.min() < 0 or used.max() >= view_pages):
        _fail(f"block_table holds page ids {used.min()}..{used.max()}, the KV cache {view_pages} pages")


def _cpu(q, k, v, block_table, seq_lens, out, lse, sm_scale, cap, k_scale, v_scale, window_left, q_len,
         sinks) -> None:
    from pkv.kernels.reference import run_schedule

    lens = seq_lens.numpy().astype(np.int64)
    _check_values(k.shape[0], k.shape[2], block_table, lens, q_len)
    kv = torch.stack([k.float() * k_scale, v.float() * v_scale], dim=1)   # the oracle reads [pages, 2, Hkv, P, D]
    queries = Queries.of(q.shape[1] // k.shape[1], k.shape[3], q_len, window_left)
    schedule = graph_schedule(lens, k.shape[1], num_ctas(q.device, k.shape[3]), GRAPH_MIN_TILES, PIECE_COST, queries,
                              SHORT_TILES)
    lse32 = None if lse is None else torch.empty(lse.shape, dtype=torch.float32)
    res = run_schedule(q, kv, block_table, seq_lens, schedule, sm_scale, cap, lse32, queries=queries, sinks=sinks)
    rows = torch.as_tensor(np.repeat(lens > 0, q_len))   # rows of length 0 are padding: left unwritten, as on the GPU
    out[rows] = res[rows].to(out.dtype)
    if lse is not None:
        lse[rows] = lse32[rows]


def _cuda(q, k, v, block_table, seq_lens, workspace, out, lse, sm_scale, cap, k_scale, v_scale, window_left, q_len,
          sinks, pdl) -> None:
    from pkv.engines.common import pdl_supported
    from pkv.kernels.loader import ops

    if k.data_ptr() % ALIGN or v.data_ptr() % ALIGN:
        _fail(f"K and V must start on {ALIGN}-byte boundaries")
    rows_q, hq, d = q.shape
    batch = rows_q // q_len
    if workspace is None:
        workspace = make_workspace(batch, hq, k.shape[1], d, q.device, q_len)
    partial, ids, counters = split_workspace(workspace, batch, hq, k.shape[1], d, q_len)
    ops().graph_decode_paged(q, k, v, block_table, seq_lens, ids, out, lse, partial, counters, num_ctas(q.device, d),
                             GRAPH_MIN_TILES, None, k_scale, v_scale, sm_scale, cap, piece_cost=PIECE_COST,
                             window_left=window_left, q_len=q_len, sinks=sinks, pdl=pdl and pdl_supported(q.device),
                             short_tiles=SHORT_TILES)


@torch.library.custom_op("pkv_api::paged_decode", mutates_args=("out", "lse", "workspace"))
def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, workspace: torch.Tensor | None, out: torch.Tensor,
                 lse: torch.Tensor | None, sm_scale: float, logits_soft_cap: float, k_scale: float,
                 v_scale: float, window_left: int = -1, q_len: int = 1, sinks: torch.Tensor | None = None,
                 pdl: bool = False) -> None:
    """Decode attention of q [B * q_len, Hq, D] over K, V [pages, Hkv, P, D] (strided views) into out (and lse);
    pdl: launched as a programmatic dependent of the kernel before it (csrc/graph_decode.h: what it may
    read before that kernel is done), where the GPU has it."""
    args = (q, k, v, block_table, seq_lens, workspace, out, lse, sm_scale, logits_soft_cap, k_scale, v_scale)
    check_args(*args, window_left, q_len, sinks)
    if q.device.type == "cuda":
        _cuda(*args, window_left, q_len, sinks, pdl)
    else:
        if workspace is not None:   # its capacity, as on CUDA
            split_workspace(workspace, q.shape[0] // q_len, q.shape[1], k.shape[1], q.shape[2], q_len)
        _cpu(q, k, v, block_table, seq_lens, out, lse, sm_scale, logits_soft_cap, k_scale, v_scale, window_left,
             q_len, sinks)


@paged_decode.register_fake
def _(q, k, v, block_table, seq_lens, workspace, out, lse, sm_scale, logits_soft_cap, k_scale, v_scale,
      window_left=-1, q_len=1, sinks=None, pdl=False) -> None:
    check_args(q, k, v, block_table, seq_lens, workspace, out, lse, sm_scale, logits_soft_cap, k_scale, v_scale,
               window_left, q_len, sinks)
