"""The engine table is the one list of engine names; pkv.plan.schedule holds the one split
rule and slot size that the schedules, the launch builder and the cost model share."""

import re

import numpy as np
import pytest
import yaml

from pkv.bench import splits as bench
from pkv.core.cache import PagedCache
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine, table
from pkv.engines.persistent import kernel_launches
from pkv.plan import costmodel
from pkv.plan.schedule import SplitPolicy, slot_bytes, slot_floats, workqueue_row_splits, workqueue_schedule


def _config_engines(node) -> set[str]:
    """Every engine name of the config, but the model step's: those name its runners (below)."""
    if isinstance(node, dict):
        out = set()
        for key, value in node.items():
            if key == "model_step":
                continue
            if key in ("engines", "baselines", "main"):
                out |= {str(v).partition(":")[0] for v in value}
            else:
                out |= _config_engines(value)
        return out
    return set()


def test_every_configured_engine_is_registered():
    cfg = yaml.safe_load(open("config.yaml"))
    names = _config_engines(cfg)
    assert names and names <= set(table.ENGINES), names - set(table.ENGINES)
    from pkv.engines.model import CPU_ENGINES, GPU_ENGINES

    for section in (cfg, *(cfg.get(p, {}) for p in ("smoke",))):
        runners = set(section.get("model_step", {}).get("engines", []))
        assert runners <= {*GPU_ENGINES, *CPU_ENGINES} <= set(table.RUNNERS), runners


def test_lists_derive_from_the_table():
    assert table.pkv_engines() == {"pkv-workqueue": "workqueue", "pkv-masked": "masked", "pkv-bucket": "bucket",
                                   "pkv-fused": "workqueue"}
    assert table.pkv_kinds() == {k: v for k, v in table.pkv_engines().items() if k != "pkv-fused"}
    assert table.flashinfer() == ("flashinfer", "flashinfer-tc", "flashinfer-persistent", "flashinfer-xqa")
    assert table.baselines() == ("flashinfer", "flashinfer-tc", "flashinfer-xqa")
    assert table.planned() == ("flashinfer", "flashinfer-tc", "flashinfer-persistent")
    assert table.pkv_routes() == {"pkv-workqueue": "workqueue", "pkv-bucket": "bucket", "pkv-graph": "graph"}
    assert bench.PKV_ENGINES == tuple(table.pkv_engines())
    assert set(bench.BASELINES) == set(table.flashinfer()) | {"sdpa-repack"}
    assert table.fp8_kernels() == ("pkv-graph", "flashinfer", "flashinfer-tc", "flashinfer-xqa")
    assert table.is_router("adaptive:objective=overlapped") and not table.is_router("flashinfer-graph")
    # The model-step runners: the sets the measurement and the report read, as they were.
    assert table.runners() == ("pkv-graph", "flashinfer-graph", "flashinfer-eager", "adaptive", "reference",
                               "flashinfer-xqa-graph")
    assert table.runners("gpu") == ("pkv-graph", "flashinfer-graph", "flashinfer-eager", "adaptive",
                                    "flashinfer-xqa-graph")
    assert table.runners("cpu") == ("pkv-graph", "reference")
    assert table.runners("fp8") == ("pkv-graph", "flashinfer-graph", "flashinfer-eager", "reference",
                                    "flashinfer-xqa-graph")
    assert table.runners("ratio_base") == ("flashinfer-graph", "reference", "flashinfer-xqa-graph")
    assert table.runners("check_base") == ("flashinfer-eager", "reference", "flashinfer-xqa-graph")
    # The query options: FlashInfer's planned decode takes windows and q_len, not sinks (it drops them).
    assert table.feature_kernels() == ("pkv-graph", "flashinfer", "flashinfer-tc", "flashinfer-xqa")
    assert table.feature_takers("sinks") == ("pkv-graph", "flashinfer-xqa")
    assert table.feature_takers("q_len") == table.feature_takers("window_left") == table.feature_kernels()
    assert table.runners("routed") == ("adaptive",)


def test_the_check_base_is_the_first_that_ran():
    """A pass is checked against the first check_base runner that ran it: FlashInfer eager, else
    the FP32 reference, else XQA's graph path (a sink model's step, which eager refuses); none: unchecked."""
    assert table.check_base(["pkv-graph", "flashinfer-graph", "flashinfer-eager", "flashinfer-xqa-graph"]) == \
        "flashinfer-eager"
    assert table.check_base({"pkv-graph", "reference", "flashinfer-xqa-graph"}) == "reference"
    assert table.check_base({"pkv-graph", "flashinfer-xqa-graph"}) == "flashinfer-xqa-graph"
    assert table.check_base({"pkv-graph", "flashinfer-graph", "adaptive"}) is None
    assert table.check_base(()) is None


