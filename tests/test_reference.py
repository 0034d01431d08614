"""The task-list engine (the kernels' oracle) against plain FP32 attention."""

import math

import numpy as np
import pytest
import torch

from pkv.core.cache import PagedCache
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.kernels.reference import attention_reference, merge_states, partial_state, run_schedule, tensor_lens
from pkv.plan.schedule import SplitPolicy, bucket_schedule, masked_schedule, workqueue_schedule

SCHEDULES = {
    "bucket": lambda lens, h, p: bucket_schedule(lens, h, p),
    "masked": lambda lens, h, p: masked_schedule(lens, h, p),
    "masked-padded": lambda lens, h, p: masked_schedule(lens, h, p, row_local=False),
    "workqueue": lambda lens, h, p: workqueue_schedule(lens, h, p),
}


def rel_err(out, ref):
    return ((out - ref).norm() / ref.norm()).item()


def run_case(lens, group, head_dim, page_size, num_kv_heads=2, holes=0.5, splits=6, dtype="float32", seed=0):
    lens = np.asarray(lens)
    shape = Shape(group * num_kv_heads, num_kv_heads, head_dim, page_size, dtype)
    cache = PagedCache.random(shape, assign_pages(lens, page_size, holes, seed), seed=seed)
    q = cache.query(len(lens), seed + 1)
    table, seq = cache.block_table, tensor_lens(lens)
    ref = attention_reference(q, cache.kv, table, seq)
    assert torch.isfinite(ref).all()
    policy = SplitPolicy(splits, 1)
    for name, build in SCHEDULES.items():
        out = run_schedule(q, cache.kv, table, seq, build(lens, num_kv_heads, policy))
        assert torch.isfinite(out).all(), name  # every output written (outputs start as NaN)
        assert rel_err(out, ref) < 1e-5, name


@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 32])
def test_edge_lengths(group, head_dim, page_size):
    p = page_size
    lens = sorted({1, max(1, p - 1), p, p + 1, 33, 95})
    run_case(lens, group, head_dim, page_size, seed=group * 1000 + head_dim + p)


@pytest.mark.parametrize("seed", range(4))
def test_ragged_batches(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, 3000, size=int(rng.integers(2, 18)))
    run_case(lens, group=4, head_dim=64, page_size=16, splits=int(rng.integers(1, 24)), seed=seed)


def test_64k_context_fp16():
    run_case([65536, 31], group=4, head_dim=128, page_size=16, num_kv_heads=1, splits=16, dtype="float16")


def test_neutral_state_and_merge_are_exact():
    q = torch.randn(4, 16)
    k, v = torch.randn(50, 16), torch.randn(50, 16)
    whole = partial_state(q, k, v)
    parts = [partial_state(q, k[a:b], v[a:b]) for a, b in ((0, 0), (0, 13), (13, 13), (13, 50))]
    m, l, acc = (torch.stack(x) for x in zip(*parts))
    assert torch.isinf(m[0]).all() and (l[0] == 0).all() and (acc[0] == 0).all()
    expect = torch.softmax(q @ k.T / math.sqrt(16), dim=1) @ v
    torch.testing.assert_close(merge_states(m, l, acc), expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(whole[2] / whole[1][:, None], expect, rtol=1e-5, atol=1e-6)


def test_masked_reads_do_not_leak():
    """Without row-local bounds a short row's splits read pages past its length; masking drops them."""
    lens = np.array([2000, 40])
    shape = Shape(4, 1, 64, 16, "float32")
    cache = PagedCache.random(shape, assign_pages(lens, 16, 0.0, 1), seed=1)
    q = cache.query(2, 2)
    seq = tensor_lens(lens)
    s = masked_schedule(lens, 1, SplitPolicy(8, 1), row_local=False)
    out = run_schedule(q, cache.kv, cache.block_table, seq, s)
    ref = attention_reference(q, cache.kv, cache.block_table, seq)
    assert rel_err(out[1], ref[1]) < 1e-5
