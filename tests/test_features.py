"""Sliding windows, attention sinks and several query tokens per row on the CPU: the FP32
reference against a plain per-token loop, the device rule's oracle (pkv.plan.device_schedule +
run_schedule) and the public API against the reference on the feature grid (api_cases), the
rule's pieces covering a windowed row's window only, the cost model counting what the rule
cuts, and the refusals. The GPU twin is tests/gpu/test_features_gpu.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from api_cases import feature_cases, make_case
from pkv.api import DecodeWrapper, decode
from pkv.core.cache import PagedCache
from pkv.core.fp8 import quantize
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference, run_schedule
from pkv.plan.costmodel import graph_cost, graph_counts
from pkv.plan.device_schedule import TILE_TOKENS, Queries, graph_pieces, graph_schedule

CASES = feature_cases()
IDS = [c[0] for c in CASES]
TOL = 2e-3


def naive(q, kv, table, lens, q_len, window, sinks, cap):
    """One query token and head at a time, straight from the definitions."""
    out = torch.zeros(q.shape)
    lse = torch.zeros(q.shape[:2])
    hq, hkv, p = q.shape[1], kv.shape[2], kv.shape[3]
    for r, n in enumerate(lens):
        for i in range(q_len if n else 0):
            pos = n - q_len + i
            keys = [t for t in range(n) if t <= pos and (window < 0 or t >= pos - window)]
            for h in range(hq):
                g = h // (hq // hkv)
                k = torch.stack([kv[table[r, t // p], 0, g, t % p].float() for t in keys])
                v = torch.stack([kv[table[r, t // p], 1, g, t % p].float() for t in keys])
                s = k @ q[r * q_len + i, h].float() / math.sqrt(q.shape[2])
                if cap:
                    s = cap * torch.tanh(s / cap)
                if sinks is not None:
                    s = torch.cat([s, sinks[h:h + 1]])
                    v = torch.cat([v, torch.zeros_like(v[:1])])
                w = torch.softmax(s, 0)
                out[r * q_len + i, h] = w @ v
                lse[r * q_len + i, h] = torch.logsumexp(s, 0)
    return out, lse


def case(c, seed=0):
    name, lens, hq, hkv, d, p, q_len, window, with_sinks, cap = c
    kv, table, seq_lens, q = make_case(lens, hq, hkv, d, p, torch.float16, seed, q_len=q_len)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2 if with_sinks else None
    return kv, table, seq_lens, q, sinks


def real_rows(lens, q_len):
    return torch.as_tensor(np.repeat(np.asarray(lens) > 0, q_len))


def test_reference_is_the_definition():
    lens, q_len, window, cap = [9, 3, 0, 40], 3, 5, 10.0
    kv, table, seq_lens, q = make_case(lens, 4, 2, 64, 4, torch.float32, 1, q_len=q_len)
    sinks = torch.tensor([0.5, -1.0, 3.0, 0.0])
    out, lse = attention_reference(q, kv, table, seq_lens, None, cap, True, q_len=q_len, window_left=window,
                                   sinks=sinks)
    want, want_lse = naive(q, kv, table, lens, q_len, window, sinks, cap)
    rows = real_rows(lens, q_len)
    assert torch.allclose(out[rows], want[rows], atol=1e-5)
    assert torch.allclose(lse[rows], want_lse[rows], atol=1e-5)


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_the_oracle_is_the_reference(c):
    """The device rule's pieces (windows, query blocks, cut and merged with sinks) = the reference."""
    kv, table, seq_lens, q, sinks = case(c)
    _, lens, hq, hkv, d, _, q_len, window, _, cap = c
    ref, ref_lse = attention_reference(q, kv, table, seq_lens, None, cap, True, q_len=q_len, window_left=window,
                                       sinks=sinks)
    queries = Queries.of(hq // hkv, d, q_len, window)
    for num_ctas, piece_cost in ((7, 0), (64, 8)):
        lse = torch.empty_like(ref_lse)
        out = run_schedule(q, kv, table, seq_lens, graph_schedule(lens, hkv, num_ctas, 1, piece_cost, queries),
                           None, cap, lse, queries=queries, sinks=sinks)
        rows = real_rows(lens, q_len)
        assert (out[rows] - ref[rows]).abs().max() < 1e-5
        assert (lse[rows] - ref_lse[rows]).abs().max() < 1e-5


@pytest.mark.parametrize("window", [-1, 0, 5, 31, 32, 33, 100, 4000])
@pytest.mark.parametrize("q_len", [1, 2, 8])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (16, 64), (3, 256)])
def test_pieces_cover_the_window(window, q_len, group, head_dim):
    """Each (row, KV head, query block) is read over the tiles covering
    [max(0, L - q_len - W), L), in pieces that tile it exactly; the blocks hold pass_rows rows."""
    lens = np.array([q_len, 17 + q_len, 0, 99, 1000, 3001])
    queries = Queries.of(group, head_dim, q_len, window)
    assert group * queries.block <= (8 if head_dim == 256 else 16) or queries.block == 1
    h = 2
    pieces = graph_pieces(lens, h, 13, 1, 8, queries)
    for r, n in enumerate(lens):
        first = 0 if window < 0 else max(0, int(n) - q_len - window) // TILE_TOKENS * TILE_TOKENS
        for kvh in range(h):
            for b in range(queries.blocks):
                mine = sorted((p.t_begin, p.t_end) for p in pieces if (p.row, p.kv_head, p.q_block) == (r, kvh, b))
                if n == 0:
                    assert not mine
                    continue
                assert mine[0][0] == first and mine[-1][1] == n
                assert all(a[1] == b_[0] for a, b_ in zip(mine, mine[1:]))


