"""Physical page assignment (paper §3.7) and the two views every engine reads.

Each request reserves its total length rounded up to `granularity` tokens (the page
size, or a bucket length), i.e. L_i pages. With hole fraction rho the physical universe
has ceil(L / (1 - rho)) page ids; a seeded permutation of it hands each request a
consecutive slice, so logical order holds inside a block table while physical ids
scatter. PersistentKV reads a block table + seq_lens; FlashInfer reads indptr, indices
and last_page_len. Both come from the same assignment.

Page ids, block tables and FlashInfer's indptr/indices are int32: an assignment whose
page universe would not fit int32 is refused (ValueError), never wrapped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT32_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class PageAssignment:
    page_size: int
    num_pages: int              # size of the physical universe, holes included
    page_offsets: np.ndarray    # int64 [R + 1]: request i owns pages[page_offsets[i]:page_offsets[i+1]]
    pages: np.ndarray           # int32 physical page ids, request after request, in logical order
    reserved_len: np.ndarray    # int64 [R]: tokens reserved per request

    @property
    def num_requests(self) -> int:
        return len(self.reserved_len)

    def request_pages(self, request: int) -> np.ndarray:
        return self.pages[self.page_offsets[request]:self.page_offsets[request + 1]]

    def block_table(self) -> np.ndarray:
        """int32 [R, max pages]: row i lists request i's pages, then repeats them cyclically.

        The padding is only read by the row-local-bounds ablation, which deliberately
        reads (and masks) past a row's length; cycling keeps those reads on real pages.
        """
        counts = np.diff(self.page_offsets)
        width = int(counts.max())
        col = np.arange(width)[None, :] % counts[:, None]
        return self.pages[self.page_offsets[:-1, None] + col].astype(np.int32)


def assign_pages(total_lens: np.ndarray, page_size: int, holes: float, seed: int,
                 granularity: int | None = None) -> PageAssignment:
    total_lens = np.asarray(total_lens, dtype=np.int64)
    if total_lens.ndim != 1 or len(total_lens) == 0 or total_lens.min() < 1:
        raise ValueError("total_lens must be a non-empty 1-D array of positive lengths")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if not 0.0 <= holes < 1.0:
        raise ValueError(f"hole fraction must be in [0, 1), got {holes}")
    granularity = granularity or page_size
    if granularity % page_size:
        raise ValueError(f"granularity {granularity} must be a multiple of page_size {page_size}")
    reserved = -(-total_lens // granularity) * granularity
    counts = reserved // page_size
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    logical = int(offsets[-1])
    universe = int(np.ceil(logical / (1.0 - holes)))
    if universe > INT32_MAX:
        raise ValueError(f"the trace needs {universe} physical pages ({logical} reserved, holes {holes}), above the "
                         f"int32 page-id limit {INT32_MAX}")
    perm = np.random.default_rng(seed).permutation(universe)
    return PageAssignment(page_size, universe, offsets, perm[:logical].astype(np.int32), reserved)


@dataclass(frozen=True)
class FlashInferView:
    indptr: np.ndarray          # int32 [B + 1]
    indices: np.ndarray         # int32 [sum of used pages]
    last_page_len: np.ndarray   # int32 [B]


def flashinfer_view(assignment: PageAssignment, requests: np.ndarray, seq_lens: np.ndarray) -> FlashInferView:
    """Ragged page lists of the first seq_lens[i] tokens of each request."""
    p = assignment.page_size
    used = -(-np.asarray(seq_lens, dtype=np.int64) // p)
    starts = assignment.page_offsets[requests]
    if np.any(used > assignment.page_offsets[requests + 1] - starts):
        raise ValueError("a seq_len exceeds the pages its request reserved")
    indptr = np.zeros(len(used) + 1, dtype=np.int64)
    np.cumsum(used, out=indptr[1:])
    flat = np.arange(indptr[-1]) - np.repeat(indptr[:-1], used) + np.repeat(starts, used)
    last = np.asarray(seq_lens, dtype=np.int64) - (used - 1) * p
    return FlashInferView(indptr.astype(np.int32), assignment.pages[flat].astype(np.int32), last.astype(np.int32))


def compact(assignment: PageAssignment, steps) -> PageAssignment:
    """`assignment` over only the pages the steps read (each request's first ceil(len / page)
    pages at its longest measured length), renumbered 0..n-1 in their physical order, so the
    scatter of the pages is kept and a cache holds no page no step reads. A page no step
    reads maps to page 0 (it is never read)."""
    ps = assignment.page_size
    need = np.zeros(assignment.num_requests, dtype=np.int64)
    for st in steps:
        np.maximum.at(need, st.request_ids, -(-np.asarray(st.seq_lens, dtype=np.int64) // ps))
    used = np.unique(np.concatenate([assignment.request_pages(r)[:n] for r, n in enumerate(need) if n]
                                    or [np.zeros(1, np.int32)]))
    remap = np.zeros(assignment.num_pages, dtype=np.int32)
    remap[used] = np.arange(len(used), dtype=np.int32)
    return PageAssignment(ps, len(used), assignment.page_offsets, remap[assignment.pages], assignment.reserved_len)
