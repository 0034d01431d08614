"""Table 3's model-level proxy (pkv measure mlp-proxy, pkv.measure.stages.mlp_proxy) on the CPU.

Each of a step's layers attends over its own KV cache (one page table, its own values,
sized to the pages the measured steps read); one prepare() a step serves every layer. The
timed body and the correctness check are shown to read layer i's KV (not layer 0's); the
section's optional `engines` key, the report's rows and the smoke stage end to end via
`pkv measure mlp-proxy` are checked too.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from pkv.cli.main import main as pkv
from pkv.config.resolve import ConfigError, config_hash, effective, load_schema, validate_config
from pkv.config.typed import Config
from pkv.core.io import read_meta
from pkv.core.paging import compact
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference
from pkv.measure import model_plan as mp
from pkv.measure import stages
from pkv.measure.loop import CorrectnessError, Job, Tolerance, measure
from pkv.measure.timing import Timer
from pkv.report.tables import t_mlp_proxy
from router_constants import cpu_constants

REPO = Path(__file__).resolve().parents[1]
RAW = yaml.safe_load((REPO / "config.yaml").read_text())
SMOKE = effective(RAW, "smoke")
SEED = SMOKE["seeds"]["heldout"][0]
LAYERS = 4


def _setup(layers: int = LAYERS):
    cfg = Config.from_dict(copy.deepcopy(SMOKE))
    c = cfg.mlp_proxy
    trace = stages.synthetic_trace(cfg, c.family, SEED)
    shape = stages._shape(cfg)
    steps = stages.steps_of(trace, c.max_active, cfg.measure.max_steps)
    assignment = stages.layer_assignment(trace, shape, cfg.measure.holes, SEED, steps)
    caches = stages.layer_caches(shape, assignment, "cpu", SEED, layers)
    return cfg, trace, shape, steps, caches


def _engine(name: str, cache):
    options = {"constants": cpu_constants(), "point": "p"} if name == "adaptive" else {}
    return make_engine(name, cache, **options)


def _ref(q, cache, step):
    table = cache.block_table[torch.as_tensor(step.request_ids)]
    return attention_reference(q, cache.values(), table, torch.as_tensor(step.seq_lens))


# ---------------------------------------------------------------- per-layer KV


def test_every_layer_shares_one_page_table_over_the_measured_pages():
    cfg, trace, shape, steps, caches = _setup()
    assert len(caches) == LAYERS and all(c.assignment is caches[0].assignment for c in caches)
    full = stages.assign_pages(trace.total_len, shape.page_size, cfg.measure.holes, SEED)
    # The model step's compaction (pkv.core.paging.compact, one definition).
    want, got = compact(full, steps), caches[0].assignment
    assert got.num_pages == want.num_pages <= full.num_pages
    assert np.array_equal(got.pages, want.pages) and np.array_equal(got.page_offsets, want.page_offsets)
    assert all(np.array_equal(c.block_table_host, caches[0].block_table_host) for c in caches)
    # Own values: no two layers hold the same KV.
    for i in range(1, LAYERS):
        assert not torch.equal(caches[i].kv, caches[0].kv)
    assert mp.kv_bytes(shape, got.num_pages, LAYERS) == sum(c.kv.nbytes for c in caches)


def test_a_compacted_table_drops_pages_no_measured_step_reads():
    cfg, trace, shape, steps, _ = _setup(2)
    full = stages.assign_pages(trace.total_len, shape.page_size, 0.5, SEED)
    few = compact(full, steps[:1])
    st, ps = steps[0], full.page_size
    need = -(-np.asarray(st.seq_lens, dtype=np.int64) // ps)
    assert few.num_pages == int(need.sum()) < full.num_pages   # exactly the pages the step reads
    old = np.concatenate([full.request_pages(r)[:n] for r, n in zip(st.request_ids, need)])
    new = np.concatenate([few.request_pages(r)[:n] for r, n in zip(st.request_ids, need)])
    assert np.array_equal(np.argsort(old), np.argsort(new))   # renumbered in their physical order


@pytest.mark.parametrize("name", ["reference", "pkv-workqueue", "pkv-graph", "adaptive"])
def test_the_timed_body_reads_each_layers_own_kv(name):
    """One prepare(), then layer i's output is the FP32 reference over cache i (not cache 0)."""
    _, _, _, steps, caches = _setup()
    engine = _engine(name, caches[0])
    step = steps[-1]
    outs = []
    timer = Timer(False, False, LAYERS, lambda out: outs.append(out.clone()), caches)
    q = caches[0].query(step.active, seed=11)
    plan, wall, cuda = timer.timed(engine, step, q)
    assert len(outs) == LAYERS and wall > 0 and np.isnan(cuda)
    ref0 = _ref(q, caches[0], step)
    for i, out in enumerate(outs):
        ref = _ref(q, caches[i], step)
        torch.testing.assert_close(out[:step.active].float(), ref, atol=2e-3, rtol=2e-3)
        if i:
            assert (out[:step.active].float() - ref0).abs().max() > 0.1, f"layer {i} read layer 0's KV"