def test_the_table_imports_no_torch():
    import subprocess
    import sys

    code = "import sys; import pkv.engines.table, pkv.engines; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_one_spec_syntax():
    assert table.parse_spec("pkv-masked:row_local=false,early_exit=true") == \
        ("pkv-masked", {"row_local": False, "early_exit": True})
    assert table.parse_spec("pkv-graph:min_tiles=4") == ("pkv-graph", {"min_tiles": 4})
    with pytest.raises(ValueError, match="takes no option 'splits'"):
        table.parse_spec("pkv-graph:splits=4")
    with pytest.raises(ValueError, match="unknown engine"):
        table.parse_spec("pkv-nope")
    with pytest.raises(ValueError, match="key=true, key=false or key=<integer>"):
        table.parse_spec("pkv-graph:min_tiles=x")
    pattern = re.compile(table.spec_pattern())
    assert pattern.match("pkv-masked:row_local=false") and pattern.match("flashinfer-tc")
    assert not pattern.match("flashinfer-tcx") and not pattern.match("pkv-graph[min_tiles=4]")


def test_graph_entry():
    e = table.ENGINES["pkv-graph"]
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


NEW_ENGINE = """
import torch

from pkv.engines.base import Engine, Plan


class PaddedEngine(Engine):
    \"\"\"Every row's pages padded to the longest row's, one masked batched softmax over them.\"\"\"

    def prepare(self, step):
        self.check_step(step)
        width = -(-int(max(step.seq_lens)) // self.cache.shape.page_size)
        return Plan(step, self.name, 1, None), (self.cache.block_table[torch.as_tensor(step.request_ids), :width],
                                                 torch.as_tensor(step.seq_lens))

    def run(self, q, plan, layer=None):
        (plan, (pages, lens)), s = plan, self.cache.shape
        kv = self.layer(layer).values()[pages.long()].float()   # [B, pages, 2, H_kv, P, D]
        k, v = (kv[:, :, i].permute(0, 2, 1, 3, 4).flatten(2, 3) for i in (0, 1))   # [B, H_kv, L, D]
        qg = q.float().view(q.shape[0], s.num_kv_heads, -1, s.head_dim)
        scores = torch.einsum("bhgd,bhld->bhgl", qg, k) / s.head_dim ** 0.5
        mask = torch.arange(k.shape[2])[None, :] >= lens[:, None]
        p = scores.masked_fill(mask[:, None, None, :], float("-inf")).softmax(-1)
        return torch.einsum("bhgl,bhld->bhgd", p, v).reshape(q.shape).to(q.dtype)


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import check_options, no_policy

    no_policy(name, policy)
    check_options(name, options, info.options)
    return PaddedEngine(cache, **options)
"""


