"""Sliding windows, attention sinks and several query tokens per row on the GPU: pkv-graph and
the public API against the FP32 reference on the feature grid (tests/api_cases.py, long rows
scaled so that they split across CTAs and merge in the grid), 16-bit and FP8 caches, LSE and
soft cap; one CUDA graph per bucket replayed while lengths change; the compute-sanitizer grid
of the new paths (run as test_graph.py's, with -k features_sanitizer_grid). Outputs are
poisoned with NaN first; padding rows must stay untouched. The CPU twin is tests/test_features.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from api_cases import feature_cases, make_case
from pkv.api import DecodeWrapper, decode
from pkv.core.fp8 import quantize
from pkv.core.harness import StepState
from pkv.engines import make_engine
from pkv.engines.table import info
from pkv.kernels.reference import attention_reference
from test_kernels import check, seed_of
from test_kernels import make_case as engine_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CASES = feature_cases(scale=12)   # long rows of ~3.6K and ~18K tokens
IDS = [c[0] for c in CASES]
LSE_TOL = 2e-3   # the FP8 paths meet the 16-bit tolerance against the dequantized cache (tests/gpu/test_fp8.py)


def sinks_for(c, seed):
    hq, with_sinks = c[2], c[8]
    return torch.randn(hq, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)) * 2 \
        if with_sinks else None


def rows_of(lens, q_len):
    return torch.as_tensor(np.repeat(np.asarray(lens) > 0, q_len), device="cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("c", CASES, ids=IDS)
def test_api(c, dtype):
    name, lens, hq, hkv, d, p, q_len, window, _, cap = c
    seed = seed_of("features-api", name, str(dtype))
    kv, table, seq_lens, q = make_case(lens, hq, hkv, d, p, dtype, seed, device="cuda", q_len=q_len)
    sinks = sinks_for(c, seed)
    out, lse = decode(q, kv, table, seq_lens, logits_soft_cap=cap or None, out=torch.full_like(q, float("nan")),
                      return_lse=True, window_left=window, q_len=q_len, sinks=sinks)
    ref, ref_lse = attention_reference(q, kv, table, seq_lens.cpu(), None, cap, True, q_len=q_len,
                                       window_left=window, sinks=sinks)
    rows = rows_of(lens, q_len)
    check(out[rows], ref[rows], "float16" if dtype == torch.float16 else "bfloat16", f"api {name}")
    assert torch.isnan(out[~rows]).all(), f"{name}: a padding row was written"
    err = (lse[rows] - ref_lse[rows]).abs().max().item()
    assert err < LSE_TOL, f"{name}: lse max|e| {err:.2e}"


FP8_CASES = [c for c in CASES if c[4] <= 128]


@pytest.mark.parametrize("c", FP8_CASES, ids=[c[0] for c in FP8_CASES])
def test_api_fp8(c):
    name, lens, hq, hkv, d, p, q_len, window, _, cap = c
    seed = seed_of("features-fp8", name)
    kv, table, seq_lens, q = make_case(lens, hq, hkv, d, p, torch.float16, seed, device="cuda", q_len=q_len)
    sinks = sinks_for(c, seed)
    kv8, scales = quantize(kv, "tensor")
    out = decode(q, kv8, table, seq_lens, logits_soft_cap=cap or None, k_scale=scales.k_scale,
                 v_scale=scales.v_scale, window_left=window, q_len=q_len, sinks=sinks)
    deq = kv8.float() * torch.tensor([scales.k_scale, scales.v_scale], device="cuda").view(1, 2, 1, 1, 1)
    ref = attention_reference(q, deq, table, seq_lens.cpu(), None, cap, q_len=q_len, window_left=window, sinks=sinks)
    rows = rows_of(lens, q_len)
    check(out[rows], ref[rows], "float16", f"fp8 {name}")


@pytest.mark.parametrize("c", CASES[::2], ids=IDS[::2])
def test_engine(c):
    """pkv-graph's engine options, its cut with and without set-up units, on a small grid (splits)."""
    name, lens, hq, hkv, d, p, q_len, window, _, _ = c
    seed = seed_of("features-engine", name)
    cache, step, _ = engine_case([max(n, q_len) for n in lens], group=hq // hkv, num_kv_heads=hkv, head_dim=d,
                                 page_size=p, seed=seed)
    q = cache.query(len(lens) * q_len, seed + 1)
    sinks = sinks_for(c, seed)
    ids = torch.as_tensor(step.request_ids, device="cuda")
    ref = attention_reference(q, cache.kv, cache.block_table[ids], torch.as_tensor(step.seq_lens), q_len=q_len,
                              window_left=window, sinks=sinks)
    for num_sms, piece_cost in ((None, 8), (8, 0)):
        engine = make_engine("pkv-graph", cache, num_sms=num_sms, piece_cost=piece_cost, window_left=window,
                             q_len=q_len, sinks=sinks)
        engine.partial.fill_(float("nan"))
        out = engine.run(q, engine.prepare(step))
        torch.cuda.synchronize()
        check(out, ref, "float16", f"engine {name} sms {num_sms} pc {piece_cost}")
        assert int(engine.counters.abs().sum()) == 0, "a merge counter was left armed"