def test_more_layers_than_one_need_their_caches():
    _, _, _, _, caches = _setup()
    with pytest.raises(ValueError, match="need one KV cache each"):
        Timer(False, False, LAYERS, None)
    with pytest.raises(ValueError, match="4 layers, 3 KV caches"):
        Timer(False, False, LAYERS, None, caches[:3])


class _Layer0Only:
    """An engine that ignores the layer's cache: every layer rereads layer 0's KV (the bug)."""

    def __init__(self, inner):
        self.inner, self.validate = inner, True

    def prepare(self, step):
        return self.inner.prepare(step)

    def run(self, q, plan, layer=None):
        return self.inner.run(q, plan)


def _job(layers: int) -> Job:
    return Job("mlp_proxy", "t", "bimodal", 8, SEED, 4, layers=layers)


def test_the_correctness_check_reads_another_layer_than_layer_0():
    _, _, _, steps, caches = _setup()
    tol = Tolerance(SMOKE["tolerance"]["max_abs"], SMOKE["tolerance"]["mean_abs"])
    good = {"reference": _engine("reference", caches[0]), "pkv-graph": _engine("pkv-graph", caches[0])}
    frame = measure(_job(LAYERS), caches[0], steps[:2], good, "reference", tol, 1, False, layer_caches=caches)
    assert len(frame) == 4 and (frame["layers"] == LAYERS).all() and frame["ref_max_abs_err"].lt(2e-3).all()
    bad = {"reference": good["reference"], "stale": _Layer0Only(_engine("pkv-graph", caches[0]))}
    with pytest.raises(CorrectnessError, match=rf"engine stale \(layer {LAYERS - 1}\) vs reference"):
        measure(_job(LAYERS), caches[0], steps[:2], bad, "reference", tol, 1, False, layer_caches=caches)
    # One layer: the engines' own cache, as before.
    one = measure(_job(1), caches[0], steps[:1], good, "reference", tol, 1, False)
    assert len(one) == 2
    with pytest.raises(ValueError, match="need as many KV caches"):
        measure(_job(LAYERS), caches[0], steps[:1], good, "reference", tol, 1, False)


# ---------------------------------------------------------------- the config key


def test_engines_are_named_by_the_config_with_no_default_in_code():
    reference = json.loads((REPO / "results" / "config.json").read_text())
    assert reference["mlp_proxy"]["engines"] == RAW["mlp_proxy"]["engines"] == ["pkv-graph", "adaptive"]
    for cfg in (reference, effective(RAW, "paper")):
        t = Config.from_dict(cfg)
        assert t.mlp_proxy.engines == ("pkv-graph", "adaptive") and t.to_dict()["mlp_proxy"] == cfg["mlp_proxy"]
    absent = effective(RAW, "paper")
    del absent["mlp_proxy"]["engines"]                  # a section that names none is refused, by its key
    with pytest.raises(ConfigError, match=r"^config: mlp_proxy: 'engines' is a required property$"):
        validate_config(absent, load_schema())
    with pytest.raises(ConfigError, match=r"^config: mlp_proxy\.engines: missing key$"):
        Config.from_dict(absent)
    smoke = Config.from_dict(SMOKE)
    assert smoke.mlp_proxy.engines == ("pkv-graph", "adaptive") and smoke.to_dict()["mlp_proxy"] == SMOKE["mlp_proxy"]
    over = effective(RAW, "paper", {"mlp_proxy": {"engines": ["pkv-graph"]}})
    validate_config(over, load_schema())
    assert Config.from_dict(over).mlp_proxy.engines == ("pkv-graph",)


@pytest.mark.parametrize("engines, where", [(["pkv-grpah"], "mlp_proxy.engines.0"), ([], "mlp_proxy.engines")])
def test_the_schema_refuses_a_bad_engines_value(engines, where):
    cfg = copy.deepcopy(SMOKE)
    cfg["mlp_proxy"]["engines"] = engines
    with pytest.raises(ConfigError, match=rf"config: {where}: "):
        validate_config(cfg, load_schema())


# ---------------------------------------------------------------- the report


def _frame(engines: dict[str, float]) -> pd.DataFrame:
    """Two seeds x layers 1 and 32, two steps each: engine -> wall seconds a step at one layer."""
    rows = []
    for seed in (1, 2):
        for layers in (1, 32):
            for engine, s in engines.items():
                for step in range(2):
                    t = s * layers * (1 + 0.1 * seed)
                    rows.append({"stage": "mlp_proxy", "family": "bimodal", "max_active": 8, "seed": seed,
                                 "layers": layers, "engine": engine, "route": engine, "step": step, "active": 8,
                                 "wall_s": t, "cuda_s": t / 2, "graph_s": np.nan})
    return pd.DataFrame(rows)


