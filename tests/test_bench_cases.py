"""pkv.bench.cases on the CPU: the rotated copies a kernel benchmark times, and the KV arena
their pools are carved from (one allocation per process, not one per case)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pkv.bench.cases import Case, KvArena, build_caches, copies_for, pool_bytes
from pkv.kernels.reference import attention_reference

SMALL = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64)
CASES = [Case("ragged", "mix", (100, 3000, 17), **SMALL), Case("homogeneous", "B1 5000", (5000,), **SMALL),
         Case("fp8", "mix fp8", (100, 3000), kv_dtype="fp8", fp8_policy="tensor", **SMALL)]


def test_copies_are_disjoint_views_of_one_arena_reused_by_every_case():
    arena = KvArena.for_cases(CASES, "cpu")
    assert arena.buf.numel() == max(pool_bytes(c) for c in CASES)
    start, end = arena.buf.data_ptr(), arena.buf.data_ptr() + arena.buf.numel()
    for case in CASES[:2]:
        caches, queries = build_caches(case, 7, device="cpu", arena=arena)
        assert len(caches) == len(queries) == copies_for(case)
        spans = sorted((c.kv.data_ptr(), c.kv.data_ptr() + c.kv.numel() * c.kv.element_size()) for c in caches)
        assert spans[0][0] == start and spans[-1][1] <= end                # the case's pools are the arena's
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))         # and do not overlap
        assert all(c.kv.dtype == torch.float16 for c in caches)
        kv = torch.cat([c.kv.flatten().float() for c in caches])
        assert abs(float(kv.mean())) < 0.01 and abs(float(kv.std()) - 1.0) < 0.01   # standard normal, filled in place
        assert not torch.equal(caches[0].kv, caches[1].kv)                 # each copy its own values
        assert not np.array_equal(caches[0].block_table_host, caches[1].block_table_host)


def test_fp8_cases_quantize_their_pool_and_read_back_close():
    arena = KvArena.for_cases(CASES, "cpu")
    caches, queries = build_caches(CASES[2], 3, device="cpu", arena=arena)
    assert caches[0].shape.fp8 and caches[0].kv.dtype == torch.float8_e4m3fn
    # The e4m3 pools are the arena's too, behind the 16-bit ones they were quantized from.
    start, end = arena.buf.data_ptr(), arena.buf.data_ptr() + arena.buf.numel()
    spans = sorted((x.kv.data_ptr(), x.kv.data_ptr() + x.kv.numel()) for x in caches)
    assert start < spans[0][0] and spans[-1][1] <= end and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    c, lens = caches[0], torch.tensor(CASES[2].lens, dtype=torch.int32)
    out = attention_reference(queries[0], c.values(), c.block_table[:2], lens)
    assert out.shape == (2, 8, 64) and torch.isfinite(out).all()


def test_a_case_beyond_the_arena_is_refused_with_its_size():
    arena = KvArena.for_cases(CASES[:1], "cpu")
    with pytest.raises(ValueError, match="KV arena holds"):
        build_caches(CASES[1], 7, device="cpu", arena=arena)


def test_without_an_arena_the_copies_are_as_before():
    caches, _ = build_caches(CASES[0], 7, device="cpu")
    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages

    again = PagedCache.random(CASES[0].shape, assign_pages(np.asarray(CASES[0].lens), 16, 0.5, 7), seed=7)
    assert torch.equal(caches[0].kv, again.kv)


def test_a_pool_of_the_wrong_shape_is_refused():
    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages

    a = assign_pages(np.asarray([100]), 16, 0.0, 0)
    with pytest.raises(ValueError, match="out must be"):
        PagedCache.random(CASES[0].shape, a, out=torch.empty(3, 2, 2, 16, 64, dtype=torch.float16))