@pytest.mark.parametrize("window,q_len", [(-1, 1), (128, 1), (33, 4), (-1, 8), (1000, 2)])
def test_the_cost_model_counts_the_rule(window, q_len):
    rng = np.random.default_rng(window + 7 * q_len)
    lens = np.concatenate([rng.integers(q_len, 9000, size=30), [0, q_len]])
    queries = Queries.of(8, 128, q_len, window)
    for num_ctas, piece_cost in ((264, 8), (64, 0)):
        pieces = graph_pieces(lens, 8, num_ctas, 2, piece_cost, queries)
        want = len({p.cta for p in pieces}), sum(p.slot != -1 for p in pieces)
        assert graph_counts(lens, 8, num_ctas, 2, piece_cost, queries) == want
    shape = Shape(64, 8, 128, 16, "float16")
    cost = graph_cost(shape, lens, 264, 2, 8, queries)
    read = sum(p.t_end - p.t_begin for p in graph_pieces(lens, 8, 264, 2, 8, queries)) // 8   # tokens per KV head
    # the window's tokens, once per query block; the pieces read from its first tile's start
    assert 0 <= read - cost.kv_bytes / shape.kv_bytes_per_token < len(lens) * TILE_TOKENS * queries.blocks
    if window >= 0:   # a window costs what it reads, not the whole row
        assert cost.kv_bytes < graph_cost(shape, lens, 264, 2, 8, Queries.of(8, 128, q_len)).kv_bytes


@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_the_api_on_the_cpu(c):
    kv, table, seq_lens, q, sinks = case(c, seed=3)
    _, lens, hq, hkv, d, p, q_len, window, _, cap = c
    ref, ref_lse = attention_reference(q, kv, table, seq_lens, None, cap, True, q_len=q_len, window_left=window,
                                       sinks=sinks)
    out, lse = decode(q, kv.transpose(2, 3).contiguous(), table, seq_lens, layout="NHD", logits_soft_cap=cap or None,
                      out=torch.full_like(q, math.nan), return_lse=True, window_left=window, q_len=q_len, sinks=sinks)
    rows = real_rows(lens, q_len)
    assert (out[rows].float() - ref[rows]).abs().max() < TOL
    assert (lse[rows] - ref_lse[rows]).abs().max() < 1e-4
    assert torch.isnan(out[~rows]).all(), "a padding row was written"


