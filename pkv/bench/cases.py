"""The one benchmark case type: a batch of rows (their lengths) of one attention shape,
and the rotated caches a benchmark times it on. `pkv bench kernels` and `pkv bench
splits` both take their cases from here."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    family: str                 # the suite: homogeneous | ragged | shapes | fp8 | splits
    name: str
    lens: tuple[int, ...]
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    kv_dtype: str = "auto"      # auto (= dtype) | fp8 (e4m3)
    fp8_policy: str = ""        # FP8 scale policy (pkv.core.fp8.POLICIES); "" for a 16-bit cache
    point: str = ""             # the lengths' name, shared by a point's 16-bit and FP8 cases
    holes: float = 0.5          # fraction of free pages interleaved with the used ones (paper §3.7)
    window_left: int = -1       # a sliding layer's left window (FlashInfer's window_left); -1 off
    q_len: int = 1              # query tokens per row (speculative decoding: the drafts)
    sinks: bool = False         # attention sinks (one float32 logit per query head, fixed by the seed)

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def shape(self):
        from pkv.core.shape import Shape

        return Shape(self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size, self.dtype, self.kv_dtype)

    @property
    def group(self) -> int:
        return self.shape.group

    @property
    def bytes(self) -> int:
        """Useful KV bytes: every token of every row (of a windowed row, its window's), K and V, all KV
        heads, read once."""
        if self.window_left < 0:
            return sum(self.lens) * self.shape.kv_bytes_per_token
        return sum(min(n, self.q_len + self.window_left) for n in self.lens) * self.shape.kv_bytes_per_token

    @property
    def feature_options(self) -> dict:
        """The engine options of the case's attention (windows, q_len, sinks); {} for plain decode. The
        sinks are a float32 tensor on the CPU (the bench puts it on its device)."""
        import torch

        out = {}
        if self.window_left >= 0:
            out["window_left"] = self.window_left
        if self.q_len > 1:
            out["q_len"] = self.q_len
        if self.sinks:
            gen = torch.Generator().manual_seed(len(self.lens))
            out["sinks"] = torch.randn(self.num_qo_heads, generator=gen) * 2
        return out


def copies_for(case: Case) -> int:
    """Copies rotated per timed call: 2..8, enough for ~1 GB of KV (beyond the 60 MB L2)."""
    return int(min(8, max(2, math.ceil(1.0e9 / case.bytes))))


ALIGN = 256   # bytes between the copies carved from a KvArena
# The kernel benches' default seed of KV bytes, queries and ragged lengths (the reference
# config's seeds.calibration; the Snakefile runs the kernel benches without --seed).
BENCH_SEED = 20260622


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pool_dims(case: Case, num_pages: int) -> tuple[int, ...]:
    """One copy's KV pool: [num_pages, 2, Hkv, page, D] (PagedCache's layout)."""
    return (num_pages, 2, case.num_kv_heads, case.page_size, case.head_dim)


def pools_span(dims: tuple[int, ...], itemsize: int, count: int) -> int:
    """Arena bytes of `count` [dims] pools of `itemsize`-byte elements, each aligned."""
    return count * _aligned(math.prod(dims) * itemsize)


def pool_bytes(case: Case) -> int:
    """Bytes of the KV pools of the case's copies (with its holes: every physical page): the
    16-bit pools, and behind them an FP8 case's e4m3 pools."""
    from pkv.core.paging import assign_pages

    pages = assign_pages(np.asarray(case.lens, dtype=np.int64), case.page_size, case.holes, 0).num_pages
    dims, copies = pool_dims(case, pages), copies_for(case)
    return pools_span(dims, case.shape.itemsize, copies) + (pools_span(dims, 1, copies) if case.shape.fp8 else 0)


class KvArena:
    """One device buffer that every case's KV copies are carved from, allocated once per
    process as a serving engine allocates its KV pool. Allocating and freeing each case's
    multi-GB pools (and their FP32 staging) made pkv-graph's later rows of a sweep
    slower than the same cases in a fresh process, FlashInfer's not
    (docs/perf-notes.md); with the arena nothing is allocated per case but
    the queries and block tables (an FP8 case's e4m3 pools are carved behind its 16-bit ones,
    and quantized into in blocks of pages: pkv.core.fp8.quantize)."""

    def __init__(self, nbytes: int, device="cuda"):
        import torch

        self.buf = torch.empty(max(int(nbytes), ALIGN), dtype=torch.uint8, device=device)

    @classmethod
    def for_cases(cls, cases, device="cuda") -> "KvArena":
        return cls(max(pool_bytes(c) for c in cases), device)

    def pools(self, dims: tuple[int, ...], dtype, count: int, start: int = 0) -> list:
        """`count` disjoint [dims] tensors of `dtype` from byte `start` of the buffer (the last
        case's are overwritten); the next free byte is start + pools_span(dims, dtype.itemsize, count)."""
        one, step = math.prod(dims) * dtype.itemsize, pools_span(dims, dtype.itemsize, 1)
        if start + count * step > self.buf.numel():
            raise ValueError(f"the KV arena holds {self.buf.numel()} bytes, this case needs {start + count * step} "
                             "(size it with KvArena.for_cases over every case the run times)")
        return [self.buf[start + i * step:start + i * step + one].view(dtype).view(dims) for i in range(count)]


def build_caches(case: Case, seed: int, device: str = "cuda", arena: KvArena | None = None,
                 copies: int | None = None):
    """Independent copies of the case's cache (own K,V bytes and page permutation) and a
    query batch for each: rotated per call so the working set is far beyond the L2 (`copies`:
    copies_for(case) unless given). With an arena, the copies' pools are its memory (filled in
    place; an FP8 case's e4m3 pools too)."""
    import torch

    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages

    shape = case.shape
    copies = copies_for(case) if copies is None else copies
    lens = np.asarray(case.lens, dtype=np.int64)
    assignments = [assign_pages(lens, case.page_size, case.holes, seed + c) for c in range(copies)]
    pools = pools8 = [None] * copies
    if arena is not None:
        dims = pool_dims(case, assignments[0].num_pages)
        pools = arena.pools(dims, shape.torch_dtype, copies)
        if shape.fp8:
            behind = pools_span(dims, shape.itemsize, copies)   # the 16-bit pools' bytes
            pools8 = arena.pools(dims, torch.float8_e4m3fn, copies, start=behind)
    caches = [PagedCache.random(shape, a, device=device, seed=seed + c, fp8_policy=case.fp8_policy or "tensor",
                                out=pool, out8=pool8)
              for c, (a, pool, pool8) in enumerate(zip(assignments, pools, pools8))]
    queries = [c.query(len(lens) * case.q_len, seed + 100 + i) for i, c in enumerate(caches)]
    return caches, queries
