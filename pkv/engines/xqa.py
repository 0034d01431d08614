"""`flashinfer-xqa`: FlashInfer's plan-free decode, TensorRT-LLM's XQA kernel
(`flashinfer.decode.trtllm_batch_decode_with_kv_cache(..., backend="xqa")`), over the same
kv tensor (layout HND) as every other engine.

XQA reads a block table of the step's rows and their lengths on the device and needs no
plan(): its grid is fixed by the batch size, the KV heads and the table's width (the
longest row it may hold), so a step's launch can be captured once and replayed. The
adapter is as lean as pkv-graph's (pkv.engines.graph):

- kept across steps, at fixed addresses: `meta` = [lengths | request ids] of up to
  `max_rows` rows, the gathered block-table rows `table[max_rows, W]` (W = the trace's
  widest row, so XQA's max_seq_len is fixed), FlashInfer's zeroed workspace (its first
  8 MiB the kernel's semaphores, the rest scratch) and the pinned staging;
- prepare(): one pinned upload of [lengths | request ids] into `meta`, then one gather of
  the rows' block-table rows into `table` (a device index_select into a fixed buffer);
  nothing is allocated, nothing waits for the device;
- run(): the XQA kernel, called through FlashInfer's compiled module (resolved once at
  construction; what `xqa()` would resolve per call), so run() is one launch and can be
  captured in a CUDA graph. prepare(step, rows=B_pad) pads the step with one-token rows
  over request 0's first page (FlashInfer's own graph wrapper pads the same way); their
  outputs are not read.

FP8 (e4m3, tensor scales): the project's cache holds K = k_scale * K8 and V = v_scale * V8
(pkv.core.fp8). XQA takes one KV scale for both K and V (`kv_scale`), a query scale
(`q_scale`) and the reciprocal of an output scale that only an FP8 output reads; its kernels
multiply the FP32 accumulator q . K8 by q_scale * kv_scale / sqrt(d) and the normalized FP32
accumulator P V8 by kv_scale (csrc/xqa/mha.cu: qkScale, voScale; mha_sm90.cu alike). V's
scale can therefore only be kv_scale, and kv_scale = v_scale, q_scale = k_scale / v_scale is
the one mapping (FlashInfer's own, from bmm1_scale = k_scale / sqrt(d) and bmm2_scale =
v_scale: kv_scale = bmm2_scale, q_scale = bmm1_scale / kv_scale * sqrt(d)). A 16-bit cache
takes 1 and 1. Both scales enter in FP32 and Q is not rescaled, so the mapping itself rounds
nothing (tests/gpu/test_xqa.py pins it bit for bit).

Which XQA kernel reads an FP8 cache: by default its generic kernel, which converts the e4m3
K and V to the query's dtype (exactly) and runs the 16-bit kernel's arithmetic: the softmax
weights P rounded to 16 bits (and the row sum taken over the rounded ones), and the output
rounded to 16 bits several times on its way out (the share of each warp group, the CTA's
P V warps splitting the tokens into 4 / (head_dim / 64) groups, and their 16-bit sums, in
every split of a row and again in the merge of splits). Those
roundings scale with the V range and grow as the softmax sharpens, like every 16-bit
kernel's; over unit-range K and V it meets the project's tolerance against the FP32
reference over the dequantized cache, and tests/gpu/test_xqa.py bounds it at other ranges.
With `hopper_fp8=true` (on an SM 9.x device) it runs XQA's Hopper FP8 kernel instead,
FlashInfer's own choice there: its GMMAs run in FP8, rounding Q and the softmax weights P to
e4m3 too, which is faster and leaves that tolerance (tests/gpu/test_xqa.py bounds its error
by e4m3's).

What XQA refuses is refused here in one line (check_xqa_shape), before anything is built:
16-bit queries only (float16, bfloat16), pages of 16, 32, 64 or 128 tokens, head_dim a
multiple of 16 up to 256, GQA groups up to 32 (the CTA's query-head tile), per-tensor FP8
scales only, and an SM 9.x, 10.x or 12.x device.
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.engines.base import Engine, Plan
from pkv.engines.common import PinnedStaging, check_queries, num_sms, pdl_supported

PAGE_SIZES = (16, 32, 64, 128)       # TOKENS_PER_PAGE that flashinfer/jit/xqa.py builds
HEAD_DIM_STEP, MAX_HEAD_DIM = 16, 256   # head_dim % 16 == 0; > 256 has no SM90 (GMMA, FP8) kernel
MAX_GROUP = 32                       # csrc/xqa: the query heads of one KV head fit one CTA's 32 rows
DTYPES = ("float16", "bfloat16")
SM_MAJORS = (9, 10, 12)              # the architectures XQA is compiled for
SEMAPHORE_BYTES = 8 << 20            # FlashInfer's split of the workspace: semaphores, then scratch
WORKSPACE_BYTES = 128 << 20
LAUNCHES = 2                         # the gather of block-table rows and the XQA kernel


def check_xqa_shape(shape, scales=None) -> None:
    """Raise one ValueError line for a shape (and FP8 scales) XQA does not run."""
    if shape.dtype not in DTYPES:
        raise ValueError(f"flashinfer-xqa takes {' or '.join(DTYPES)} queries, got {shape.dtype}")
    if shape.page_size not in PAGE_SIZES:
        raise ValueError(f"flashinfer-xqa reads pages of {', '.join(map(str, PAGE_SIZES))} tokens, "
                         f"got page_size {shape.page_size}")
    if shape.head_dim % HEAD_DIM_STEP or not HEAD_DIM_STEP <= shape.head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"flashinfer-xqa takes a head_dim that is a multiple of {HEAD_DIM_STEP} up to "
                         f"{MAX_HEAD_DIM}, got {shape.head_dim}")
    if shape.group > MAX_GROUP:
        raise ValueError(f"flashinfer-xqa takes GQA groups 1..{MAX_GROUP}, got {shape.group}")
    if scales is not None and scales.policy != "tensor":
        raise ValueError(f"flashinfer-xqa reads an FP8 cache with tensor scales only, not the "
                         f"{scales.policy!r} policy")


def check_device(device) -> None:
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SM_MAJORS:
        raise ValueError(f"flashinfer-xqa runs on SM {', '.join(f'{m}.x' for m in SM_MAJORS)} devices, "
                         f"this one is SM {major}.{minor}")


def fp8_scales(scales) -> tuple[float, float]:
    """(q_scale, kv_scale) XQA takes for the cache's scales (module docstring)."""
    if scales is None:
        return 1.0, 1.0
    return scales.k_scale / scales.v_scale, scales.v_scale


