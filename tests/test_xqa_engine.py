"""flashinfer-xqa without a GPU: its row of the engine table, the shapes it refuses in one
line, and how the project's FP8 tensor scales map onto XQA's (tests/gpu/test_xqa.py runs it)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pkv.core.fp8 import KvScales
from pkv.core.shape import Shape
from pkv.engines import table
from pkv.engines.xqa import check_xqa_shape, fp8_scales


def test_the_row():
    e = table.info("flashinfer-xqa")
    assert (e.family, e.module, e.baseline, e.fp8, e.cpu, e.route) == \
        ("flashinfer", "pkv.engines.xqa", True, True, False, False)
    assert "flashinfer-xqa" in table.baselines() and "flashinfer-xqa" not in table.planned()
    assert "flashinfer-xqa" in table.fp8_kernels() and "flashinfer-xqa" in table.deployable()
    assert table.parse_spec("flashinfer-xqa:max_rows=8") == ("flashinfer-xqa", {"max_rows": 8})
    with pytest.raises(ValueError, match="takes no option 'splits'"):
        table.parse_spec("flashinfer-xqa:splits=4")


@pytest.mark.parametrize("shape,match", [
    (Shape(32, 8, 128, 1, "float16"), "pages of 16, 32, 64, 128 tokens, got page_size 1"),
    (Shape(32, 8, 128, 8, "bfloat16"), "got page_size 8"),
    (Shape(32, 8, 128, 256, "float16"), "got page_size 256"),
    (Shape(32, 8, 72, 16, "float16"), "head_dim that is a multiple of 16 up to 256, got 72"),
    (Shape(32, 8, 512, 16, "float16"), "got 512"),
    (Shape(64, 1, 128, 16, "float16"), "GQA groups 1..32, got 64"),
    (Shape(32, 8, 128, 16, "float32"), "float16 or bfloat16 queries, got float32"),
])
def test_refused_shapes(shape, match):
    with pytest.raises(ValueError, match=match) as err:
        check_xqa_shape(shape)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("page,d,group", [(16, 64, 1), (32, 128, 4), (64, 256, 8), (128, 16, 32), (16, 80, 5)])
def test_accepted_shapes(page, d, group):
    check_xqa_shape(Shape(2 * group, 2, d, page, "bfloat16"))
    check_xqa_shape(Shape(2 * group, 2, d, page, "float16", "fp8"), KvScales("tensor", 0.5, 2.0))


def test_page_scales_are_refused():
    factors = np.ones((4, 2, 2), dtype=np.float32)
    import torch

    with pytest.raises(ValueError, match="tensor scales only, not the 'page' policy"):
        check_xqa_shape(Shape(8, 2, 128, 16, "float16", "fp8"), KvScales("page", 0.5, 2.0, torch.from_numpy(factors)))


@pytest.mark.parametrize("k_scale,v_scale", [(0.5, 2.0), (3.0, 0.25), (1.0, 1.0)])
def test_fp8_scales_map_onto_bmm1_and_bmm2(k_scale, v_scale):
    """XQA multiplies q.K8 by q_scale * kv_scale / sqrt(d) and P.V8 by kv_scale; FlashInfer's
    bmm1_scale (k_scale / sqrt(d)) and bmm2_scale (v_scale) must come out."""
    d = 128
    q_scale, kv_scale = fp8_scales(KvScales("tensor", k_scale, v_scale))
    assert math.isclose(q_scale * kv_scale / math.sqrt(d), k_scale / math.sqrt(d))
    assert math.isclose(kv_scale, v_scale)
    assert fp8_scales(None) == (1.0, 1.0)


def test_a_cpu_cache_is_refused_in_one_line():
    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages
    from pkv.engines import make_engine

    shape = Shape(8, 2, 64, 16, "float16")
    cache = PagedCache.random(shape, assign_pages(np.array([40, 7]), 16, 0.0, 0))
    with pytest.raises(ValueError, match="'flashinfer-xqa' needs a CUDA device") as err:
        make_engine("flashinfer-xqa", cache)
    assert "\n" not in str(err.value)


def test_nsight_names_xqa_a_flashinfer_decode_kernel():
    from pkv.measure.nsight import kernel_role

    assert kernel_role("void kernel_mha<(unsigned int)8>(unsigned int, float, ...)") == "FlashInfer decode (XQA)"
    assert kernel_role("flashinfer::BatchDecodeWithPagedKVCacheKernel<...>") == "FlashInfer decode (CUDA cores)"