def test_wrapper_graph_replay():
    """One captured graph per bucket serves every step: windows and sinks per layer, q_len per bucket."""
    hq, hkv, d, q_len, bucket = 16, 2, 128, 4, 8
    rng = np.random.default_rng(11)
    widths = 600
    kv = torch.randn(bucket * widths + 3, 2, hkv, 16, d, device="cuda").half()
    table = torch.as_tensor(rng.permutation(bucket * widths)[:bucket * widths].reshape(bucket, widths).astype(np.int32),
                            device="cuda")
    layers = [(-1, None), (128, torch.randn(hq, device="cuda")), (1000, None)]
    w = DecodeWrapper(bucket, widths, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16, device="cuda",
                      q_len=q_len)
    q = torch.randn(bucket * q_len, hq, d, device="cuda").half()
    outs = torch.empty(len(layers), *q.shape, device="cuda", dtype=q.dtype)
    w.update(table.cpu().numpy(), np.full(bucket, 40, dtype=np.int32))
    for i, (window, sinks) in enumerate(layers):   # warm-up
        w.run(q, kv, out=outs[i], window_left=window, sinks=sinks)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i, (window, sinks) in enumerate(layers):
            w.run(q, kv, out=outs[i], window_left=window, sinks=sinks)
    for step in range(4):
        b = int(rng.integers(1, bucket + 1))
        lens = rng.integers(q_len, widths * 16, size=b).astype(np.int32)
        lens[0] = q_len + step
        w.update(table[:b].cpu().numpy(), lens)
        outs.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i, (window, sinks) in enumerate(layers):
            ref = attention_reference(q[:b * q_len], kv, table[:b], torch.as_tensor(lens), q_len=q_len,
                                      window_left=window, sinks=sinks)
            check(outs[i, :b * q_len], ref, "float16", f"replay step {step} layer {i}")
            assert torch.isnan(outs[i, b * q_len:]).all(), "a padding row was written"


# The compute-sanitizer grid of the new paths (windows mid-page, sinks, q_len with several query
# blocks, FP8; split and unsplit rows; the cut with and without set-up units) on 8 SMs' worth of
# CTAs; run with
#   compute-sanitizer --tool {memcheck,racecheck,synccheck} --kernel-name kns=graph_ \
#     --error-exitcode 1 python3 -m pytest -q tests/gpu/test_features_gpu.py -k features_sanitizer_grid
SANITIZER_GRID = [(d, kv, q_len, window, lens) for d in (64, 128, 256) for kv in ("auto", "tensor")
                  for q_len, window in ((1, 40), (3, -1), (8, 100)) for lens in ((40,), (3000, 17), (300, 300))
                  if not (kv != "auto" and d == 256)]


