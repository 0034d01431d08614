"""The engine registry is the one list of engine names; pkv.plan.schedule holds the one split
rule and slot size that the schedules, the launch builder and the cost model share."""

import numpy as np
import pytest
import yaml

from pkv.bench import splits as bench
from pkv.plan import costmodel
from pkv.core.cache import PagedCache
from pkv.engines import make_engine, registry
from pkv.engines.persistent import kernel_launches
from pkv.core.paging import assign_pages
from pkv.plan.schedule import SplitPolicy, slot_bytes, slot_floats, workqueue_row_splits, workqueue_schedule
from pkv.core.shape import Shape


def _config_engines(node) -> set[str]:
    if isinstance(node, dict):
        out = set()
        for key, value in node.items():
            if key in ("engines", "baselines", "main"):
                out |= {str(v).partition(":")[0] for v in value}
            else:
                out |= _config_engines(value)
        return out
    return set()


def test_every_configured_engine_is_registered():
    cfg = yaml.safe_load(open("config.yaml"))
    names = _config_engines(cfg)
    assert names and names <= set(registry.ENGINES), names - set(registry.ENGINES)


def test_lists_derive_from_the_table():
    assert registry.PKV_ENGINES == {"pkv-workqueue": "workqueue", "pkv-masked": "masked", "pkv-bucket": "bucket",
                                    "pkv-fused": "workqueue"}
    assert registry.PKV_KINDS == {k: v for k, v in registry.PKV_ENGINES.items() if k != "pkv-fused"}
    assert registry.FLASHINFER == ("flashinfer", "flashinfer-tc", "flashinfer-persistent")
    assert bench.PKV_ENGINES == tuple(registry.PKV_ENGINES)
    assert set(bench.BASELINES) == set(registry.FLASHINFER) | {"sdpa-repack"}


def test_graph_entry():
    e = registry.ENGINES["pkv-graph"]
    assert e.family == "pkv-graph" and "no host plan" in e.description and e.cpu
    shape = Shape(8, 2, 16, 4)
    cache = PagedCache.random(shape, assign_pages(np.array([40]), 4, 0.0, 0))
    assert type(make_engine("pkv-graph", cache)).__name__ == "GraphEngine"     # its CPU oracle
    with pytest.raises(ValueError, match="no SplitPolicy"):
        make_engine("pkv-graph", cache, SplitPolicy(4))
    with pytest.raises(ValueError, match="unknown engine"):
        make_engine("pkv-nope", cache)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        make_engine("flashinfer", cache)


@pytest.mark.parametrize("seed", range(8))
def test_one_workqueue_rule(seed):
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, int(rng.choice([50, 5000, 70000])), size=int(rng.integers(1, 40)))
    policy = SplitPolicy(int(rng.integers(1, 70)), int(rng.integers(1, 5)))
    arr = workqueue_row_splits(lens, policy)
    assert list(arr) == workqueue_row_splits(lens.tolist(), policy)
    sched = workqueue_schedule(lens, 4, policy).launches[0]
    assert np.array_equal(np.diff(sched.seg_offsets)[::4], arr)
    assert kernel_launches("workqueue", lens, 4, policy)[0].num_tasks == 4 * int(arr.sum())


def test_one_slot_size():
    shape = Shape(32, 8, 128, 16)
    assert slot_floats(shape) == 4 * 130 and slot_bytes(shape) == 4 * 4 * 130
    lens = [5000, 300, 9000]
    cost = costmodel.workqueue_cost(shape, lens, SplitPolicy(8))
    assert cost.merge_bytes == cost.ctas * slot_bytes(shape)
