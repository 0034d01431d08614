"""pkv-graph (splits decided on the GPU) against the FP32 reference (needs a GPU).

Fresh random K, V, Q for every case; outputs and the partial workspace are poisoned with
NaN first; block-table rows are reached through shuffled request ids. The replay tests
capture one CUDA graph and replay it over whole traces while rows join and leave.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.core.units import K
from pkv.engines import make_engine
from test_kernels import check, make_case, reference, seed_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run_graph(engine, step, q):
    plan = engine.prepare(step)
    engine.partial.fill_(float("nan"))
    torch.empty_like(q).fill_(float("nan"))  # the caching allocator hands this block to run()'s output
    out = engine.run(q, plan)
    torch.cuda.synchronize()
    return out


LENGTHS = {
    "1": [1], "31": [31], "33": [33], "4K": [4 * K], "8K+7": [8 * K + 7], "32K": [32 * K], "100K": [100 * K + 3],
    "many-short": "many", "one-long": "long", "bimodal": "bimodal",
}


def lens_for(name, rng):
    v = LENGTHS[name]
    if v == "many":
        return rng.integers(1, 2 * K, size=67).tolist()
    if v == "long":
        return [40 * K + 5] + rng.integers(1, 900, size=20).tolist()
    if v == "bimodal":
        return rng.choice([300, 17 * K], size=9).tolist()
    return v


@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_lengths(lengths):
    seed = seed_of("graph", lengths)
    cache, step, q = make_case(lens_for(lengths, np.random.default_rng(seed)), seed=seed)
    out = run_graph(make_engine("pkv-graph", cache), step, q)
    check(out, reference(cache, step, q), "float16", f"pkv-graph {lengths}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", [1, 3, 4, 5, 7, 8, 12, 16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_shapes(dtype, group, head_dim, page_size):
    if head_dim == 256 and group > 8:
        pytest.skip("head_dim 256 takes groups <= 8 (tested to raise below)")
    seed = seed_of("graph", dtype, group, head_dim, page_size)
    rng = np.random.default_rng(seed)
    p = page_size
    lens = [1, max(1, p - 1), p + 1, int(rng.integers(2 * K, 6 * K)), int(rng.integers(1, 300))]
    cache, step, q = make_case(lens, group=group, num_kv_heads=2, head_dim=head_dim, page_size=p, dtype=dtype,
                               holes=0.5, seed=seed)
    out = run_graph(make_engine("pkv-graph", cache), step, q)
    check(out, reference(cache, step, q), dtype, f"pkv-graph {dtype} G{group} d{head_dim} p{p}")


@pytest.mark.parametrize("ctas_per_sm,min_tiles", [(1, 1), (2, 8), (3, 2)])
def test_cut_options(ctas_per_sm, min_tiles):
    seed = seed_of("graph-cut", ctas_per_sm, min_tiles)
    rng = np.random.default_rng(seed)
    cache, step, q = make_case(rng.integers(1, 9 * K, size=5).tolist(), seed=seed)
    engine = make_engine("pkv-graph", cache, ctas_per_sm=ctas_per_sm, min_tiles=min_tiles)
    check(run_graph(engine, step, q), reference(cache, step, q), "float16", f"cut {ctas_per_sm} {min_tiles}")


@pytest.mark.parametrize("min_tiles", [1, 4, 8])
@pytest.mark.parametrize("group,head_dim", [(16, 128), (1, 64), (5, 256)])
def test_merge_paths(min_tiles, group, head_dim):
    """The in-grid merge (a short segment by its last CTA, a long one by its last CTAs in
    slices) over cuts of 2 to hundreds of states per segment, slices wider than a merging CTA
    (G 16) and narrower than one column per CTA (G 1, d 64)."""
    seed = seed_of("graph-merge", min_tiles, group, head_dim)
    rng = np.random.default_rng(seed)
    lens = [int(rng.integers(6 * K, 20 * K)), 33, int(rng.integers(1, 3 * K))]
    cache, step, q = make_case(lens, group=group, num_kv_heads=2, head_dim=head_dim, seed=seed)
    engine = make_engine("pkv-graph", cache, min_tiles=min_tiles)
    check(run_graph(engine, step, q), reference(cache, step, q), "float16", f"merge mt {min_tiles}")


@pytest.mark.parametrize("piece_cost", [1, 3])
@pytest.mark.parametrize("lengths", ["many-short", "one-long", "bimodal", "mixed"])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (1, 64), (8, 256)])
def test_piece_cost(piece_cost, lengths, group, head_dim):
    """The cut with set-up units in front of short segments: ranges that
    start, end or lie in set-up units, segments whose first CTA is not the one holding their
    first unit, merged by their last CTA and by several."""
    seed = seed_of("graph-piece-cost", piece_cost, lengths, group, head_dim)
    rng = np.random.default_rng(seed)
    lens = ([int(rng.integers(20 * K, 40 * K))] + rng.integers(1, 200, size=30).tolist() if lengths == "mixed"
            else lens_for(lengths, rng))
    cache, step, q = make_case(lens, group=group, num_kv_heads=4, head_dim=head_dim, seed=seed)
    engine = make_engine("pkv-graph", cache, piece_cost=piece_cost)
    check(run_graph(engine, step, q), reference(cache, step, q), "float16",
          f"piece_cost {piece_cost} {lengths} G{group} d{head_dim}")


@pytest.mark.parametrize("counter_stride,spin_ns", [(32, 0), (1, 200), (7, 50)])
def test_in_grid_merge_counter_options(counter_stride, spin_ns):
    """The in-grid merge with its diagnosis options (counters apart, spin back-off): long cuts
    merged in the grid, replayed, every counter rearmed."""
    seed = seed_of("graph-counters", counter_stride, spin_ns)
    rng = np.random.default_rng(seed)
    cache, step, q = make_case([int(rng.integers(16 * K, 40 * K)), 70, int(rng.integers(1, 3 * K))], num_kv_heads=4,
                               seed=seed)
    engine = make_engine("pkv-graph", cache, counter_stride=counter_stride, spin_ns=spin_ns)
    for _ in range(2):   # the second launch finds the counters the first rearmed
        check(run_graph(engine, step, q), reference(cache, step, q), "float16", f"counters {counter_stride} {spin_ns}")
    assert int(engine.counters.abs().sum()) == 0


# The compute-sanitizer grid: every pkv-graph path (16-bit d 64/128/256, FP8 tensor and page
# scales, split and unsplit, page 1 and 64, the cut with and without set-up units) on a grid of
# 8 SMs' worth of CTAs; run with
#   compute-sanitizer --tool {memcheck,racecheck,synccheck} --kernel-name kns=graph_ \
#     --error-exitcode 1 python3 -m pytest -q tests/gpu/test_graph.py -k sanitizer_grid
# (--kernel-name keeps the tools on the graph decode kernel: unfiltered, racecheck also reports
# torch's own reduction kernels that the checks call.)
SANITIZER_GRID = [(d, kv, page, lens) for d in (64, 128, 256) for kv in ("auto", "tensor", "page")
                  for page in (1, 64) for lens in ((40,), (3000, 17), (300, 300))
                  if not (kv != "auto" and d == 256) and not (kv == "page" and page == 1)]


@pytest.mark.parametrize("head_dim,kv,page,lens", SANITIZER_GRID)
def test_sanitizer_grid(head_dim, kv, page, lens):
    seed = seed_of("sanitizer", head_dim, kv, page, lens)
    cache, step, q = make_case(list(lens), group=4, num_kv_heads=2, head_dim=head_dim, page_size=page, seed=seed)
    run_cache = cache if kv == "auto" else cache.quantized(kv)
    for piece_cost in (0, 2):
        engine = make_engine("pkv-graph", run_cache, num_sms=8, piece_cost=piece_cost)
        out = run_graph(engine, step, q)
        ref = reference(run_cache, step, q) if kv == "auto" else reference_dequantized(run_cache, step, q)
        check(out, ref, "float16", f"sanitizer grid d{head_dim} {kv} p{page} {lens} pc {piece_cost}")


@pytest.mark.parametrize("lengths", ["33", "4K", "many-short", "one-long"])
def test_pdl_chain_reads_the_previous_kernels_output(lengths):
    """Decodes launched back to back as programmatic dependents, each one's q the output of the one
    before (which lets its dependent launch at its start): a q read, or an output, partial state or
    counter written, before the wait would read the poison or race the previous decode. Eager,
    then the same chain captured in one CUDA graph and replayed over poisoned outputs."""
    from pkv.api import DecodeWrapper

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs SM 9.0")
    seed = seed_of("pdl-chain", lengths)
    cache, step, q0 = make_case(lens_for(lengths, np.random.default_rng(seed)), seed=seed)
    s = cache.shape
    table = cache.block_table[torch.as_tensor(step.request_ids, device="cuda")]
    wrapper = DecodeWrapper(step.active, table.shape[1], num_qo_heads=s.num_qo_heads, num_kv_heads=s.num_kv_heads,
                            head_dim=s.head_dim, page_size=s.page_size)
    wrapper.update(table.cpu(), torch.as_tensor(step.seq_lens))
    outs = [torch.empty_like(q0) for _ in range(6)]

    def chain():
        q = q0
        for o in outs:
            wrapper.run(q, cache.kv, out=o)
            q = o

    def check_chain(what):
        for i, (q, o) in enumerate(zip([q0, *outs], outs)):
            check(o, reference(cache, step, q), "float16", f"pdl chain {lengths} {what} link {i}")

    for o in outs:
        o.fill_(float("nan"))
    chain()
    torch.cuda.synchronize()
    check_chain("eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_chain("graph")


def reference_dequantized(cache8, step, q):
    from pkv.kernels.reference import attention_reference

    ids = torch.as_tensor(step.request_ids, device="cuda")
    return attention_reference(q, cache8.values(), cache8.block_table[ids], torch.as_tensor(step.seq_lens))


def test_unsupported_shapes_raise():
    shape = Shape(32, 2, 256, 16, "float16")
    cache = PagedCache.random(shape, assign_pages(np.array([40]), 16, 0.0, 0), device="cuda")
    with pytest.raises(ValueError, match="groups 1..8 at head_dim 256"):
        make_engine("pkv-graph", cache)


def trace_steps(rng, num_requests, reserved, capacity, num_steps):
    """Steps whose active sets change (joins and leaves), lengths crossing page and split
    boundaries, one single-row step and one step at capacity."""
    steps = []
    for t in range(num_steps):
        b = 1 if t == 3 else capacity if t == 5 else int(rng.integers(1, capacity + 1))
        ids = rng.choice(num_requests, size=b, replace=False)
        lens = np.minimum(reserved[ids], rng.integers(1, reserved[ids] + 1))
        if t % 4 == 0:  # land exactly on and around page and tile edges
            lens = np.minimum(reserved[ids], rng.choice([15, 16, 17, 31, 32, 33, 1023, 1024, 1025], size=b))
        steps.append(StepState(t, ids.astype(np.int64), lens.astype(np.int32)))
    return steps


@pytest.mark.parametrize("group,head_dim,dtype,piece_cost", [
    (4, 128, "float16", 0), (7, 128, "bfloat16", 0), (2, 256, "float16", 0), (8, 64, "float16", 0),
    (4, 128, "float16", 1), (4, 128, "float16", 2)])
def test_graph_replay_over_a_trace(group, head_dim, dtype, piece_cost):
    seed = seed_of("replay", group, head_dim, dtype, *([piece_cost] if piece_cost else []))
    cache, steps = replay_case(seed, Shape(group * 4, 4, head_dim, 16, dtype))
    replay_and_check(cache, steps, seed,
                     lambda t, out, step, q: check(out, reference(cache, step, q), dtype, f"replay step {t}"),
                     piece_cost=piece_cost)


REPLAY_CAPACITY = 12


def replay_case(seed, shape):
    """A 24-request cache (one 40K request, two tiny ones) and 16 steps of up to 12 rows over it."""
    rng = np.random.default_rng(seed)
    reserved = rng.integers(1, 12 * K, size=24)
    reserved[:3] = [40 * K, 3, 1]
    cache = PagedCache.random(shape, assign_pages(reserved, 16, 0.5, seed), device="cuda", seed=seed)
    return cache, trace_steps(rng, len(reserved), reserved, REPLAY_CAPACITY, 16)


def replay_and_check(cache, steps, seed, check_step, piece_cost=0):
    """Capture pkv-graph once at the bucket, then replay it for every step with fresh queries
    and a poisoned output; check_step(t, out[:b], step, q[:b]) judges each step. Every merge
    counter is rearmed (zero) after the last replay."""
    engine = make_engine("pkv-graph", cache, max_rows=REPLAY_CAPACITY, piece_cost=piece_cost)
    replay(engine, cache, steps, seed, check_step)
    assert int(engine.counters.abs().sum()) == 0, "a merge counter was left armed"


def replay(engine, cache, steps, seed, check_step):
    """Capture `engine` once at the bucket (REPLAY_CAPACITY rows), then replay it for every step
    with fresh queries and a poisoned output; check_step(t, out[:b], step, q[:b]) judges each."""
    q_static = cache.query(REPLAY_CAPACITY, seed)
    plan = engine.prepare(steps[0], rows=REPLAY_CAPACITY)
    engine.run(q_static, plan)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = engine.run(q_static, plan)
    for t, step in enumerate(steps):
        engine.prepare(step, rows=REPLAY_CAPACITY)
        b = step.active
        q_static.copy_(cache.query(REPLAY_CAPACITY, seed + 1000 + t))
        out_static.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_step(t, out_static[:b], step, q_static[:b])


def test_beyond_capacity_is_refused():
    reserved = np.full(10, 100)
    cache = PagedCache.random(Shape(32, 8, 128, 16, "float16"), assign_pages(reserved, 16, 0.0, 0), device="cuda")
    engine = make_engine("pkv-graph", cache, max_rows=4)
    step = StepState(0, np.arange(5), np.full(5, 50, dtype=np.int32))
    with pytest.raises(ValueError, match="exceeds its capacity of 4 rows"):
        engine.prepare(step)
    with pytest.raises(ValueError, match="exceeds its capacity"):
        engine.prepare(StepState(0, np.arange(3), np.full(3, 50, dtype=np.int32)), rows=5)
    with pytest.raises(ValueError):  # longer than the request's reserved pages: never truncated
        engine.prepare(StepState(0, np.arange(2), np.array([50, 10_000], dtype=np.int32)))