def test_the_report_has_a_row_and_a_ratio_per_engine_of_the_stage():
    f = _frame({"flashinfer": 2e-3, "flashinfer-tc": 1e-3, "pkv-graph": 0.5e-3, "adaptive": 0.8e-3,
                "adaptive:objective=overlapped": 1e-3})
    t = t_mlp_proxy(SimpleNamespace(frame=f))
    one = t[t["Layers"] == "1"]
    assert list(one["Engine"]) == ["flashinfer-tc + MLP tail", "pkv-graph + MLP tail", "Ratio, pkv-graph",
                                   "Adaptive route + MLP tail", "Ratio",
                                   "Adaptive route · objective=overlapped + MLP tail",
                                   "Ratio, adaptive:objective=overlapped"]
    assert list(t["Layers"].unique()) == ["1", "32"] and len(t) == 14
    ratio = dict(zip(one["Engine"], one["Wall tok/s"]))
    assert ratio["Ratio, pkv-graph"] == "2.000±0.000×" and ratio["Ratio"] == "1.250±0.000×"
    assert ratio["Ratio, adaptive:objective=overlapped"] == "1.000±0.000×"
    # adaptive alone (the committed reference run): the baseline, adaptive and its ratio.
    t = t_mlp_proxy(SimpleNamespace(frame=_frame({"flashinfer": 2e-3, "flashinfer-tc": 1e-3, "adaptive": 0.8e-3})))
    assert list(t["Engine"])[:3] == ["flashinfer-tc + MLP tail", "Adaptive route + MLP tail", "Ratio"]


# ---------------------------------------------------------------- end to end


@pytest.fixture
def frozen(tmp_path):
    """The frozen smoke config and CPU constants frozen for it (the reference as baseline,
    the smoke point calibrated, a pkv-graph fit)."""
    (tmp_path / "config.json").write_text(json.dumps(SMOKE))
    k = cpu_constants()
    constants = {
        "device": "cpu", "profile": "smoke", "beta_bytes_per_s": k.beta, "launch_overhead_s": k.launch_s,
        "sm_count": k.sm_count, "c_min": k.c_min, "baseline_ctas_per_head": k.baseline_ctas_per_head,
        "margins": [{"max_active": a, "margin": m} for a, m in k.margins], "supported_groups": list(k.supported_groups),
        "min_context": k.min_context, "min_tiles_per_split": k.min_tiles_per_split,
        "operating_points": {"bimodal-b8": {"bucket": 4, "workqueue": 4}},
        "graph": {n: getattr(k.graph, n) for n in k.graph.KEYS}, "config_hash": config_hash(SMOKE)}
    (tmp_path / "constants.json").write_text(json.dumps(constants))
    return tmp_path


def test_the_smoke_stage_end_to_end(frozen):
    out = frozen / "s.parquet"
    assert pkv(["measure", "mlp-proxy", "--config", str(frozen / "config.json"), "--constants",
                str(frozen / "constants.json"), "--seed", str(SEED), "--out", str(out)]) == 0
    f = pd.read_parquet(out)
    layers = SMOKE["mlp_proxy"]["layers"]
    assert sorted(f["layers"].unique()) == layers
    assert set(f["engine"]) == {"reference", "pkv-graph", "adaptive"}
    assert f.groupby(["layers", "engine"]).size().nunique() == 1
    assert (f["max_abs_err"] < SMOKE["tolerance"]["max_abs"]).all()
    sampled = f.dropna(subset=["ref_max_abs_err"])
    assert not sampled.empty and (sampled["ref_max_abs_err"] < SMOKE["tolerance"]["max_abs"]).all()
    meta = read_meta(out)
    assert json.loads(meta["engines"]) == ["reference", "pkv-graph", "adaptive"]
    memory = json.loads(meta["kv_memory"])
    assert memory[str(layers[-1])]["layers"] == layers[-1]
    per_layer = memory[str(layers[-1])]["kv_bytes"] / layers[-1]
    s = SMOKE["shape"]
    assert per_layer == memory[str(layers[-1])]["pages"] * s["page_size"] * 2 * s["num_kv_heads"] * s["head_dim"] * 2
    t = t_mlp_proxy(SimpleNamespace(frame=f))
    assert list(t[t["Layers"] == str(layers[-1])]["Engine"]) == [
        "reference + MLP tail", "pkv-graph + MLP tail", "Ratio, pkv-graph", "Adaptive route + MLP tail", "Ratio"]
