"""FP8 (e4m3) KV cache on the CPU: the quantizer, the cache and shape, the FP8 reference path
(the CPU pkv-graph oracle over an FP8 cache), refusals, and the FP8 report tables."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from pkv.core.cache import PagedCache
from pkv.core.fp8 import E4M3, E4M3_MAX, E4M3_STEP, POLICIES, KvScales, dequantize, quantize, write_pages
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference


def kv(seed=0, pages=6, heads=2, page=16, d=32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(pages, 2, heads, page, d, generator=g) * scale


@pytest.mark.parametrize("policy", ["tensor", "page"])
def test_round_trip_within_half_a_step(policy):
    x = kv(1)
    x8, s = quantize(x, policy)
    assert x8.dtype == E4M3 and x8.shape == x.shape
    back = dequantize(x8, s)
    per = s.per_page()[..., None, None]
    # Normal e4m3 values round to within half a mantissa step; subnormals to half of 2^-9 of the scale.
    bound = (E4M3_STEP / 2) * x.abs() + 2.0 ** -10 * per
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


def test_tensor_scales_map_the_largest_value_to_448():
    x = kv(2)
    x8, s = quantize(x, "tensor")
    assert s.page_factors is None
    assert math.isclose(s.k_scale, x[:, 0].abs().max().item() / E4M3_MAX, rel_tol=1e-6)
    assert math.isclose(s.v_scale, x[:, 1].abs().max().item() / E4M3_MAX, rel_tol=1e-6)
    assert x8.float().abs().max().item() == E4M3_MAX


def test_page_factors_are_relative_and_at_most_one():
    x = kv(3)
    x[2, 0, 1] *= 0.01                                   # one quiet (page, K, head)
    x8, s = quantize(x, "page")
    f = s.page_factors
    assert f.shape == (6, 2, 2) and (f <= 1 + 1e-6).all() and (f > 0).all()
    assert f[2, 0, 1] < 0.05
    # Each (page, K/V, head) uses e4m3's whole range.
    assert torch.allclose(x8.float().abs().amax(dim=(3, 4)), torch.full((6, 2, 2), E4M3_MAX))


def test_page_factors_beat_tensor_scales_on_a_quiet_page():
    x = kv(4)
    x[0] *= 1e-6                                          # far below the rest: subnormal under tensor scales
    errs = {p: (dequantize(*quantize(x, p)) - x)[0].abs().max().item() for p in ("tensor", "page")}
    assert errs["page"] < errs["tensor"] / 10


def test_write_pages_keeps_tensor_scales_and_saturates():
    x = kv(5)
    x8, s = quantize(x, "tensor")
    new = kv(6, pages=2) * 1000                           # far past the cache's scales
    write_pages(x8, s, torch.tensor([1, 4]), new)
    assert torch.isfinite(x8.float()).all()               # saturated at +-448, never NaN
    assert x8[1].float().abs().max().item() == E4M3_MAX


def test_write_pages_sets_page_factors():
    x = kv(7)
    x8, s = quantize(x, "page")
    new = kv(8, pages=1) * 3
    write_pages(x8, s, torch.tensor([3]), new)
    back = dequantize(x8, s)[3]
    assert ((back - new[0]).abs() <= (E4M3_STEP / 2) * new[0].abs() + 1e-3).all()


@pytest.mark.parametrize("bad,match", [
    (torch.zeros(2, 3, 1, 4, 8), "num_pages, 2"),
    (torch.zeros(2, 2, 1, 4, 8, dtype=torch.int32), "16- or 32-bit"),
    (torch.full((2, 2, 1, 4, 8), float("nan")), "inf or NaN"),
])
def test_quantize_refuses(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize(bad)


@pytest.mark.parametrize("policy", POLICIES)
def test_quantize_in_blocks_of_pages_is_the_whole_tensors(policy, monkeypatch):
    """Blocks of 3 pages (the last one short), into a given `out`: the same bytes and scales as
    one block; the largest value sits in a late block so the amax must cross blocks."""
    import pkv.core.fp8 as fp8

    x = torch.randn(10, 2, 2, 4, 8, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    x[8, 1, 0, 2, 3] = 40.0
    whole8, whole = quantize(x, policy)
    monkeypatch.setattr(fp8, "_CHUNK_PAGES", 3)
    out = torch.full(x.shape, float("nan")).to(E4M3)
    got8, got = quantize(x, policy, out=out)
    assert got8 is out and torch.equal(got8.view(torch.uint8), whole8.view(torch.uint8))
    assert (got.k_scale, got.v_scale) == (whole.k_scale, whole.v_scale)
    if policy == "page":
        assert torch.equal(got.page_factors, whole.page_factors)
    with pytest.raises(ValueError, match="out must be"):
        quantize(x, policy, out=torch.empty(x.shape, dtype=torch.float16))


def test_scales_validate():
    with pytest.raises(ValueError, match="policy"):
        KvScales("channel", 1.0, 1.0)
    with pytest.raises(ValueError, match="page factors"):
        KvScales("page", 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        KvScales("tensor", 0.0, 1.0)


def test_shape_kv_dtype():
    s = Shape(8, 2, 32, 16, "float16", "fp8")
    assert s.fp8 and s.kv_torch_dtype == E4M3 and s.kv_itemsize == 1
    assert s.kv_bytes_per_token == Shape(8, 2, 32, 16, "float16").kv_bytes_per_token // 2
    with pytest.raises(ValueError, match="kv_dtype"):
        Shape(kv_dtype="int4")
    with pytest.raises(ValueError, match="float32"):
        Shape(dtype="float32", kv_dtype="fp8")


def small_case(policy, seed=9, lens=(37, 300, 5)):
    shape = Shape(8, 2, 32, 16, "float16")
    lens = np.asarray(lens)
    cache16 = PagedCache.random(shape, assign_pages(lens, 16, 0.5, seed), seed=seed)
    step = StepState(0, np.arange(len(lens)), lens.astype(np.int32))
    return cache16, cache16.quantized(policy), step, cache16.query(len(lens), seed + 1)


def test_fp8_cache_needs_scales():
    cache16, cache8, _, _ = small_case("tensor")
    with pytest.raises(ValueError, match="scales"):
        PagedCache(cache8.shape, cache8.assignment, cache8.kv, cache8.block_table, cache8.block_table_host)
    with pytest.raises(ValueError, match="FP8 already"):
        cache8.quantized()
    fresh = PagedCache.random(cache8.shape, cache8.assignment, seed=1, fp8_policy="page")
    assert fresh.kv.dtype == E4M3 and fresh.scales.policy == "page"


@pytest.mark.parametrize("policy", ["tensor", "page"])
def test_graph_oracle_reads_the_dequantized_cache(policy):
    """The CPU pkv-graph oracle over an FP8 cache is the reference over its dequantized values,
    and stays within e4m3's reach of the 16-bit reference."""
    cache16, cache8, step, q = small_case(policy)
    out = make_engine("pkv-graph", cache8).run(q, make_engine("pkv-graph", cache8).prepare(step))
    ref8 = attention_reference(q, cache8.values(), cache8.block_table, torch.as_tensor(step.seq_lens))
    ref16 = attention_reference(q, cache16.kv, cache16.block_table, torch.as_tensor(step.seq_lens))
    assert (out.float() - ref8).abs().max().item() < 2e-3
    assert 0 < (ref8 - ref16).abs().max().item() < 0.1


