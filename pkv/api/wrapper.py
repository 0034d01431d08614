"""`DecodeWrapper`: what a serving engine keeps per batch bucket (one per padded batch size).

Sized once: the workspace (partial states, merge counters, row ids) and one int32
metadata buffer [seq_lens | block_table] at fixed addresses. Each step, `update()` writes
the step's lengths and block table into that buffer once (one host-to-device copy, or
device-to-device copies for tensors already on the GPU); every layer then calls
`run(q, kv_layer)` with its own KV tensor, and every layer reads the same metadata. Nothing
in `run()` allocates (with `out=`), syncs or plans on the host, so a whole model step of
`run()` calls is captured in one CUDA graph and replayed after each `update()`.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from pkv.api.decode import _check_reading, run_op
from pkv.api.layouts import LAYOUTS, kv_view
from pkv.api.op import QUERY_DTYPES, make_workspace
from pkv.core.shape import Shape
from pkv.engines.common import PinnedStaging
from pkv.engines.graph import check_graph_shape


@functools.cache   # update() is a hot path: one dict lookup, not a dtype parsed from a string
def _unsigned(dtype: np.dtype) -> np.dtype:
    """The unsigned integer of the same size and byte order (a view of it reads a negative as huge)."""
    return np.dtype(dtype.str.replace("i", "u"))


INT32_MAX = 2**31 - 1


class DecodeWrapper:
    """Decode for steps of up to `max_batch` rows, each with up to `max_pages` pages."""

    def __init__(self, max_batch: int, max_pages: int, *, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                 page_size: int, layout: str = "HND", dtype: torch.dtype = torch.float16, kv_fp8: bool = False,
                 device: torch.device | str = "cuda", q_len: int = 1, pdl: bool = True):
        if dtype not in QUERY_DTYPES:
            raise ValueError(f"pkv decode: queries are float16 or bfloat16, got {dtype}")
        if not (isinstance(max_pages, int) and max_pages >= 1):
            raise ValueError(f"pkv decode: max_pages must be a positive integer, got {max_pages!r}")
        self.shape = Shape(num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           page_size=page_size, dtype=QUERY_DTYPES[dtype], kv_dtype="fp8" if kv_fp8 else "auto")
        check_graph_shape(self.shape)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        self.layout, self.max_batch, self.max_pages = layout, max_batch, max_pages
        self.device = torch.device(device)
        self.q_len = q_len   # query tokens per row: every run() takes q [b * q_len, H_qo, D]
        self.workspace = make_workspace(max_batch, num_qo_heads, num_kv_heads, head_dim, self.device, q_len)
        self.meta = torch.zeros(max_batch * (1 + max_pages), dtype=torch.int32, device=self.device)
        self.seq_lens = self.meta[:max_batch]
        self.block_table = self.meta[max_batch:].view(max_batch, max_pages)
        self._staging = PinnedStaging(self.device, capacity=self.meta.numel())
        self._updated = False   # run() before the first update() would read no step at all
        # run() launches as a programmatic dependent (pdl, SM 9.0+): it reads this wrapper's metadata
        # and the layer's older tokens while the kernel before it drains. After an update() from
        # device tensors (copied by kernels) the next run() launches plainly, since the kernel
        # before it may be that copy.
        self.pdl = bool(pdl)
        self._meta_by_kernel = False

    def update(self, block_table, seq_lens) -> None:
        """The step's metadata for every layer: block_table [b, w] (w <= max_pages) and seq_lens [b]
        (b <= max_batch; rows b.. become padding). Host arrays and CPU tensors are checked (integers,
        lengths in 0..w * page_size, page ids that fit int32) and uploaded in one copy. int32 tensors
        already on the wrapper's CUDA device are copied there as they are, without a check (a check
        would sync): their lengths must be <= w * page_size."""
        on_device = all(isinstance(t, torch.Tensor) and t.device == self.device for t in (block_table, seq_lens)) \
            and self.device.type == "cuda"
        if on_device:
            if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
                raise ValueError(f"pkv decode: block_table and seq_lens on {self.device} must be int32 tensors, got "
                                 f"{block_table.dtype} and {seq_lens.dtype} (a wider value would be cut to 32 bits)")
        else:
            block_table = np.asarray(block_table.cpu() if isinstance(block_table, torch.Tensor) else block_table)
            seq_lens = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
        b = seq_lens.shape[0] if seq_lens.ndim == 1 else -1
        if not 0 <= b <= self.max_batch or block_table.ndim != 2 or block_table.shape[0] != b \
                or block_table.shape[1] > self.max_pages:
            raise ValueError(f"pkv decode: a step of this wrapper is seq_lens [b <= {self.max_batch}] and block_table "
                             f"[b, <= {self.max_pages}], got {list(seq_lens.shape)} and {list(block_table.shape)}")
        w = block_table.shape[1]
        if on_device:
            self.seq_lens[:b].copy_(seq_lens)
            self.seq_lens[b:].zero_()
            self.block_table[:b, :w].copy_(block_table)
            self._updated, self._meta_by_kernel = True, True
            return
        if seq_lens.dtype.kind not in "iu" or block_table.dtype.kind not in "iu":
            raise ValueError(f"pkv decode: block_table and seq_lens must be integers, got {block_table.dtype} and "
                             f"{seq_lens.dtype}")
        # One reduction for both bounds: read as unsigned, a negative length is above any bound.
        if b and int(seq_lens.view(_unsigned(seq_lens.dtype)).max()) > w * self.shape.page_size:
            raise ValueError(f"pkv decode: seq_lens must be in 0..{w * self.shape.page_size} "
                             f"(block_table width x page size), got {seq_lens.min()}..{seq_lens.max()}")
        if self.q_len > 1 and b and ((seq_lens > 0) & (seq_lens < self.q_len)).any():
            raise ValueError(f"pkv decode: a row of q_len {self.q_len} holds its query tokens in the cache: "
                             f"seq_lens must be 0 or >= {self.q_len}, got {seq_lens[seq_lens > 0].min()}")
        # Page ids wider than int32 (int64, uint32) would be cut to 32 bits: one unsigned reduction
        # refuses a negative id or one past int32's range. int32 ids (the common case) need none.
        if b and w and block_table.dtype.itemsize * 8 - (block_table.dtype.kind == "i") > 31 \
                and int(block_table.view(_unsigned(block_table.dtype)).max()) > INT32_MAX:
            raise ValueError(f"pkv decode: block_table page ids must be in 0..{INT32_MAX}, got "
                             f"{block_table.min()}..{block_table.max()}")
        # Written in place into the pinned buffer, then one copy of its first b table rows: the
        # kernel reads row r's first ceil(len_r / page) <= w ids and nothing of rows >= b (length
        # 0), so what an earlier step left past column w or row b is never read. (Copying the whole
        # max_batch x max_pages table each step was most of update(): 4096 pages, 128 KB at B8.)
        mb, mp = self.max_batch, self.max_pages
        buf = self._staging.fill(self.meta.numel())
        buf[:b] = seq_lens
        buf[b:mb] = 0
        buf[mb:mb + b * mp].reshape(b, mp)[:, :w] = block_table
        self._staging.send(mb + b * mp, out=self.meta)
        self._updated, self._meta_by_kernel = True, False

    def run(self, q: torch.Tensor, kv_layer, *, out: torch.Tensor | None = None, return_lse: bool = False,
            sm_scale: float | None = None, logits_soft_cap: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None):
        """One layer's decode over its own KV (a tensor or (K, V) pair in the wrapper's layout), with the
        metadata of the last update(); q has up to max_batch rows of the wrapper's q_len tokens. Same options
        and result as pkv.api.decode (window_left and sinks per layer)."""
        if not self._updated:
            raise ValueError("pkv decode: run() before any update(): give the step's block_table and seq_lens first")
        view = kv_view(kv_layer, self.layout)
        _check_reading(view, self.layout, self.shape.num_kv_heads, self.shape.page_size)
        ql = self.q_len
        rows_q = q.shape[0] if isinstance(q, torch.Tensor) and q.dim() == 3 else -1
        rows = rows_q // ql
        s = self.shape
        if rows_q % ql or not 1 <= rows <= self.max_batch or tuple(q.shape[1:]) != (s.num_qo_heads, s.head_dim):
            each = "" if ql == 1 else f" x q_len {ql}"
            raise ValueError(f"pkv decode: this wrapper takes q [1..{self.max_batch}{each}, {s.num_qo_heads}, "
                             f"{s.head_dim}], got {list(getattr(q, 'shape', []))}")
        if q.dtype != s.torch_dtype:
            raise ValueError(f"pkv decode: this wrapper was made for {s.torch_dtype} queries, got {q.dtype}")
        if (view.k.dtype == torch.float8_e4m3fn) != s.fp8:   # the workspace and kernel are chosen for one KV dtype
            made = "an FP8 (e4m3) KV cache (kv_fp8=True)" if s.fp8 else f"a {s.torch_dtype} KV cache"
            raise ValueError(f"pkv decode: this wrapper was made for {made}, the layer's KV cache is {view.k.dtype}")
        pdl, self._meta_by_kernel = self.pdl and not self._meta_by_kernel, False
        return run_op(q, view, self.block_table[:rows], self.seq_lens[:rows], self.workspace, sm_scale=sm_scale,
                      logits_soft_cap=logits_soft_cap, out=out, return_lse=return_lse, k_scale=k_scale,
                      v_scale=v_scale, window_left=window_left, q_len=ql, sinks=sinks, pdl=pdl)