def xqa_module(shape, sliding: bool = False, q_len: int = 1):
    """FlashInfer's compiled XQA module for `shape` (JIT-built on first use, then cached), with a
    sliding window and q_len query tokens per row (speculative decoding) where asked."""
    try:
        from flashinfer.xqa import get_xqa_module
    except ImportError as e:
        raise ValueError(f"engine 'flashinfer-xqa' needs flashinfer with XQA ({e})") from e
    dt = shape.torch_dtype
    return get_xqa_module(dt, shape.kv_torch_dtype, shape.page_size, shape.head_dim, shape.group, sliding, dt, q_len)


def causal_mask(rows: int, q_len: int, device) -> torch.Tensor:
    """XQA's draft mask for causal drafts: [rows, q_len, 2] uint16, bit j of row i's first word set
    for j <= i (csrc/xqa/mha.cu reads bit k of word k / 16 of a 32-bit-aligned row)."""
    words = np.zeros((rows, q_len, 2), dtype=np.uint16)
    words[:, :, 0] = (1 << (np.arange(q_len) + 1)) - 1
    return torch.from_numpy(words).to(device)


class XqaPlan(Plan):
    """A step's plan: the `rows` the kernel runs (the step, or its padded bucket)."""

    def __init__(self, step: StepState, engine: str, rows: int):
        super().__init__(step, engine, LAUNCHES, None)
        self.rows = rows