def test_engines_that_do_not_read_fp8_refuse():
    _, cache8, _, _ = small_case("tensor")
    for name in ("pkv-workqueue", "pkv-masked", "adaptive"):
        with pytest.raises(ValueError, match="does not read an FP8 KV cache"):
            make_engine(name, cache8)


# ---------------------------------------------------------------- report tables


def test_kernel_table_pairs_points():
    from pkv.report.fp8 import kernel_summary, kernels_table

    rows = []
    for point, batch, length in (("B1 32K", 1, 32768), ("B8 32K", 8, 32768)):
        for kv_dtype, policy, engine, us in (("auto", "", "pkv-graph", 40.0), ("auto", "", "flashinfer-tc", 42.0),
                                             ("auto", "", "flashinfer", 50.0), ("fp8", "tensor", "pkv-graph", 25.0),
                                             ("fp8", "tensor", "flashinfer-tc", 35.0),
                                             ("fp8", "page", "pkv-graph", 26.0)):
            rows.append(dict(family="fp8", point=point, case=f"{point} {kv_dtype}{policy}", kv_dtype=kv_dtype,
                             fp8_policy=policy, engine=engine, graph_us=us * batch, batch=batch, max_len=length,
                             frac_of_roofline=0.8))
    frame = pd.DataFrame(rows)
    s = kernel_summary(frame)
    assert s.loc["B1 32K", "over FI 16-bit"] == pytest.approx(42 / 25)
    assert s.loc["B1 32K", "over FI fp8"] == pytest.approx(35 / 25)
    assert s.loc["B8 32K", "over pkv 16-bit"] == pytest.approx(40 / 25)
    text = kernels_table(frame, {"command": "pkv bench kernels --suites fp8"})
    assert "B1 32K 1.68" in text and "(bar ≥ 1.8)" in text


