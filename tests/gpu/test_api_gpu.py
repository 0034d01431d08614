"""The public decode API (pkv.api) on the GPU against the FP32 reference (needs a GPU).

Every layout is read in place through strided views (separate K and V allocations too),
options (scale, soft cap, LSE, out=, FP8 scales per call) on both the direct-write and
the merged paths (short and long rows), and the serving shape: a wrapper per bucket, 4
layers with their own vLLM-layout KV and options, one upload per step, one CUDA graph per
bucket replayed over a ragged trace. Outputs are
poisoned with NaN first; rows of length 0 must stay untouched. (The CPU twin is
tests/test_api.py; this file has its own basename so both collect.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from api_cases import in_layout, make_case
from pkv.api import DecodeWrapper, decode
from pkv.core.fp8 import quantize
from pkv.core.units import K
from pkv.kernels.reference import attention_reference
from test_kernels import check, seed_of

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
LENS = [1, 17, 0, 300, 9 * K + 5, 40 * K]   # direct rows, a padding row, and rows the kernel splits and merges
LSE_TOL = 2e-3


def make(lens, hq=32, hkv=8, d=128, p=16, dtype=torch.float16, seed=0):
    """kv (ours), a block table of shuffled pages, seq_lens and q, all on the GPU."""
    return make_case(lens, hq, hkv, d, p, dtype, seed, device="cuda")


def compare(out, ref, lens, dtype, what, lse=None, ref_lse=None):
    rows = torch.as_tensor(np.asarray(lens) > 0, device=out.device)
    check(out[rows], ref[rows], dtype, what)
    assert torch.isnan(out[~rows]).all(), f"{what}: a padding row was written"
    if lse is not None:
        err = (lse[rows] - ref_lse[rows]).abs().max().item()
        assert err < LSE_TOL, f"{what}: lse max|e| {err:.2e}"


def poisoned(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("pair", [False, True], ids=["tensor", "pair"])
@pytest.mark.parametrize("layout", ["HND", "NHD", "vllm"])
def test_every_layout(layout, pair):
    kv, table, lens, q = make(LENS, seed=seed_of("api-layout", layout, pair))
    out = decode(q, in_layout(kv, layout, pair), table, lens, layout=layout, out=poisoned(q))
    compare(out, attention_reference(q, kv, table, lens.cpu()), LENS, "float16", f"{layout} {pair}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("sm_scale,cap", [(None, None), (0.05, None), (None, 2.0), (0.3, 30.0)])
def test_scale_cap_lse_out(dtype, sm_scale, cap):
    dt = getattr(torch, dtype)
    kv, table, lens, q = make(LENS, dtype=dt, seed=seed_of("api-options", dtype, sm_scale, cap))
    out = poisoned(q)
    res, lse = decode(q, in_layout(kv, "NHD", False), table, lens, layout="NHD", sm_scale=sm_scale,
                      logits_soft_cap=cap, out=out, return_lse=True)
    assert res is out
    ref, ref_lse = attention_reference(q, kv, table, lens.cpu(), sm_scale=sm_scale, soft_cap=cap or 0.0,
                                       return_lse=True)
    compare(out, ref, LENS, dtype, f"{dtype} scale {sm_scale} cap {cap}", lse, ref_lse)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fp8_scales_per_call(layout):
    kv, table, lens, q = make(LENS, d=128, seed=seed_of("api-fp8", layout))
    kv8, scales = quantize(kv, "tensor")
    for factor in (1.0, 2.0):   # the same bytes read with other scales: the scales are per call
        ks, vs = scales.k_scale * factor, scales.v_scale / factor
        values = kv8.float() * torch.tensor([ks, vs], device="cuda").view(1, 2, 1, 1, 1)
        out, lse = decode(q, in_layout(kv8, layout, True), table, lens, layout=layout, k_scale=ks, v_scale=vs,
                          out=poisoned(q), return_lse=True)
        ref, ref_lse = attention_reference(q, values, table, lens.cpu(), return_lse=True)
        compare(out, ref, LENS, "float16", f"fp8 {layout} x{factor}", lse, ref_lse)


@pytest.mark.parametrize("head_dim,group,page", [(64, 8, 16), (64, 1, 1), (256, 2, 16), (128, 16, 64), (128, 5, 32)])
def test_head_dims_groups_pages(head_dim, group, page):
    kv, table, lens, q = make(LENS, hq=2 * group, hkv=2, d=head_dim, p=page, dtype=torch.bfloat16,
                              seed=seed_of("api-dims", head_dim, group, page))
    out = decode(q, in_layout(kv, "vllm", False), table, lens, layout="vllm", out=poisoned(q), logits_soft_cap=10.0)
    ref = attention_reference(q, kv, table, lens.cpu(), soft_cap=10.0)
    compare(out, ref, LENS, "bfloat16", f"d{head_dim} G{group} P{page}")


# Each layer of the serving test calls run() with its own options, inside the captured graph.
LAYER_OPTIONS = [{}, {"return_lse": True}, {"sm_scale": 0.05, "logits_soft_cap": 20.0}, {"sm_scale": 0.1}]


def test_serving_step_in_one_cuda_graph():
    """A wrapper per bucket (2, 4, 8), each with one captured graph of 4 layers' decode (each
    layer its own KV in vLLM's layout and its own options: LSE, scale, soft cap), one metadata
    upload per step shared by the layers, replayed over a ragged trace whose steps take the
    smallest bucket that fits."""
    layers, hkv, d, p, hq = len(LAYER_OPTIONS), 4, 128, 16, 16
    rng = np.random.default_rng(seed_of("api-serving"))
    num_pages, width = 1400, 12 * K // p
    gen = torch.Generator(device="cuda").manual_seed(7)
    kvs = [torch.randn(2, num_pages, p, hkv, d, generator=gen, device="cuda").half() for _ in range(layers)]
    ours = [kv.transpose(0, 1).transpose(2, 3) for kv in kvs]   # [pages, 2, Hkv, P, D] views for the reference
    buckets = {}
    for bucket in (2, 4, 8):
        w = DecodeWrapper(bucket, width, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
                          layout="vllm", device="cuda")
        qs = torch.randn(layers, bucket, hq, d, generator=gen, device="cuda").half()
        buckets[bucket] = {"wrapper": w, "qs": qs, "outs": torch.empty_like(qs)}
    uploads = []
    for c in buckets.values():
        real = c["wrapper"]._staging.send   # every host-to-device copy of update() goes through send()
        c["wrapper"]._staging.send = lambda total, out=None, real=real: uploads.append(1) or real(total, out=out)

    def step_body(c):
        lse = None
        for i, options in enumerate(LAYER_OPTIONS):
            got = c["wrapper"].run(c["qs"][i], kvs[i], out=c["outs"][i], **options)
            lse = got[1] if options.get("return_lse") else lse   # an LSE allocated in the graph
        return lse

    def trace_step(t):
        b = [1, 2, 3, 8, 5, 4, 7, 2, 6, 1, 8, 3][t]
        lens = rng.integers(1, 12 * K, size=b)
        if t % 3 == 0:
            lens = rng.choice([1, 15, 16, 17, 33, 1024, 1025, 12 * K], size=b)
        table = np.stack([rng.choice(num_pages, size=width, replace=False) for _ in range(b)]).astype(np.int32)
        return lens.astype(np.int32), table

    for bucket, c in buckets.items():   # warm-up off the capture (loads the kernels), then capture
        lens, table = trace_step(0)
        c["wrapper"].update(table[:bucket], lens[:bucket])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step_body(c)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        c["graph"] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(c["graph"]):
            c["lse"] = step_body(c)
    for t in range(12):
        lens, table = trace_step(t)
        b = len(lens)
        bucket = min(k for k in buckets if k >= b)
        c = buckets[bucket]
        before = len(uploads)
        c["wrapper"].update(table, lens)   # the step's one metadata upload, for every layer
        assert len(uploads) - before == 1, "one metadata upload per step, shared by every layer"
        c["qs"].copy_(torch.randn(layers, bucket, hq, d, generator=gen, device="cuda").half())
        c["outs"].fill_(float("nan"))
        c["graph"].replay()
        torch.cuda.synchronize()
        bt, sl = torch.as_tensor(table, device="cuda"), torch.as_tensor(lens)
        for i, options in enumerate(LAYER_OPTIONS):
            ref, ref_lse = attention_reference(c["qs"][i, :b], ours[i], bt, sl, sm_scale=options.get("sm_scale"),
                                               soft_cap=options.get("logits_soft_cap", 0.0), return_lse=True)
            check(c["outs"][i, :b], ref, "float16", f"step {t} B{bucket} layer {i}")
            assert torch.isnan(c["outs"][i, b:]).all(), f"step {t} layer {i}: a padding row was written"
            if options.get("return_lse"):
                err = (c["lse"][:b] - ref_lse).abs().max().item()
                assert err < LSE_TOL, f"step {t} B{bucket}: lse max|e| {err:.2e}"


def test_compiled_module_on_the_gpu():
    kv, table, lens, q = make([5, 3000, 20 * K], seed=seed_of("api-compile"))

    class Attn(torch.nn.Module):
        def forward(self, q, kv, table, lens):
            return decode(q * 1.0, kv, table, lens, logits_soft_cap=20.0)

    out = torch.compile(Attn(), fullgraph=True, backend="aot_eager")(q, kv, table, lens)
    check(out, attention_reference(q, kv, table, lens.cpu(), soft_cap=20.0), "float16", "compiled")


def test_misaligned_views_are_refused():
    kv, table, lens, q = make([40], d=64, seed=1)
    wide = torch.zeros(kv.shape[:-1] + (72,), dtype=kv.dtype, device="cuda")
    with pytest.raises(ValueError, match="16-byte boundar"):
        decode(q, wide[..., 1:65], table, lens)
    with pytest.raises(ValueError, match="one device"):
        decode(q, kv, table.cpu(), lens)
