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
        """Useful KV bytes: every token of every row, K and V, all KV heads, read once."""
        return sum(self.lens) * self.shape.kv_bytes_per_token


def copies_for(case: Case) -> int:
    """Copies rotated per timed call: 2..8, enough for ~1 GB of KV (beyond the 60 MB L2)."""
    return int(min(8, max(2, math.ceil(1.0e9 / case.bytes))))


def build_caches(case: Case, seed: int, device: str = "cuda"):
    """Independent copies of the case's cache (own K,V bytes and page permutation) and a
    query batch for each: rotated per call so the working set is far beyond the L2."""
    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages

    shape = case.shape
    copies = copies_for(case)
    lens = np.asarray(case.lens, dtype=np.int64)
    caches = [PagedCache.random(shape, assign_pages(lens, case.page_size, case.holes, seed + c), device=device, seed=seed + c,
                                fp8_policy=case.fp8_policy or "tensor")
              for c in range(copies)]
    queries = [c.query(len(lens), seed + 100 + i) for i, c in enumerate(caches)]
    return caches, queries