class XqaEngine(Engine):
    def __init__(self, cache: PagedCache, max_rows: int | None = None, hopper_fp8: bool = False,
                 validate: bool = True, window_left: int = -1, q_len: int = 1, sinks=None):
        super().__init__(cache, validate)
        s = cache.shape
        check_xqa_shape(s, cache.scales)
        check_queries(q_len, window_left, sinks, s.num_qo_heads, "the XQA adapter")
        # FlashInfer's mapping (trtllm_batch_decode_with_kv_cache): XQA's window counts the query's own token
        self.sliding_win = window_left + 1 if window_left >= 0 else 0
        self.q_len = q_len
        self.sinks = None if sinks is None else sinks.to(cache.device).reshape(s.num_kv_heads, s.group).contiguous()
        check_device(cache.device)
        if hopper_fp8 and not (s.fp8 and torch.cuda.get_device_capability(cache.device)[0] == 9):
            raise ValueError("flashinfer-xqa: hopper_fp8 runs XQA's Hopper FP8 kernel, for an FP8 cache on an "
                             "SM 9.x device")
        self._op = xqa_module(s, self.sliding_win > 0, q_len).xqa
        dev = cache.device
        self.max_rows = int(max_rows or cache.assignment.num_requests)
        if self.max_rows < 1:
            raise ValueError(f"flashinfer-xqa holds at least one row a step, got max_rows={self.max_rows}")
        width = cache.block_table.shape[1]
        self.max_seq_len = width * s.page_size
        self.meta = torch.zeros(2 * self.max_rows, dtype=torch.int32, device=dev)
        self.table = torch.zeros(self.max_rows, width, dtype=torch.int32, device=dev)
        self._staging = PinnedStaging(dev, capacity=2 * self.max_rows)
        self._ones = np.full(self.max_rows, q_len, dtype=np.int32)   # padding rows: q_len tokens of page 0
        self.mask = causal_mask(self.max_rows, q_len, dev) if q_len > 1 else None
        self._zeros = np.zeros(self.max_rows, dtype=np.int32)
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        self._semaphores, self._scratch = workspace[:SEMAPHORE_BYTES], workspace[SEMAPHORE_BYTES:]
        self._sms = num_sms(dev)
        self._pdl = pdl_supported(cache.device)
        # XQA's Hopper FP8 kernel, else its generic one (module docstring); FlashInfer runs the generic one
        # with sinks and speculative rows
        self._fp8_sm90 = bool(hopper_fp8) and not (q_len > 1 and sinks is not None)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._kvs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def prepare(self, step: StepState, rows: int | None = None) -> XqaPlan:
        self.check_step(step)
        rows = self.padded_rows(step, rows)
        pad = rows - step.active
        self._staging.upload([step.seq_lens, self._ones[:pad], step.request_ids, self._zeros[:pad]], out=self.meta)
        _, ids, table = self._rows(rows)
        torch.index_select(self.cache.block_table, 0, ids, out=table)
        return XqaPlan(step, self.name, rows)

    def _rows(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(lengths [rows, 1], request ids [rows], block-table rows [rows, W]) at fixed addresses,
        the views made once per row count."""
        hit = self._views.get(rows)
        if hit is None:
            hit = self._views[rows] = (self.meta[:rows].view(rows, 1), self.meta[rows:2 * rows],
                                       self.table[:rows])
        return hit

    def _kv(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V pages as XQA's NHD views of the HND tensor (strides, no copy), made once
        per KV tensor."""
        hit = self._kvs.get(id(kv))
        if hit is None or hit[0] is not kv:
            hit = self._kvs[id(kv)] = (kv, kv[:, 0].transpose(1, 2), kv[:, 1].transpose(1, 2))
        return hit[1], hit[2]

    def run(self, q: torch.Tensor, plan: XqaPlan, layer: PagedCache | None = None, sinks=None) -> torch.Tensor:
        """One layer's decode; `sinks` (float32 [H_qo]) a layer's own, for an engine built with sinks
        (a model step's layers each have theirs; the engine's when None)."""
        ql = self.q_len
        if q.shape[0] != plan.rows * ql:
            raise ValueError(f"flashinfer-xqa: q has {q.shape[0]} rows, the plan {plan.rows} x q_len {ql}")
        if self.validate and plan.rows == plan.step.active:
            self.check_query(q, plan)
        c = self.layer(layer)
        s = self.cache.shape
        lens, _, table = self._rows(plan.rows)
        q_scale, kv_scale = fp8_scales(c.scales)       # FP8: the layer's scales, read per call
        k, v = self._kv(c.kv)
        if sinks is not None and self.sinks is None:
            raise ValueError("flashinfer-xqa: sinks given to run() of an engine built without sinks")
        layer_sinks = self.sinks if sinks is None else sinks.reshape(s.num_kv_heads, s.group)
        out = torch.empty_like(q)
        # [rows, beam 1, (q_len,) Hq, D], as trtllm_batch_decode_with_kv_cache shapes them
        shaped = (plan.rows, 1, *((ql,) if ql > 1 else ()), s.num_qo_heads, s.head_dim)
        mask = self.mask[:plan.rows] if ql > 1 else None
        self._op(self._fp8_sm90, self._sms, s.num_kv_heads, self.sliding_win, q_scale, out.view(shaped), 1.0,
                 q.view(shaped), layer_sinks, k, v, None, None, table, self.max_seq_len, lens, plan.rows, kv_scale,
                 self._semaphores, self._scratch, self._pdl, ql, None, mask)
        return out


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import check_options, no_policy

    no_policy(name, policy)
    check_options(name, options, info.options)
    return XqaEngine(cache, **options)