@pytest.mark.parametrize("head_dim,kv,q_len,window,lens", SANITIZER_GRID)
def test_features_sanitizer_grid(head_dim, kv, q_len, window, lens):
    seed = seed_of("features-sanitizer", head_dim, kv, q_len, window, lens)
    cache, step, _ = engine_case(list(lens), group=4, num_kv_heads=2, head_dim=head_dim, page_size=16, seed=seed)
    q = cache.query(len(lens) * q_len, seed + 1)
    run_cache = cache if kv == "auto" else cache.quantized(kv)
    sinks = torch.randn(8, device="cuda")
    ids = torch.as_tensor(step.request_ids, device="cuda")
    ref = attention_reference(q, run_cache.values(), run_cache.block_table[ids], torch.as_tensor(step.seq_lens),
                              q_len=q_len, window_left=window, sinks=sinks)
    for piece_cost in (0, 2):
        engine = make_engine("pkv-graph", run_cache, num_sms=8, piece_cost=piece_cost, window_left=window,
                             q_len=q_len, sinks=sinks)
        out = engine.run(q, engine.prepare(StepState(0, step.request_ids, step.seq_lens)))
        torch.cuda.synchronize()
        check(out, ref, "float16", f"sanitizer grid d{head_dim} {kv} q{q_len} w{window} pc {piece_cost}")


BASELINE_CASES = [c for c in CASES if c[0] in ("window-page", "sinks-cap", "qlen4-g8", "qlen3-window")]


@pytest.mark.parametrize("engine", ["flashinfer-xqa", "flashinfer-tc"])
@pytest.mark.parametrize("c", BASELINE_CASES, ids=[c[0] for c in BASELINE_CASES])
def test_baseline_features(c, engine):
    """The FlashInfer adapters the kernel sweep measures the features against compute the same
    attention, or refuse the feature in one line (a row the sweep reports as not supporting it).
    A feature the engine's table row lacks (sinks on FlashInfer's planned decode, which drops
    them on SM 9.0) must be refused by the table's line; that case is then skipped."""
    pytest.importorskip("flashinfer")
    name, lens, hq, hkv, d, p, q_len, window, _, cap = c
    if cap:
        pytest.skip("the adapters take no soft cap")
    seed = seed_of("features-baseline", name)
    cache, step, _ = engine_case([max(n, q_len) for n in lens], group=hq // hkv, num_kv_heads=hkv, head_dim=d,
                                 page_size=max(p, 16), seed=seed)
    q = cache.query(len(lens) * q_len, seed + 1)
    sinks = sinks_for(c, seed)
    off = {"window_left": -1, "q_len": 1}   # the values that leave a feature off (sinks: None)
    options = {k: v for k, v in (("window_left", window), ("q_len", q_len), ("sinks", sinks))
               if v is not None and (k not in off or v != off[k])}
    lacks = [k for k in options if k not in info(engine).options]
    if lacks:
        with pytest.raises(ValueError, match=rf"takes no option\(s\) {re.escape(str(lacks))}") as e:
            make_engine(engine, cache, **options)
        assert "\n" not in str(e.value)
        pytest.skip(f"{engine} refuses {lacks}: {e.value}")
    try:
        e = make_engine(engine, cache, **options)
        out = e.run(q, e.prepare(step))
        torch.cuda.synchronize()
    except (ValueError, RuntimeError, NotImplementedError) as err:
        pytest.skip(f"{engine} does not run {sorted(options)}: {str(err).splitlines()[0][:200]}")
    ids = torch.as_tensor(step.request_ids, device="cuda")
    ref = attention_reference(q, cache.kv, cache.block_table[ids], torch.as_tensor(step.seq_lens), q_len=q_len,
                              window_left=window, sinks=sinks)
    check(out, ref, "float16", f"{engine} {name}")
