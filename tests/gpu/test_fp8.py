"""pkv-graph over an FP8 (e4m3) KV cache (needs a GPU).

Two checks per case, on fresh random K, V, Q with poisoned outputs and partial workspace:

1. The kernel against the FP32 reference over the *dequantized* cache (the values the
   kernel is given), at the 16-bit kernels' tolerance (test_kernels.TOL): the FP8 path
   may add no error of its own beyond the fp16 rounding of P and of bf16 queries.
2. The kernel against the FP32 reference over the *original 16-bit* cache, within the
   worst-case bound of e4m3 rounding (`quantization_bound`): an element x is stored as
   x(1 + d), |d| <= E4M3_STEP / 2 = 2^-4 for normals, plus at most half a subnormal step
   (2^-10 of its scale) near zero. Then each score moves by at most
   eps = sum_d |q_d| (2^-4 |k_d| + 2^-10 s_k) / sqrt(D), so the softmax weights by a factor
   within exp(+-2 eps), and the output by at most
   (exp(2 eps) - 1) max|v| + 2^-4 max|v| + 2^-10 s_v.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_graph import replay_and_check, replay_case, run_graph

from pkv.core.fp8 import E4M3_STEP
from pkv.core.shape import Shape
from pkv.core.units import K
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference
from test_kernels import TOL, make_case, seed_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
SUBNORMAL_HALF_STEP = 2.0 ** -10   # half of e4m3's subnormal spacing 2^-9, in units of the scale


def fp8_case(lens, policy, seed, outliers=0.0, **shape):
    cache16, step, q = make_case(lens, seed=seed, **shape)
    if outliers:  # a few K channels `outliers` times larger, as real K caches have
        ch = torch.as_tensor(np.random.default_rng(seed).choice(cache16.shape.head_dim, 4, replace=False),
                             device="cuda")
        cache16.kv[:, 0, :, :, ch] *= outliers
    return cache16, cache16.quantized(policy), step, q


def reference_over(kv, cache, step, q):
    ids = torch.as_tensor(step.request_ids, device="cuda")
    return attention_reference(q, kv, cache.block_table[ids], torch.as_tensor(step.seq_lens))


def quantization_bound(q, cache16, cache8, step) -> torch.Tensor:
    """Per (row, qo head): the worst-case output error e4m3 rounding allows (module docstring)."""
    d = q.shape[-1]
    per = cache8.scales.per_page().to(q.device)            # [pages or 1, 2, Hkv]
    s_k, s_v = per[:, 0].max().item(), per[:, 1].max().item()
    delta = E4M3_STEP / 2
    bound = torch.empty(q.shape[:2], device=q.device)
    g = cache16.shape.group
    for i, (rid, n) in enumerate(zip(step.request_ids, step.seq_lens)):
        pages = cache16.block_table[int(rid)][(torch.arange(int(n), device=q.device) // cache16.shape.page_size)].long()
        t = torch.arange(int(n), device=q.device) % cache16.shape.page_size
        k = cache16.kv[pages, 0, :, t].float().abs()          # [n, Hkv, D]
        v_max = cache16.kv[pages, 1, :, t].float().abs().amax(dim=(0, 2))   # [Hkv]
        qa = q[i].float().abs().view(-1, g, d)                 # [Hkv, G, D]
        eps = (torch.einsum("hgd,nhd->hgn", qa, delta * k + SUBNORMAL_HALF_STEP * s_k).amax(-1)) / math.sqrt(d)
        out = (torch.expm1(2 * eps) + delta) * v_max[:, None] + SUBNORMAL_HALF_STEP * s_v
        bound[i] = out.reshape(-1)
    return bound


CASES = {  # name: (lengths, shape overrides)
    "1": ([1], {}), "31": ([31], {}), "33": ([33], {}), "8K+7": ([8 * K + 7], {}), "32K": ([32 * K], {}),
    "100K": ([100 * K + 3], {}), "many-short": ("many", {}), "bimodal": ("bimodal", {}),
    "G1": ([5000, 77], {"group": 1}), "G5": ([3001, 12000], {"group": 5}), "G8": ([9000], {"group": 8}),
    "G16": ([4100, 33], {"group": 16}), "d64": ([7000, 300], {"head_dim": 64}),
    "d64-G7": ([2049], {"head_dim": 64, "group": 7}), "page64": ([6000, 17], {"page_size": 64}),
    "bf16": ([9000, 129], {"dtype": "bfloat16"}), "bf16-G16": ([5000], {"dtype": "bfloat16", "group": 16}),
}


def lens_of(v, rng):
    if v == "many":
        return rng.integers(1, 2 * K, size=67).tolist()
    if v == "bimodal":
        return rng.choice([300, 17 * K], size=9).tolist()
    return v


def check_fp8(out, cache16, cache8, step, q, what):
    assert torch.isfinite(out).all(), f"{what}: unwritten or non-finite output"
    max_tol, mean_tol = TOL[cache16.shape.dtype]
    err = (out.float() - reference_over(cache8.values(), cache8, step, q)).abs()
    assert err.max().item() < max_tol and err.mean().item() < mean_tol, \
        f"{what}: against the dequantized cache max|e| {err.max().item():.2e} mean|e| {err.mean().item():.2e}"
    err16 = (out.float() - reference_over(cache16.kv, cache16, step, q)).abs().amax(-1)   # [B, Hq]
    bound = quantization_bound(q, cache16, cache8, step) + max_tol
    worst = (err16 / bound).max().item()
    assert worst <= 1.0, f"{what}: error against the 16-bit cache reaches {worst:.2f} of e4m3's bound"


@pytest.mark.parametrize("policy", ["tensor", "page"])
@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cases(name, policy):
    seed = seed_of("fp8", name, policy)
    lens, shape = CASES[name]
    cache16, cache8, step, q = fp8_case(lens_of(lens, np.random.default_rng(seed)), policy, seed, **shape)
    out = run_graph(make_engine("pkv-graph", cache8), step, q)
    check_fp8(out, cache16, cache8, step, q, f"fp8 {policy} {name}")


@pytest.mark.parametrize("outliers", [10.0, 100.0])
@pytest.mark.parametrize("policy", ["tensor", "page"])
def test_fp8_outlier_channels(policy, outliers):
    seed = seed_of("fp8-outliers", policy, outliers)
    cache16, cache8, step, q = fp8_case([12000, 700, 3], policy, seed, outliers=outliers)
    out = run_graph(make_engine("pkv-graph", cache8), step, q)
    check_fp8(out, cache16, cache8, step, q, f"fp8 {policy} outliers x{outliers}")


@pytest.mark.parametrize("page_size", [1, 8])
def test_small_pages_take_tensor_scales(page_size):
    seed = seed_of("fp8-small-page", page_size)
    cache16, cache8, step, q = fp8_case([3000, 41], "tensor", seed, page_size=page_size)
    out = run_graph(make_engine("pkv-graph", cache8), step, q)
    check_fp8(out, cache16, cache8, step, q, f"fp8 tensor page {page_size}")
    with pytest.raises(ValueError, match="per-page FP8 scales"):
        make_engine("pkv-graph", cache16.quantized("page"))


def test_refused_combinations():
    cache16, _, _ = make_case([100], seed=3, head_dim=256, group=2)
    with pytest.raises(ValueError, match="FP8 cache for head_dim"):
        make_engine("pkv-graph", cache16.quantized("tensor"))
    cache16, cache8, _, _ = fp8_case([100], "tensor", 4)
    with pytest.raises(ValueError, match="does not read an FP8 KV cache"):
        make_engine("pkv-workqueue", cache8)


def test_fp8_graph_replay():
    """One capture, replayed while rows join and leave, over an FP8 cache with page factors."""
    seed = seed_of("fp8-replay")
    cache16, steps = replay_case(seed, Shape(16, 4, 128, 16, "float16"))
    cache8 = cache16.quantized("page")
    replay_and_check(cache8, steps, seed,
                     lambda t, out, step, q: check_fp8(out, cache16, cache8, step, q, f"replay step {t}"))