def test_the_api_fp8_and_the_wrapper():
    lens, q_len, window = [4, 50, 0, 700], 4, 40
    kv, table, seq_lens, q = make_case(lens, 16, 2, 128, 16, torch.float16, 5, q_len=q_len)
    sinks = torch.linspace(-2, 2, 16)
    kv8, scales = quantize(kv, "tensor")
    ref = attention_reference(q, kv8.float() * torch.tensor([scales.k_scale, scales.v_scale]).view(1, 2, 1, 1, 1),
                              table, seq_lens, q_len=q_len, window_left=window, sinks=sinks)
    out = decode(q, kv8, table, seq_lens, k_scale=scales.k_scale, v_scale=scales.v_scale, window_left=window,
                 q_len=q_len, sinks=sinks)
    rows = real_rows(lens, q_len)
    assert (out[rows].float() - ref[rows]).abs().max() < TOL
    w = DecodeWrapper(8, table.shape[1], num_qo_heads=16, num_kv_heads=2, head_dim=128, page_size=16, device="cpu",
                      q_len=q_len)
    w.update(table, seq_lens)
    out2 = w.run(q, kv, window_left=window, sinks=sinks)
    ref16 = attention_reference(q, kv, table, seq_lens, q_len=q_len, window_left=window, sinks=sinks)
    assert (out2[rows].float() - ref16[rows]).abs().max() < TOL


@pytest.mark.parametrize("fp8", [False, True])
def test_the_engine_on_the_cpu(fp8):
    lens, q_len, window = np.array([3, 70, 1200, 5]), 3, 64
    shape = Shape(16, 2, 64, 16, "float16")
    cache = PagedCache.random(shape, assign_pages(lens, 16, 0.3, 0), device="cpu", seed=2)
    if fp8:
        cache = cache.quantized("tensor")
    sinks = torch.randn(16)
    engine = make_engine("pkv-graph", cache, window_left=window, q_len=q_len, sinks=sinks)
    step = StepState(0, np.arange(len(lens)), lens.astype(np.int32))
    q = torch.randn(len(lens) * q_len, 16, 64).half()
    out = engine.run(q, engine.prepare(step))
    ref = attention_reference(q, cache.values(), cache.block_table, torch.as_tensor(lens), q_len=q_len,
                              window_left=window, sinks=sinks)
    assert (out.float() - ref).abs().max() < TOL


REFUSALS = [
    (dict(q_len=0), "q_len is 1..8"),
    (dict(q_len=9), "q_len is 1..8"),
    (dict(window_left=-2), "window_left is an int >= 0"),
    (dict(window_left=True), "window_left is an int >= 0"),
    (dict(sinks=torch.zeros(4)), r"sinks must be a float32 tensor \[num_qo_heads=8\]"),
    (dict(sinks=torch.zeros(8, dtype=torch.float16)), "sinks must be a float32 tensor"),
    (dict(sinks=[0.0] * 8), "sinks must be a float32 tensor"),
]


@pytest.mark.parametrize("kwargs,match", REFUSALS, ids=[m for _, m in REFUSALS])
def test_refusals_in_one_line(kwargs, match):
    kv, table, seq_lens, q = make_case([5, 40], 8, 2, 64)
    with pytest.raises(ValueError, match=match) as e:
        decode(q, kv, table, seq_lens, **kwargs)
    assert "\n" not in str(e.value)


def test_refusals_of_rows_and_engines():
    kv, table, seq_lens, q = make_case([5, 40], 8, 2, 64, q_len=2)
    with pytest.raises(ValueError, match="not a multiple of it"):
        decode(q[:3], kv, table, seq_lens, q_len=2)
    with pytest.raises(ValueError, match="seq_lens must be 0 or >= 4"):
        decode(torch.cat([q, q]), kv, table, torch.tensor([3, 40], dtype=torch.int32), q_len=4)
    with pytest.raises(ValueError, match=r"q \[1..4 x q_len 2"):
        w = DecodeWrapper(4, table.shape[1], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
                          device="cpu", q_len=2)
        w.update(table, seq_lens)
        w.run(q[:3], kv)
    with pytest.raises(ValueError, match="seq_lens must be 0 or >= 2"):
        w.update(table, torch.tensor([1, 40], dtype=torch.int32))
    cache = PagedCache.random(Shape(8, 2, 64, 16, "float32"), assign_pages(np.array([40]), 16, 0.0, 0))
    for name in ("pkv-workqueue", "reference"):
        with pytest.raises(ValueError, match=r"takes no option\(s\) \['window_left'\]") as e:
            make_engine(name, cache, window_left=128)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["flashinfer", "flashinfer-tc"])
