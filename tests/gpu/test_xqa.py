"""flashinfer-xqa (FlashInfer's plan-free XQA decode, pkv.engines.xqa) against the FP32
reference (needs a Hopper-or-later GPU and FlashInfer).

Fresh random K, V, Q for every case; outputs poisoned with NaN first; block-table rows
reached through shuffled request ids. Every XQA module is compiled per (dtype, KV dtype,
page size, head_dim, GQA group), ~1-2 min each: the grid below spans pages 16/32/64,
G 1/4/8, d 64/128/256, fp16 and bf16 and FP8 in `VARIANTS` (six modules), built side by
side once per session (pkv.measure.warm.build_variants) before the first case.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from test_graph import LENGTHS, REPLAY_CAPACITY, lens_for, replay, trace_steps

from pkv.core.cache import PagedCache
from pkv.core.fp8 import E4M3_STEP, KvScales
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.core.units import K
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference
from test_kernels import TOL, check, make_case, reference, seed_of

flashinfer = pytest.importorskip("flashinfer")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# (dtype, kv_dtype, page_size, head_dim, group): the modules the tests compile.
VARIANTS = {
    "fp16-p16-d128-G4": ("float16", "auto", 16, 128, 4),
    "bf16-p32-d64-G1": ("bfloat16", "auto", 32, 64, 1),
    "fp16-p64-d256-G8": ("float16", "auto", 64, 256, 8),
    "bf16-p16-d128-G8": ("bfloat16", "auto", 16, 128, 8),
    "fp8-fp16-p16-d128-G4": ("float16", "fp8", 16, 128, 4),
    "fp8-bf16-p64-d64-G1": ("bfloat16", "fp8", 64, 64, 1),
}
SIXTEEN_BIT = [k for k, v in VARIANTS.items() if v[1] == "auto"]
FP8 = [k for k, v in VARIANTS.items() if v[1] == "fp8"]


@pytest.fixture(scope="module", autouse=True)
def built():
    from pkv.engines.xqa import SM_MAJORS
    from pkv.measure.warm import build_variants

    if torch.cuda.get_device_capability()[0] not in SM_MAJORS:
        pytest.skip("XQA runs on SM 9.x, 10.x, 12.x devices")
    manifest = build_variants([("flashinfer-xqa", d, dt, kv, g, p) for dt, kv, p, d, g in VARIANTS.values()])
    failed = [b for b in manifest["built"] if b["error"]]
    assert not failed, failed
    return manifest


def run_xqa(engine, step, q, rows=None):
    plan = engine.prepare(step, rows=rows)
    torch.empty_like(q).fill_(float("nan"))  # the caching allocator hands this block to run()'s output
    out = engine.run(q, plan)
    torch.cuda.synchronize()
    return out


def variant_case(key, lens, seed, holes=0.5):
    dtype, _, page, d, group = VARIANTS[key]
    return make_case(lens, group=group, num_kv_heads=2, head_dim=d, page_size=page, dtype=dtype, holes=holes,
                     seed=seed)


@pytest.mark.parametrize("lengths", list(LENGTHS))
def test_lengths(lengths):
    seed = seed_of("xqa", lengths)
    cache, step, q = variant_case("fp16-p16-d128-G4", lens_for(lengths, np.random.default_rng(seed)), seed)
    check(run_xqa(make_engine("flashinfer-xqa", cache), step, q), reference(cache, step, q), "float16",
          f"xqa {lengths}")


@pytest.mark.parametrize("key", SIXTEEN_BIT)
def test_shapes(key):
    seed = seed_of("xqa-shapes", key)
    rng = np.random.default_rng(seed)
    p = VARIANTS[key][2]
    lens = [1, p - 1, p + 1, int(rng.integers(2 * K, 6 * K)), int(rng.integers(1, 300)), 8 * K + 7]
    cache, step, q = variant_case(key, lens, seed)
    check(run_xqa(make_engine("flashinfer-xqa", cache), step, q), reference(cache, step, q), VARIANTS[key][0],
          f"xqa {key}")


def v_max(cache8, step) -> torch.Tensor:
    """Per (row, qo head): max |v| over the row's tokens of its KV head, dequantized."""
    s = cache8.shape
    values = cache8.values()
    out = torch.empty(len(step.seq_lens), s.num_qo_heads, device=values.device)
    for i, (rid, n) in enumerate(zip(step.request_ids, step.seq_lens)):
        pages = cache8.block_table[int(rid)][torch.arange(int(n), device=values.device) // s.page_size].long()
        t = torch.arange(int(n), device=values.device) % s.page_size
        out[i] = values[pages, 1, :, t].float().abs().amax(dim=(0, 2)).repeat_interleave(s.group)
    return out


def row_lengths(step, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(step.seq_lens, dtype=torch.float32, device=like.device)[:, None]


def fp8_bound(q8, cache8, step) -> torch.Tensor:
    """Per (row, qo head): what XQA's Hopper FP8 kernel may add to the FP32 attention over the
    dequantized cache with Q rounded to e4m3 as the kernel rounds it. It also rounds the
    softmax weights w <= 1, scaled by 448, to e4m3: each moves by at most E4M3_STEP / 2 of
    itself plus half a subnormal step (2^-10 / 448); a weighted mean whose n weights (the
    largest is 1) move by d_i moves by at most 2 max|v| sum d_i / sum w <= 2 max|v| (2^-4 + n 2^-10 / 448)."""
    return 2 * v_max(cache8, step) * (E4M3_STEP / 2 + row_lengths(step, q8) * 2.0 ** -10 / 448)


FP32_UNIT = 2.0 ** -24          # FP32's unit roundoff
EXP_ERROR = 2.0 ** -17          # fast exp's relative error at |score - max| <= 64 (ex2.approx of a rounded x log2 e)
EXP_FLOOR = math.exp(-64)       # weights further below the max: what they can move by at all


def warp_groups(head_dim: int) -> int:
    """XQA's generic kernel (csrc/xqa/mha.cu, gemm1NbWarpGrps): the CTA's 4 P.V warps split head_dim
    into 64-wide slices and the tokens into 4 / slices groups."""
    return 4 // min(head_dim // 64, 4)


def generic_bound(cache8, step) -> torch.Tensor:
    """Per (row, qo head): what XQA's generic kernel may add to the FP32 attention over the
    dequantized cache (its numerics: pkv.engines.xqa's docstring). With u the 16-bit type's unit
    roundoff, h half its subnormal spacing, n the row's length, M = max|v| over the row, G the
    warp groups:
    - the weights w = exp(score - max) <= 1 are rounded to 16 bits and the row sum is taken over
      the rounded ones: each moves by (u + EXP_ERROR) of itself plus (h + EXP_FLOOR), so the
      weighted mean by at most 2 M (u + EXP_ERROR + n (h + EXP_FLOOR)) / (1 - that);
    - the output is rounded to 16 bits 2 (2G - 1) times: each of G warp groups' shares and their
      G - 1 sums in 16-bit adds, in every split and again in the merge of splits; each value
      rounded is at most M, so u M each;
    - FP32 sums of at most n terms and at most n rescalings, numerator and denominator: 4 n 2^-24 M."""
    s = cache8.shape
    info = torch.finfo(s.torch_dtype)
    u, h = info.eps / 2, info.tiny * info.eps / 2
    m = v_max(cache8, step)
    n = row_lengths(step, m)
    weights = u + EXP_ERROR + n * (h + EXP_FLOOR)
    return m * (2 * weights / (1 - weights) + 2 * (2 * warp_groups(s.head_dim) - 1) * u + 4 * n * FP32_UNIT)


def fp8_case(key, k_gain, v_gain, seed):
    rng = np.random.default_rng(seed)
    p = VARIANTS[key][2]
    cache16, step, q = variant_case(key, [1, p + 1, 9000, int(rng.integers(1, 3 * K)), 33 * K], seed)
    cache16.kv[:, 0] *= k_gain
    cache16.kv[:, 1] *= v_gain
    return cache16.quantized("tensor"), step, q


def reference8(cache8, step, q) -> torch.Tensor:
    ids = torch.as_tensor(step.request_ids, device="cuda")
    return attention_reference(q, cache8.values(), cache8.block_table[ids], torch.as_tensor(step.seq_lens))


GAINS = [(1.0, 1.0), (1.0, 8.0), (8.0, 1.0)]


@pytest.mark.parametrize("key", FP8)
def test_fp8_scales_enter_in_fp32(key):
    """The K and V scales' mapping, bit for bit. XQA's generic kernel multiplies its FP32 Q.K
    accumulator by q_scale * kv_scale / sqrt(d) and its FP32 output by kv_scale before any
    16-bit rounding, and converts e4m3 to 16 bits exactly. So, over the same e4m3 bytes, K's
    scale times 8 gives the output of the query times 8 (exact in 16 bits), bit for bit, and V's
    scale times 8 gives 8 times the output: exactly, but for roundings in fp16's subnormal range
    (each of the <= 14 moves by < 2^-21 there, in all < finfo.tiny). A K scale read as V's, or
    the reverse, breaks one of the two; so an error of the FP8 cases is the 16-bit kernel's own."""
    seed = seed_of("xqa-fp8-exact", key)
    cache8, step, q = fp8_case(key, 1.0, 1.0, seed)
    sc = cache8.scales

    def out(k_scale, v_scale, query):
        c = dataclasses.replace(cache8, scales=KvScales("tensor", k_scale, v_scale))
        return run_xqa(make_engine("flashinfer-xqa", c), step, query).float()

    base = out(sc.k_scale, sc.v_scale, q)
    assert torch.isfinite(base).all()
    k8 = out(8 * sc.k_scale, sc.v_scale, q)
    assert torch.equal(k8, out(sc.k_scale, sc.v_scale, q * 8)), \
        f"{key}: K scale x8 differs from Q x8 by {(k8 - out(sc.k_scale, sc.v_scale, q * 8)).abs().max():.2e}"
    diff = (out(sc.k_scale, 8 * sc.v_scale, q) - 8 * base).abs().max().item()
    assert diff <= torch.finfo(q.dtype).tiny, f"{key}: V scale x8 is not 8x the output: {diff:.2e} apart"


@pytest.mark.parametrize("k_gain,v_gain", GAINS)
@pytest.mark.parametrize("key", FP8)
def test_fp8_tensor_scales(key, k_gain, v_gain):
    """The default (XQA's generic kernel, 16-bit math on the e4m3 values) within generic_bound of
    the FP32 reference over the dequantized cache; at gains 1 also within the 16-bit kernels'
    tolerance. A gain scales the K or V tensor scale (the e4m3 bytes stay the same): V x8 makes
    the output and every rounding of it 8x larger, K x8 makes the softmax sharper (fewer
    weights to average the rounding of P out), so the 16-bit kernels' fixed tolerance, stated
    for unit-range K and V, does not apply to them; the bound does."""
    seed = seed_of("xqa-fp8", key, k_gain, v_gain)
    cache8, step, q = fp8_case(key, k_gain, v_gain, seed)
    out = run_xqa(make_engine("flashinfer-xqa", cache8), step, q)
    ref = reference8(cache8, step, q)
    what = f"xqa fp8 {key} K x{k_gain} V x{v_gain}"
    assert torch.isfinite(out).all(), f"{what}: unwritten or non-finite output"
    err = (out.float() - ref).abs().amax(-1)
    worst = (err / generic_bound(cache8, step)).max().item()
    assert worst <= 1.0, f"{what}: error reaches {worst:.2f} of the 16-bit rounding bound (max|e| {err.max():.2e})"
    if (k_gain, v_gain) == (1.0, 1.0):
        check(out, ref, cache8.shape.dtype, what)


@pytest.mark.parametrize("k_gain,v_gain", GAINS)
@pytest.mark.parametrize("key", FP8)
def test_fp8_hopper_kernel_within_e4m3_rounding(key, k_gain, v_gain):
    """hopper_fp8=true: XQA's Hopper FP8 kernel (Q and P in e4m3) within fp8_bound of the FP32
    attention over the dequantized cache with Q rounded as the kernel rounds it."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("XQA's Hopper FP8 kernel runs on SM 9.x")
    seed = seed_of("xqa-fp8-hopper", key, k_gain, v_gain)
    cache8, step, q = fp8_case(key, k_gain, v_gain, seed)
    out = run_xqa(make_engine("flashinfer-xqa", cache8, hopper_fp8=True), step, q)
    assert torch.isfinite(out).all(), f"{key}: unwritten or non-finite output"
    q8 = q.to(torch.float8_e4m3fn).to(q.dtype)
    ref = reference8(cache8, step, q8)
    err = (out.float() - ref).abs().amax(-1)
    bound = fp8_bound(q8, cache8, step) + TOL[cache8.shape.dtype][0]
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"{key} K x{k_gain} V x{v_gain}: error reaches {worst:.2f} of the e4m3 bound"
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < E4M3_STEP, f"{key}: relative error {rel:.3f} (a scale mapped wrong is off by the gain)"


@pytest.mark.parametrize("key", ["fp16-p16-d128-G4", "bf16-p32-d64-G1", "fp8-fp16-p16-d128-G4"])
def test_graph_replay_over_a_ragged_trace(key):
    """Capture run() once at a bucket of 12 rows, then replay it for 16 steps whose rows join and
    leave and whose lengths cross page and tile edges: prepare(step, rows=12) rewrites the
    fixed-address lengths and block-table rows; the output is poisoned before every replay."""
    seed = seed_of("xqa-replay", key)
    dtype, kv, page, d, group = VARIANTS[key]
    rng = np.random.default_rng(seed)
    reserved = rng.integers(1, 12 * K, size=24)
    reserved[:3] = [40 * K, 3, 1]
    shape = Shape(group * 4, 4, d, page, dtype, kv)
    cache = PagedCache.random(shape, assign_pages(reserved, page, 0.5, seed), device="cuda", seed=seed)
    steps = trace_steps(rng, len(reserved), reserved, REPLAY_CAPACITY, 16)
    engine = make_engine("flashinfer-xqa", cache, max_rows=REPLAY_CAPACITY)

    def check_step(t, out, step, q):
        ids = torch.as_tensor(step.request_ids, device="cuda")
        ref = attention_reference(q, cache.values(), cache.block_table[ids], torch.as_tensor(step.seq_lens))
        check(out, ref, dtype, f"xqa replay {key} step {t}")

    replay(engine, cache, steps, seed, check_step)


def test_step_allocates_nothing():
    """prepare() and run() at a fixed row count allocate only run()'s output: what the
    caching allocator holds after a warm step does not grow over later steps."""
    seed = seed_of("xqa-alloc")
    cache, step, q = variant_case("fp16-p16-d128-G4", [100, 5000, 17], seed)
    engine = make_engine("flashinfer-xqa", cache, validate=False)
    engine.run(q, engine.prepare(step))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(4):
        out = engine.run(q, engine.prepare(step))
        del out
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("shape,scales,match", [
    (Shape(32, 8, 128, 8, "float16"), None, "pages of 16, 32, 64, 128 tokens"),
    (Shape(32, 8, 128, 256, "float16"), None, "pages of 16, 32, 64, 128 tokens"),
    (Shape(32, 8, 72, 16, "float16"), None, "multiple of 16 up to 256"),
    (Shape(64, 1, 128, 16, "float16"), None, "GQA groups 1..32"),
    (Shape(32, 8, 128, 16, "float32"), None, "float16 or bfloat16 queries"),
    (Shape(32, 8, 128, 16, "float16"), "page", "tensor scales only"),
])
def test_refusals_are_one_line(shape, scales, match):
    reserved = np.array([40, 70])
    cache = PagedCache.random(shape, assign_pages(reserved, shape.page_size, 0.0, 0), device="cuda", seed=0)
    if scales:
        cache = cache.quantized(scales)
    with pytest.raises(ValueError, match=match) as err:
        make_engine("flashinfer-xqa", cache)
    assert "\n" not in str(err.value)


def test_hopper_fp8_needs_an_fp8_cache():
    cache, _, _ = variant_case("fp16-p16-d128-G4", [40], seed_of("xqa-hopper-16"))
    with pytest.raises(ValueError, match="hopper_fp8 runs XQA's Hopper FP8 kernel, for an FP8 cache"):
        make_engine("flashinfer-xqa", cache, hopper_fp8=True)


def test_beyond_capacity_is_refused():
    cache, step, q = variant_case("fp16-p16-d128-G4", [50] * 5, seed_of("xqa-capacity"))
    engine = make_engine("flashinfer-xqa", cache, max_rows=4)
    with pytest.raises(ValueError, match="exceeds its capacity of 4 rows"):
        engine.prepare(step)
    with pytest.raises(ValueError, match="q has"):
        engine.run(q[:2], engine.prepare(StepState(0, step.request_ids[:3], step.seq_lens[:3])))
    assert math.isfinite(float(run_xqa(engine, StepState(0, step.request_ids[:3], step.seq_lens[:3]), q[:3])
                               .float().abs().max()))


def test_model_step_runner_replays_one_graph_per_bucket():
    """XqaGraphRunner (pkv.engines.model_flashinfer): the N-layer step captured once per bucket,
    each layer over its own KV tensor, replayed for steps of fewer rows (padded), against the
    reference runner's final hidden state."""
    from pkv.engines.model import DecoderModel, ModelShape, ReferenceRunner
    from pkv.engines.model_flashinfer import XqaGraphRunner
    from pkv.measure.stages import layer_caches

    shape = ModelShape("xqa-test", 3, 512, 4, 1, 128, 512)       # G4 d128: the fp16-p16-d128-G4 module
    seed = seed_of("xqa-model")
    rng = np.random.default_rng(seed)
    reserved = rng.integers(1, 6 * K, size=10)
    caches = layer_caches(shape.attention(16, "float16"), assign_pages(reserved, 16, 0.5, seed), "cuda", seed,
                          shape.layers)
    net = DecoderModel(shape, torch.float16, "cuda", seed)
    buckets = [1, 8]
    xs = {b: torch.randn(b, shape.hidden, device="cuda").to(torch.float16) for b in buckets}
    runner = XqaGraphRunner.build(net, caches, xs, buckets)
    ref = ReferenceRunner.build(net, caches, xs, buckets)
    steps = trace_steps(rng, len(reserved), reserved, 8, 6)
    for b in buckets:
        runner.capture(b, StepState(0, np.arange(b), np.minimum(reserved[:b], 5).astype(np.int32)))
    for step in steps:
        bucket = next(b for b in buckets if b >= step.active)
        runner.prepare(step, bucket)
        out = runner.launch(step, bucket)[:step.active].float()
        ref.prepare(step, bucket)
        want = ref.launch(step, bucket).float()
        rel = ((out - want).norm() / want.norm()).item()
        assert rel < 1e-2, f"step {step.step} (B{step.active} in bucket {bucket}): rel. error {rel:.2e}"
    runner.close()
