import numpy as np
import pytest
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.core.validate import check_kv
from pkv.engines import make_engine
from pkv.plan.schedule import SplitPolicy

SHAPE = Shape(8, 2, 64, 16, "float16")


@pytest.fixture(scope="module")
def cache():
    return PagedCache.random(SHAPE, assign_pages(np.array([100, 40]), 16, 0.5, 0))


@pytest.fixture(params=["reference", "pkv-bucket", "pkv-masked", "pkv-workqueue"])
def engine(request, cache):
    return make_engine(request.param, cache, SplitPolicy(4, 1))


def step(lens=(100, 40)):
    return StepState(0, np.array([0, 1]), np.array(lens, dtype=np.int32))


def test_good_inputs_run(engine, cache):
    out = engine.run(cache.query(2, 0), engine.prepare(step()))
    assert out.shape == (2, 8, 64) and out.dtype == torch.float16 and torch.isfinite(out).all()


@pytest.mark.parametrize("q, match", [
    (lambda c: c.query(2, 0).float(), "dtype"),
    (lambda c: c.query(2, 0).to("meta"), "is on meta"),
    (lambda c: c.query(3, 0), "shape"),
    (lambda c: c.query(2, 0)[:, :4].contiguous(), "shape"),
    (lambda c: c.query(2, 0).transpose(0, 1).contiguous().transpose(0, 1), "contiguous"),
    (lambda c: "not a tensor", "torch.Tensor"),
])
def test_bad_query_raises_value_error(engine, cache, q, match):
    plan = engine.prepare(step())
    with pytest.raises(ValueError, match=match):
        engine.run(q(cache), plan)


@pytest.mark.parametrize("lens, match", [((113, 40), "beyond its block table"), ((100, 0), ">= 1")])
def test_bad_lengths_raise_value_error(engine, lens, match):
    with pytest.raises(ValueError, match=match):
        engine.prepare(step(lens))


def test_head_counts_must_divide_and_shape_fields_be_sane():
    with pytest.raises(ValueError, match="multiple"):
        Shape(30, 8)
    for bad in (dict(head_dim=0), dict(page_size=24), dict(dtype="int8"), dict(num_kv_heads=-1)):
        with pytest.raises(ValueError):
            Shape(**bad)


def test_check_kv(cache):
    check_kv(cache.kv, SHAPE)
    with pytest.raises(ValueError, match="shape"):
        check_kv(cache.kv[:, :, :1], SHAPE)
    with pytest.raises(ValueError, match="dtype"):
        check_kv(cache.kv.float(), SHAPE)


def test_gpu_engines_need_cuda(cache):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine("flashinfer", cache)