def test_flashinfers_planned_decode_refuses_sinks_in_one_line(name):
    """FlashInfer's planned decode drops sinks on SM 9.0 (fa2/fa3), so its rows take no sinks
    option: refused by the table's one line, before any device is needed, naming why and the
    engines that apply them. Windows and q_len pass the table (the CUDA check comes next)."""
    cache = PagedCache.random(Shape(8, 2, 64, 16, "float16"), assign_pages(np.array([40]), 16, 0.0, 0))
    with pytest.raises(ValueError, match=r"takes no option\(s\) \['sinks'\]: FlashInfer's planned decode drops "
                                         r"attention sinks .*take sinks: \['pkv-graph', 'flashinfer-xqa'\]$") as e:
        make_engine(name, cache, window_left=7, q_len=2, sinks=torch.zeros(8))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine(name, cache, window_left=7, q_len=2)


def test_the_sweeps_feature_suite():
    """The kernel sweep's feature rows: gpt-oss-like (sinks, sliding and full layers), Gemma-3-like
    (d 256, window 1024) and speculative q_len 2/4/8 over B 1-32 and 1K-32K; a windowed case's
    useful bytes are its rows' windows, and its engines get the options (a baseline without the
    feature refuses them in one line)."""
    from pkv.bench.kernels import SUITES

    cases = SUITES["features"]()
    assert {c.q_len for c in cases} == {1, 2, 4, 8}
    assert {(c.head_dim, c.window_left) for c in cases if c.window_left >= 0} == {(64, 127), (256, 1023)}
    assert all(c.sinks for c in cases if c.head_dim == 64)
    assert {c.batch for c in cases} == {1, 8, 32} and max(max(c.lens) for c in cases) == 32 * 1024
    sliding = next(c for c in cases if c.window_left == 127 and c.batch == 1)
    assert sliding.bytes == 128 * sliding.shape.kv_bytes_per_token
    spec = next(c for c in cases if c.q_len == 4)
    assert spec.feature_options == {"q_len": 4}


def test_the_sweep_records_a_refused_feature_as_an_error_row(monkeypatch):
    """run_case on a gpt-oss-like features case (sinks, a window): FlashInfer's planned decode rows
    hold the table's refusal as their error and no time; the rows that take the case's options get
    a time. On the CPU the timing is replaced by building the engine (XQA's row then holds its
    CUDA check)."""
    import pkv.bench.kernels as kb
    from pkv.bench.cases import Case
    from pkv.engines.table import feature_kernels

    case = next(c for c in kb.SUITES["features"]() if c.sinks and c.window_left >= 0)
    case = Case(case.family, case.name, (70, 3), num_qo_heads=case.num_qo_heads, num_kv_heads=case.num_kv_heads,
                head_dim=case.head_dim, window_left=case.window_left, sinks=True, point=case.point)
    cache = PagedCache.random(case.shape, assign_pages(np.asarray(case.lens), 16, 0.0, 0), device="cpu", seed=1)
    sinks = torch.randn(case.num_qo_heads)
    monkeypatch.setattr(kb, "build_caches", lambda c, seed, **_: ([cache], [cache.query(c.batch, 2)]))
    monkeypatch.setattr(Case, "feature_options", property(lambda c: {"window_left": c.window_left, "sinks": sinks}))

    def built(name, options, caches, *_):   # in place of the timed replays: the engine is built, or refused
        make_engine(name, caches[0], **options)
        return 1.0

    monkeypatch.setattr(kb, "cpu_us_per_call", built)
    rows = {r["engine"]: r for r in kb.run_case(case, list(feature_kernels()), 1, 1000.0, 0, device="cpu")}
    assert rows["pkv-graph"]["cpu_us"] == 1.0 and rows["pkv-graph"]["error"] == ""
    for name in ("flashinfer", "flashinfer-tc"):
        assert math.isnan(rows[name]["cpu_us"])
        assert "takes no option(s) ['sinks']: FlashInfer's planned decode drops attention sinks" in rows[name]["error"]
    assert "needs a CUDA device" in rows["flashinfer-xqa"]["error"]
