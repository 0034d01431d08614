"""The public decode API (pkv.api) on the CPU: the op runs the kernel's split rule through
the FP32 oracle, so every layout, option and refusal is tested here against the plain
FP32 reference (and SDPA), the fake kernel under torch.compile(fullgraph=True), the
serving structure (a wrapper per bucket, 4 layers with their own vLLM-layout KV, one
upload per step over a ragged trace), and the README's example as written. The GPU twin
is tests/gpu/test_api_gpu.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from api_cases import in_layout, make_case
from pkv.api import LAYOUTS, DecodeWrapper, decode, make_workspace
from pkv.api.op import paged_decode
from pkv.core.fp8 import quantize
from pkv.kernels.reference import attention_reference

REPO = Path(__file__).resolve().parents[1]
LENS = [1, 17, 0, 300, 1500]   # direct rows, a padding row, rows the oracle splits over CTAs and merges
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def make(lens=LENS, hq=8, hkv=2, d=64, p=16, dtype=torch.float16, seed=0):
    """kv (ours), a block table of shuffled pages, seq_lens and q."""
    return make_case(lens, hq, hkv, d, p, dtype, seed)


def compare(out, ref, lens, dtype=torch.float16):
    rows = torch.as_tensor(np.asarray(lens) > 0)
    err = (out[rows].float() - ref[rows]).abs().max().item()
    assert err < TOL[dtype], err
    assert torch.isnan(out[~rows]).all(), "a padding row was written"


def poisoned(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("pair", [False, True], ids=["tensor", "pair"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_reads_in_place(layout, pair):
    kv, table, lens, q = make(seed=len(layout) + pair)
    cache = in_layout(kv, layout, pair)
    out = decode(q, cache, table, lens, layout=layout, out=poisoned(q))
    compare(out, attention_reference(q, kv, table, lens), LENS)


def test_views_are_views_not_copies():
    from pkv.api import kv_view

    for layout in LAYOUTS:
        for pair in (False, True):
            cache = in_layout(make()[0], layout, pair)
            view = kv_view(cache, layout)
            base = cache[0] if pair else cache
            assert view.k.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            assert view.k.stride(-1) == 1 and view.k.shape == (view.num_pages, 2, 16, 64)


def test_against_sdpa():
    kv, table, lens, q = make([700], hq=8, hkv=2)
    out = decode(q, in_layout(kv, "vllm", False), table, lens, layout="vllm", sm_scale=0.1)
    pages = table[0, :-(-700 // 16)].long()
    k = kv[pages, 0].transpose(0, 1).reshape(2, -1, 64)[:, :700].float()   # [Hkv, n, D]
    v = kv[pages, 1].transpose(0, 1).reshape(2, -1, 64)[:, :700].float()
    ref = torch.nn.functional.scaled_dot_product_attention(q.float().view(1, 8, 1, 64), k[None], v[None], scale=0.1,
                                                           enable_gqa=True)
    assert (out.float() - ref.view(1, 8, 64)).abs().max() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sm_scale,cap", [(None, None), (0.05, None), (None, 2.0), (0.3, 30.0)])
def test_scale_cap_lse_out(dtype, sm_scale, cap):
    kv, table, lens, q = make(dtype=dtype, seed=3)
    out = poisoned(q)
    res, lse = decode(q, in_layout(kv, "NHD", True), table, lens, layout="NHD", sm_scale=sm_scale,
                      logits_soft_cap=cap, out=out, return_lse=True)
    assert res is out and lse.dtype == torch.float32 and lse.shape == (len(LENS), 8)
    ref, ref_lse = attention_reference(q, kv, table, lens, sm_scale=sm_scale, soft_cap=cap or 0.0, return_lse=True)
    compare(out, ref, LENS, dtype)
    rows = lens > 0
    assert (lse[rows] - ref_lse[rows]).abs().max() < 1e-4
    if cap:  # the cap changes the answer: the option is really applied
        assert (attention_reference(q, kv, table, lens, sm_scale=sm_scale)[rows] - ref[rows]).abs().max() > 1e-3


def test_lse_is_the_natural_log_of_the_softmax_denominator():
    kv, table, lens, q = make([40], seed=4)
    _, lse = decode(q, kv, table, lens, return_lse=True)
    k = kv[table[0, :3].long(), 0].transpose(0, 1).reshape(2, -1, 64)[:, :40].float()
    s = q.float().view(2, 4, 64) @ k.transpose(1, 2) / 8.0
    assert torch.allclose(lse.view(2, 4), torch.log(torch.exp(s).sum(-1)), atol=1e-4)


@pytest.mark.parametrize("layout", ["HND", "vllm"])
def test_fp8_scales_per_call(layout):
    kv, table, lens, q = make(seed=5)
    kv8, scales = quantize(kv, "tensor")
    for factor in (1.0, 2.0):   # the same bytes read with other scales
        ks, vs = scales.k_scale * factor, scales.v_scale / factor
        values = kv8.float() * torch.tensor([ks, vs]).view(1, 2, 1, 1, 1)
        out = decode(q, in_layout(kv8, layout, False), table, lens, layout=layout, k_scale=ks, v_scale=vs,
                     out=poisoned(q))
        compare(out, attention_reference(q, values, table, lens), LENS)


def _refusal_cases():
    kv, table, lens, q = make([40, 9], seed=6)
    nhd = in_layout(kv, "NHD", False)
    wide = torch.zeros(kv.shape[:-1] + (68,), dtype=kv.dtype)
    f32 = torch.zeros(2, 8, 64)
    cases = {
        "layout name": (lambda: decode(q, kv, table, lens, layout="nhd"), "layout must be one of"),
        "NHD read as HND": (lambda: decode(q, nhd, table, lens, num_kv_heads=2, page_size=16),
                            "read as HND.*16 KV heads and pages of 2.*'NHD' or 'HND'"),
        "vllm rank": (lambda: decode(q, kv, table, lens, layout="vllm"), r"vllm must be \[2, blocks, P, Hkv, D\]"),
        "one K tensor": (lambda: decode(q, kv[:, 0], table, lens), r"pass K and V as a pair"),
        "three tensors": (lambda: decode(q, (kv, kv, kv), table, lens), "two tensors"),
        "K, V shapes": (lambda: decode(q, (kv[:, 0], kv[:-1, 1]), table, lens), "of one shape"),
        "K, V dtypes": (lambda: decode(q, (kv[:, 0], kv[:, 1].bfloat16()), table, lens), "share dtype"),
        "not a tensor": (lambda: decode(q, kv.numpy(), table, lens), "tensor or a .K, V. pair"),
        "q rank": (lambda: decode(q[0], kv, table, lens), r"q must be \[batch"),
        "q dtype": (lambda: decode(f32, kv, table, lens), "float16 or bfloat16"),
        "kv dtype": (lambda: decode(q, kv.bfloat16(), table, lens), "q's dtype"),
        "head_dim": (lambda: decode(torch.zeros(2, 8, 32).half(), kv, table, lens), "head_dim 32"),
        "heads": (lambda: decode(torch.zeros(2, 7, 64).half(), kv, table, lens), "not a multiple"),
        "group": (lambda: decode(torch.zeros(2, 34, 64).half(), kv, table, lens), "GQA groups 1..16"),
        "unsupported head_dim": (lambda: decode(torch.zeros(2, 8, 96).half(), torch.zeros(4, 2, 2, 16, 96).half(),
                                                table, lens), r"head_dim \(64, 128, 256\)"),
        "page size": (lambda: decode(q, torch.zeros(4, 2, 2, 12, 64).half(), table, lens), "power of two"),
        "device": (lambda: decode(q, kv, table.to("meta"), lens), "one device"),
        "last dim strided": (lambda: decode(q, torch.zeros(5, 2, 2, 64, 16).half().transpose(3, 4), table, lens),
                             "must be contiguous"),
        "16-byte strides": (lambda: decode(q, wide[..., :64], table, lens), "16-byte boundary"),
        "table dtype": (lambda: decode(q, kv, table.long(), lens), "block_table must be int32"),
        "table rows": (lambda: decode(q, kv, table[:1], lens), r"block_table must be int32 \[batch=2"),
        "table strided": (lambda: decode(q, kv, torch.zeros(9, 2, dtype=torch.int32).t(), lens), "contiguous"),
        "table numpy": (lambda: decode(q, kv, table.numpy(), lens), "block_table must be a torch.Tensor"),
        "lens dtype": (lambda: decode(q, kv, table, lens.long()), "seq_lens must be int32"),
        "lens length": (lambda: decode(q, kv, table, lens[:1]), r"seq_lens must be int32 \[batch=2"),
        "out dtype": (lambda: decode(q, kv, table, lens, out=f32), "out must be a contiguous"),
        "out shape": (lambda: decode(q, kv, table, lens, out=q[:1].clone()), "out must be a contiguous"),
        "scale": (lambda: decode(q, kv, table, lens, sm_scale=0.0), "sm_scale must be finite and > 0"),
        "cap": (lambda: decode(q, kv, table, lens, logits_soft_cap=-1.0), "logits_soft_cap finite and >= 0"),
        "scales on 16-bit": (lambda: decode(q, kv, table, lens, k_scale=0.5), "read an FP8 cache"),
        "rows": (lambda: decode(torch.zeros(1025, 8, 64).half(), kv, torch.zeros(1025, 3, dtype=torch.int32),
                                torch.zeros(1025, dtype=torch.int32)), "1..1024 rows"),
        "seq_len past the table": (lambda: decode(q, kv, table, torch.tensor([40, 49], dtype=torch.int32)),
                                   r"seq_lens must be in 0..48"),
        "page id past the cache": (lambda: decode(q, kv, table + 100, lens), "page ids"),
        "workspace": (lambda: paged_decode(q, kv[:, 0], kv[:, 1], table, lens, make_workspace(1, 8, 2, 64, "cpu"),
                                           q.clone(), None, 0.125, 0.0, 1.0, 1.0), "workspace holds 1 rows"),
    }
    return cases


CASES = _refusal_cases()


@pytest.mark.parametrize("case", list(CASES))
def test_each_refusal_is_one_value_error(case):
    call, message = CASES[case]
    with pytest.raises(ValueError, match=message):
        call()


def test_wrapper_refusals():
    kv, table, lens, q = make([40, 9], seed=7)
    w = DecodeWrapper(2, 3, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, device="cpu")
    with pytest.raises(ValueError, match=r"seq_lens \[b <= 2\]"):
        w.update(np.zeros((3, 3), np.int32), np.ones(3, np.int32))
    with pytest.raises(ValueError, match=r"block_table \[b, <= 3\]"):
        w.update(np.zeros((2, 4), np.int32), np.ones(2, np.int32))
    with pytest.raises(ValueError, match="seq_lens must be in 0..48"):
        w.update(table.numpy(), np.array([40, 49]))
    for dtype in ("<i8", ">i4", "i1"):   # one unsigned reduction checks both bounds, any byte order
        with pytest.raises(ValueError, match=r"seq_lens must be in 0..48 .*got -1..40"):
            w.update(table.numpy(), np.array([40, -1], dtype=dtype))
    w.update(table.numpy(), np.array([40, 9], dtype=">i4"))   # big-endian lengths are read as numbers
    assert w.seq_lens.tolist() == [40, 9]
    with pytest.raises(ValueError, match="integers"):
        w.update(table.numpy(), np.array([4.0, 9.0]))
    w.update(table, lens)
    with pytest.raises(ValueError, match=r"q \[1..2, 8, 64\]"):
        w.run(torch.zeros(3, 8, 64).half(), kv)
    with pytest.raises(ValueError, match="'NHD' or 'HND'"):
        w.run(q, in_layout(kv, "NHD", False))
    with pytest.raises(ValueError, match=r"q \[1..2, 8, 64\], got \[2, 4, 64\]"):   # heads, not a capacity error
        w.run(q[:, :4].contiguous(), kv)
    with pytest.raises(ValueError, match="made for torch.float16 queries, got torch.bfloat16"):
        w.run(q.bfloat16(), kv)
    with pytest.raises(ValueError,
                       match="made for a torch.float16 KV cache, the layer's KV cache is torch.float8_e4m3fn"):
        w.run(q, kv.to(torch.float8_e4m3fn))
    w8 = DecodeWrapper(2, 3, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, kv_fp8=True, device="cpu")
    w8.update(table, lens)
    with pytest.raises(ValueError, match=r"made for an FP8 \(e4m3\) KV cache \(kv_fp8=True\), "
                                         r"the layer's KV cache is torch.float16"):
        w8.run(q, kv)
    with pytest.raises(ValueError, match="layout must be one of"):
        DecodeWrapper(2, 3, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, layout="paged", device="cpu")
    with pytest.raises(ValueError, match="GQA groups"):
        DecodeWrapper(2, 3, num_qo_heads=64, num_kv_heads=2, head_dim=64, page_size=16, device="cpu")
    with pytest.raises(ValueError, match="1..1024 rows"):
        DecodeWrapper(2000, 3, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, device="cpu")


class Attention(torch.nn.Module):
    def forward(self, x, kv, table, lens):
        q = x * 0.5   # an op of the model around the decode
        out, lse = decode(q, kv, table, lens, layout="vllm", logits_soft_cap=5.0, return_lse=True)
        return out.float() + 1.0, lse


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_module_with_fullgraph(backend):
    kv, table, lens, q = make(seed=8)
    cache = in_layout(kv, "vllm", False)
    eager = Attention()(q, cache, table, lens)
    compiled = torch.compile(Attention(), fullgraph=True, backend=backend)(q, cache, table, lens)
    rows = lens > 0
    assert torch.equal(compiled[0][rows], eager[0][rows]) and torch.equal(compiled[1][rows], eager[1][rows])
    ref = attention_reference(q * 0.5, kv, table, lens, soft_cap=5.0)
    assert (compiled[0][rows] - 1.0 - ref[rows]).abs().max() < 2e-3


def test_compiled_with_dynamic_batch_and_through_the_wrapper():
    kv, table, lens, q = make(seed=13)
    cache = in_layout(kv, "vllm", False)
    compiled = torch.compile(Attention(), fullgraph=True, backend="aot_eager", dynamic=True)
    for b in (5, 3, 2):   # one graph for every batch size
        out, _ = compiled(q[:b], cache, table[:b], lens[:b])
        rows = lens[:b] > 0
        ref = attention_reference(q[:b] * 0.5, kv, table[:b], lens[:b], soft_cap=5.0)
        assert (out[rows] - 1.0 - ref[rows]).abs().max() < 2e-3
    w = DecodeWrapper(8, table.shape[1], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, layout="vllm",
                      device="cpu")
    w.update(table, lens)
    layer = torch.compile(lambda x, c: w.run(x * 1.0, c, return_lse=True), fullgraph=True, backend="aot_eager")
    out, lse = layer(q, cache)
    ref, ref_lse = attention_reference(q, kv, table, lens, return_lse=True)
    compare(torch.where(torch.as_tensor(lens > 0)[:, None, None], out, float("nan")), ref, LENS)
    assert (lse[lens > 0] - ref_lse[lens > 0]).abs().max() < 1e-4


def test_the_fake_kernel_refuses_at_trace_time():
    kv, table, lens, q = make(seed=9)
    with pytest.raises(Exception, match="pkv decode: the KV cache must be q's dtype"):
        torch.compile(Attention(), fullgraph=True, backend="aot_eager")(q, in_layout(kv.bfloat16(), "vllm", False),
                                                                        table, lens)


def test_opcheck_schema_and_fake_kernel():
    kv, table, lens, q = make(seed=10)
    args = (q, kv[:, 0], kv[:, 1], table, lens, make_workspace(8, 8, 2, 64, "cpu"), q.clone(),
            torch.zeros(len(LENS), 8), 0.125, 3.0, 1.0, 1.0)
    torch.library.opcheck(torch.ops.pkv_api.paged_decode.default, args)


def test_serving_step_per_bucket():
    """A wrapper per bucket (2, 4, 8), 4 layers with their own KV in vLLM's layout, one upload per
    step shared by the layers, over a ragged trace whose steps pick the smallest bucket that fits."""
    layers, hq, hkv, d, p, num_pages, width = 4, 8, 2, 64, 16, 96, 24
    gen = torch.Generator().manual_seed(11)
    kvs = [torch.randn(2, num_pages, p, hkv, d, generator=gen).half() for _ in range(layers)]
    ours = [kv.transpose(0, 1).transpose(2, 3) for kv in kvs]
    wrappers = {b: DecodeWrapper(b, width, num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=p,
                                 layout="vllm", device="cpu") for b in (2, 4, 8)}
    uploads = []
    for w in wrappers.values():
        real = w._staging.send      # every host-to-device copy of the staging ring goes through send()
        w._staging.send = lambda total, out=None, real=real: uploads.append(1) or real(total, out=out)
    rng = np.random.default_rng(11)
    for t in range(8):
        b = [1, 2, 3, 8, 5, 4, 7, 2][t]
        lens = rng.integers(1, width * p + 1, size=b).astype(np.int32)
        table = np.stack([rng.choice(num_pages, size=width, replace=False) for _ in range(b)]).astype(np.int32)
        bucket = min(k for k in wrappers if k >= b)
        w = wrappers[bucket]
        before = len(uploads)
        w.update(table, lens)
        queries = [torch.randn(bucket, hq, d, generator=gen).half()]
        outs = torch.full((layers, bucket, hq, d), float("nan"), dtype=torch.float16)
        for i in range(layers):
            w.run(queries[i], kvs[i], out=outs[i])
            queries.append(outs[i].nan_to_num())   # the next layer's query comes from this one's output
        assert len(uploads) - before == 1, "one metadata upload per step, shared by every layer"
        for i in range(layers):
            ref = attention_reference(queries[i][:b], ours[i], torch.as_tensor(table), torch.as_tensor(lens))
            assert (outs[i, :b].float() - ref).abs().max() < 2e-3, f"step {t} layer {i}"
            assert torch.isnan(outs[i, b:]).all(), f"step {t} layer {i}: a padding row was written"


def test_wrapper_takes_device_tensors_too():
    kv, table, lens, q = make(seed=12)
    w = DecodeWrapper(8, table.shape[1], num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, device="cpu")
    w.update(table, lens)
    out = w.run(torch.cat([q, q[:3]]), kv, out=torch.full((8, 8, 64), float("nan"), dtype=torch.float16))
    compare(out[:len(LENS)], attention_reference(q, kv, table, lens), LENS)
    assert torch.isnan(out[len(LENS):]).all()


def readme_example() -> str:
    section = (REPO / "README.md").read_text().split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written():
    scope: dict = {}
    exec(compile(readme_example(), "README.md", "exec"), scope)
    assert scope["out"].shape == scope["q"].shape and torch.isfinite(scope["out"]).all()
    assert torch.isfinite(scope["lse"]).all()


def test_the_readme_api_section_is_short():
    section = (REPO / "README.md").read_text().split("\n## API\n", 1)[1].split("\n## ", 1)[0]
    assert len([line for line in section.splitlines() if line.strip()]) <= 10


def test_importing_the_api_needs_no_pipeline_package():
    probe = ("import sys; import pkv.api; heavy = ('pandas', 'pyarrow', 'snakemake', 'seaborn', 'matplotlib', "
             "'tabulate'); print(sorted(m for m in heavy if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


def _wrapper(**kw) -> DecodeWrapper:
    return DecodeWrapper(2, 3, num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, device="cpu", **kw)


def test_a_narrower_cpu_tensor_table_is_refused_as_the_same_numpy_step_is():
    """A step whose lengths reach past its table's width would read the earlier step's page ids."""
    kv, table, lens, q = make([40, 9], seed=8)
    w = _wrapper()
    w.update(table, lens)
    narrow, long = table[:, :1].contiguous(), torch.tensor([40, 9], dtype=torch.int32)
    for step in ((narrow, long), (narrow.numpy(), long.numpy())):
        with pytest.raises(ValueError, match=r"seq_lens must be in 0..16 \(block_table width"):
            w.update(*step)


@pytest.mark.parametrize("to", [torch.tensor, np.array], ids=["tensor", "numpy"])
def test_ids_and_lengths_past_int32_are_refused_not_truncated(to):
    kv, table, lens, q = make([40, 9], seed=9)
    w = _wrapper()
    wide = table.long()
    wide[0, 0] = 2**32 + 3
    with pytest.raises(ValueError, match=r"page ids must be in 0..2147483647, got .*4294967299"):
        w.update(to(wide.numpy()), to(lens.numpy()))
    with pytest.raises(ValueError, match=r"seq_lens must be in 0..48"):
        w.update(to(table.numpy()), to(np.array([2**32 + 3, 9], dtype=np.int64)))
    with pytest.raises(ValueError, match=r"page ids must be in 0..2147483647"):
        w.update(to(table.numpy().astype(np.uint32) | np.uint32(2**31)), to(lens.numpy()))
    w.update(to(table.numpy().astype(np.int64)), to(lens.numpy().astype(np.int64)))   # int64 in range is fine
    assert w.block_table[:, :3].tolist() == table.tolist()


def test_bool_tensors_are_refused():
    kv, table, lens, q = make([40, 9], seed=10)
    w = _wrapper()
    with pytest.raises(ValueError, match="must be integers, got .*bool"):
        w.update(table, torch.tensor([True, True]))
    with pytest.raises(ValueError, match="must be integers, got bool"):
        w.update(table.bool(), lens)


@pytest.mark.parametrize("option", [{"logits_soft_cap": float("inf")}, {"sm_scale": float("inf")},
                                    {"sm_scale": float("nan")}, {"k_scale": float("inf")}, {"v_scale": -1.0}])
def test_a_non_finite_scale_or_cap_is_refused_not_all_nan(option):
    kv, table, lens, q = make([40, 9], seed=11)
    if "k_scale" in option or "v_scale" in option:
        kv = kv.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must be finite"):
        decode(q, kv, table, lens, **option)
    w = _wrapper(kv_fp8=kv.dtype == torch.float8_e4m3fn)
    w.update(table, lens)
    with pytest.raises(ValueError, match="must be finite"):
        w.run(q, kv, **option)


def test_padding_rows_of_an_allocated_result_are_zeros_and_run_needs_an_update():
    kv, table, lens, q = make([40, 0], seed=12)
    w = _wrapper()
    with pytest.raises(ValueError, match=r"run\(\) before any update\(\)"):
        w.run(q, kv)
    w.update(table[:1], lens[:1])   # one row: q's second row is padding
    out, lse = w.run(q, kv, return_lse=True)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all() and torch.isfinite(lse[0]).all()
    out, lse = decode(q, kv, table, lens, return_lse=True)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    compare(out[:1], attention_reference(q[:1], kv, table[:1], lens[:1]), [40])


def test_the_example_prints_what_it_computed():
    """examples/decode.py prints each row's output and its error against plain attention."""
    done = subprocess.run([sys.executable, str(REPO / "examples" / "decode.py")], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = re.findall(r"max \|out - reference\| = (\S+), max \|lse - reference\| = (\S+)", done.stdout)
    assert len(rows) == 2 and all(float(o) < TOL[torch.float16] and float(s) < 1e-4 for o, s in rows), done.stdout
    assert "decode on cpu: out (2, 32, 128) torch.float16, lse (2, 32) torch.float32" in done.stdout