def test_accuracy_table_lists_every_cell_and_refusals():
    from pkv.report.fp8 import accuracy_table

    rows = [dict(data="random", seed=s, kv=kv, engine=e, rel_rms=r, max_abs=r, mean_abs=r, error="")
            for s in (1, 2) for kv, e, r in (("16-bit", "pkv-graph", 1e-4), ("fp8-tensor", "pkv-graph", 0.04),
                                             ("fp8-tensor", "flashinfer", 0.04), ("fp8-page", "pkv-graph", 0.03))]
    rows.append(dict(data="random", seed=1, kv="fp8-page", engine="flashinfer", rel_rms=math.nan, max_abs=math.nan,
                     mean_abs=math.nan, error="ValueError: tensor scales only"))
    text = accuracy_table(pd.DataFrame(rows), {"lens": "1,2"})
    assert "| random | fp8-page | pkv-graph | 0.0300 |" in text
    assert "flashinfer on fp8-page" in text


def test_kv_fp8_stage_on_the_cpu(tmp_path):
    """The serving ablation's stage end to end on CPU engines (smoke profile's defaults)."""
    from pathlib import Path

    import yaml

    from pkv.config.resolve import effective
    from pkv.measure.stages import kv_fp8
    from pkv.plan.costmodel import Constants

    cfg = effective(yaml.safe_load((Path(__file__).resolve().parent.parent / "config.yaml").read_text()), "smoke")
    k = Constants("cpu", 1e9, 1e-6, 8, 1.0, {"flashinfer": 4.0, "flashinfer-tc": 4.0}, ((1024, 1.05),), (4,), 1, 4)
    frame, meta = kv_fp8(cfg, k, cfg["seeds"]["heldout"][0])
    assert set(frame.kv_dtype) == {"auto", "fp8"} and set(frame.engine) >= {"reference", "pkv-graph"}
    assert frame.ref_max_abs_err.dropna().max() < cfg["tolerance"]["max_abs"]
    assert meta["fp8_policy"] == "tensor"


def test_fp8_reports_refuse_missing_foreign_and_mixed_files(tmp_path):
    from pkv.core import io
    from pkv.report.fp8 import main

    out = tmp_path / "t.md"
    with pytest.raises(ValueError, match="no FP8 accuracy Parquet"):
        main(["accuracy", str(tmp_path / "nope.parquet"), "--table", str(out)])
    foreign = tmp_path / "foreign.parquet"
    io.write_parquet(pd.DataFrame({"x": [1]}), foreign, {})
    with pytest.raises(ValueError, match=r"not the FP8 kernel benchmark Parquet \(missing columns"):
        main(["kernels", str(foreign), "--table", str(out)])
    rows = pd.DataFrame({"seed": [1], "kv_dtype": ["auto"], "engine": ["pkv-graph"], "graph_s": [1.0],
                         "wall_s": [1.0], "active": [1]})
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    io.write_parquet(rows, a, {"git_commit": "aaa"})
    io.write_parquet(rows, b, {"git_commit": "bbb"})
    with pytest.raises(ValueError, match="different commits"):
        main(["serving", str(a), str(b), "--table", str(out)])
    assert not out.exists()


def test_kv_fp8_stage_refuses_engines_that_do_not_read_fp8():
    from pathlib import Path

    import yaml

    from pkv.config.resolve import effective
    from pkv.measure.stages import kv_fp8

    cfg = effective(yaml.safe_load((Path(__file__).resolve().parent.parent / "config.yaml").read_text()), "smoke")
    cfg["ablations"]["kv_fp8"] = {"family": "bimodal", "max_active": 8, "max_steps": 4, "policy": "tensor",
                                  "engines": ["pkv-workqueue"]}
    with pytest.raises(ValueError, match=r"ablations.kv_fp8.engines .*pkv-workqueue.* do not read an FP8 KV cache"):
        kv_fp8(cfg, None, cfg["seeds"]["heldout"][0])