def test_a_new_engine_is_one_row_and_a_module(tmp_path, monkeypatch):
    """A new family of its own kind (a padded dense torch engine) is one row in the table
    and one module: the schema's pattern, the CLI's choices and default, the report's route
    kinds and make_engine all find it, with no other edit."""
    import sys

    import torch

    from pkv.cli.main import build_parser
    from pkv.config.resolve import ConfigError, load_schema, validate_config
    from pkv.core.harness import StepState
    from pkv.report.claims import route_kind

    (tmp_path / "padded_engine.py").write_text(NEW_ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("padded_engine", None)
    row = table.EngineInfo("padded", "dense-mask", "every row padded to the longest, one masked softmax",
                           "padded_engine", cpu=True, options=("validate",), paper_route="padded dense")
    monkeypatch.setitem(table.ENGINES, "padded-dense", row)

    cfg = yaml.safe_load(open("config.yaml"))
    cfg["isolated"]["engines"] = [*cfg["isolated"]["engines"], "padded-dense:validate=false"]
    validate_config(cfg, load_schema())                      # the schema's pattern takes its spec
    cfg["isolated"]["engines"][-1] = "padded-denser"
    with pytest.raises(ConfigError, match="isolated.engines"):
        validate_config(cfg, load_schema())
    assert table.parse_spec("padded-dense:validate=false") == ("padded-dense", {"validate": False})
    with pytest.raises(ValueError, match="takes no option 'splits'"):
        table.parse_spec("padded-dense:splits=4")
    bench = build_parser("bench")._subparsers._group_actions[0].choices["bench"]
    host_parser = bench._subparsers._group_actions[0].choices["host"]
    engines = next(a for a in host_parser._actions if a.dest == "engines")
    assert "padded-dense" in engines.choices and "padded-dense" in engines.default   # the CLI's choices
    assert table.names("padded") == ("padded-dense",) and "padded-dense" in table.cpu_engines()
    assert "padded-dense" not in (*table.baselines(), *table.pkv_routes(), *table.flashinfer(), *table.fp8_readers())
    assert not table.persistentkv("padded-dense") and not table.is_router("padded-dense")
    assert route_kind("padded-dense") == "padded dense"     # the report's route kinds

    shape = Shape(8, 2, 16, 4)
    cache = PagedCache.random(shape, assign_pages(np.array([40, 13, 27]), 4, 0.5, 0))
    engine = make_engine("padded-dense", cache)
    assert type(engine).__name__ == "PaddedEngine" and engine.name == "padded-dense"   # named by its row
    step = StepState(0, np.array([2, 0, 1]), np.array([27, 40, 9], dtype=np.int32))
    q = torch.randn(3, shape.num_qo_heads, shape.head_dim).to(torch.float16)
    plan = engine.prepare(step)
    assert plan[0].route == "padded-dense"
    reference = make_engine(table.REFERENCE, cache)
    torch.testing.assert_close(engine.run(q, plan), reference.run(q, reference.prepare(step)), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="no SplitPolicy"):
        make_engine("padded-dense", cache, SplitPolicy(4))


NEW_RUNNER = """
from pkv.engines.model import ReferenceRunner


class MyRunner(ReferenceRunner):
    name = "my-runner"
"""


def test_a_new_model_step_runner_is_one_row_and_a_module(tmp_path, monkeypatch):
    """A row in RUNNERS and a class of its own: the schema's model_step.engines, the runner
    set (build_runners) and the model step's report (its order, legend and ratio base) find it."""
    import sys

    import pandas as pd
    import torch

    from pkv.config.resolve import ConfigError, load_schema, validate_config
    from pkv.core.harness import StepState
    from pkv.engines import model
    from pkv.measure import stages
    from pkv.measure.model_runners import build_runners
    from pkv.report import model as report

    (tmp_path / "my_runner.py").write_text(NEW_RUNNER)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_runner", None)
    row = table.RunnerInfo("my runner", "my_runner:MyRunner", cpu=True, fp8=True, ratio_base=True)
    monkeypatch.setitem(table.RUNNERS, "my-runner", row)

    cfg = yaml.safe_load(open("config.yaml"))
    cfg["model_step"]["engines"] = ["pkv-graph", "my-runner"]
    validate_config(cfg, load_schema())                      # the schema takes its name
    cfg["model_step"]["engines"] = ["my-runner2"]
    with pytest.raises(ConfigError, match="model_step.engines"):
        validate_config(cfg, load_schema())
    assert table.runners("cpu")[-1] == table.runners("fp8")[-1] == "my-runner"

    shape = model.MODEL_SHAPES["smoke"]
    step = StepState(0, np.array([1, 0]), np.array([9, 30], dtype=np.int32))
    caches = stages.layer_caches(shape.attention(4, "float16"), assign_pages(np.array([12, 40]), 4, 0.0, 0), "cpu",
                                 7, shape.layers)
    net = model.DecoderModel(shape, torch.float16, "cpu", 1)
    xs = {2: torch.randn(2, shape.hidden).to(torch.float16)}
    built = build_runners(["my-runner", "reference"], net, caches, xs, [2])    # the runner set makes it
    assert type(built["my-runner"]).__name__ == "MyRunner"
    outs = {}
    for name, r in built.items():
        r.prepare(step, 2)
        outs[name] = r.launch(step, 2)
    torch.testing.assert_close(outs["my-runner"], outs["reference"])

    frame = pd.DataFrame({"engine": ["my-runner", "pkv-graph"]})     # the model step's report name lists
    assert report.ratio_base(frame) == "my-runner" and report.engine_label("my-runner") == "my runner"
    assert sorted(["my-runner", "reference", "pkv-graph"], key=report._engine_rank) == \
        ["pkv-graph", "reference", "my-runner"]


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
