"""The model-level decode step (pkv measure model-step, pkv.measure.model_step) and its report
(pkv.report.model), on the CPU.

The smoke run goes end to end through `pkv measure model-step` (frozen config -> traces ->
steps -> N layers, each with its own KV, pkv-graph's CPU oracle through the public
DecodeWrapper and the FP32 reference, 16-bit and FP8 -> Parquet with provenance -> table);
the config section, the stage rows, the per-layer KV, the shapes and the memory arithmetic,
the bucket and padding rules and the report's arithmetic are checked on their own.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from pkv.cli.main import main as pkv
from pkv.config.resolve import ConfigError, config_hash, effective, load_schema, validate_config
from pkv.config.stages import STAGES, by_command
from pkv.config.typed import Config
from pkv.core.harness import StepState
from pkv.core.io import read_meta, write_parquet
from pkv.core.paging import assign_pages, compact, flashinfer_view
from pkv.engines import model as runners
from pkv.engines import table
from pkv.engines.model_flashinfer import padded_flashinfer_view
from pkv.kernels.reference import attention_reference
from pkv.measure import model_plan as mp
from pkv.measure import model_runners as mr
from pkv.measure import model_step as ms
from pkv.measure import stages
from pkv.report import model as rm
from router_constants import cpu_constants

REPO = Path(__file__).resolve().parents[1]
RAW = yaml.safe_load((REPO / "config.yaml").read_text())
SMOKE = effective(RAW, "smoke")
SEED = SMOKE["seeds"]["heldout"][0]


def smoke_cfg(**section) -> Config:
    cfg = copy.deepcopy(SMOKE)
    cfg["model_step"] = {**cfg["model_step"], **section}   # the smoke profile's keys, some replaced
    return Config.from_dict(cfg)


def smoke_plan(families=("bimodal",), **section) -> mp.ModelStepPlan:
    cfg = smoke_cfg(**section)
    jobs = [mp.TraceJob(t.name, f, SEED, t) for f in families for t in (ms.synthetic_trace(cfg, f, SEED),)]
    return mp.build_plan(cfg, jobs)


@pytest.fixture
def frozen(tmp_path):
    """A frozen smoke config and constants frozen for it (the committed calibration, rehashed)."""
    (tmp_path / "config.json").write_text(json.dumps(SMOKE))
    k = json.loads((REPO / "results" / "calibration" / "constants.json").read_text())
    (tmp_path / "constants.json").write_text(json.dumps({**k, "config_hash": config_hash(SMOKE)}))
    return tmp_path


def measure(d: Path, command: str, *flags: str, out: Path | None = None) -> int:
    return pkv(["measure", command, "--config", str(d / "config.json"), "--constants", str(d / "constants.json"),
                *flags, "--out", str(out or d / "out.parquet")])


def per_layer(s, lens, reserve, layers: int):
    """One step of rows 2, 0, 3 at `lens` over requests reserving `reserve` tokens (page 4,
    half the pages holes), and `layers` KV caches over its compacted page table."""
    step = StepState(0, np.array([2, 0, 3]), np.array(lens, dtype=np.int32))
    assignment = compact(assign_pages(np.array(reserve), 4, 0.5, seed=3), [step])
    return step, stages.layer_caches(s, assignment, "cpu", 7, layers)


# ---------------------------------------------------------------- the stage and its config section


def test_stage_rows_name_the_commands_and_their_flags():
    assert by_command("model-step") == ("model_step", STAGES["model_step"])
    assert STAGES["model_step"].flags == (("seed", "seed"),)
    assert STAGES["model_step_external"].flags == (("trace", "path"),)
    # Both write raw/model_step/, outside the job grid of `all` (named targets).
    assert {STAGES[s].folder for s in ("model_step", "model_step_external")} == {"model_step"}
    assert not STAGES["model_step"].raw and not STAGES["model_step_external"].raw
    assert not hasattr(ms, "main") and not hasattr(ms, "DEFAULTS")   # one CLI: pkv measure


def test_the_section_is_required_and_config_yaml_names_every_key():
    paper = effective(RAW, "paper")
    for cfg in (paper, effective(RAW, "smoke")):
        absent = {k: v for k, v in cfg.items() if k != "model_step"}
        with pytest.raises(ConfigError, match="model_step: missing key"):
            Config.from_dict(absent)
        partial = {**cfg, "model_step": {k: v for k, v in cfg["model_step"].items() if k != "steps"}}
        with pytest.raises(ConfigError, match="model_step.steps: missing key"):
            Config.from_dict(partial)
    # The smoke profile runs its `smoke:` section's keys over the paper section's.
    assert mp.settings(smoke_cfg()).shapes == tuple(RAW["smoke"]["model_step"]["shapes"])
    assert mp.settings(smoke_cfg()).kv_dtypes == tuple(RAW["model_step"]["kv_dtypes"])
    got = mp.settings(smoke_cfg(steps=2, buckets=[2]))
    assert got.steps == 2 and got.buckets == (2,) and got.shapes == mp.settings(smoke_cfg()).shapes
    # config.yaml's section (8 steps per seed) is the reference run's, whose config is committed.
    assert mp.settings(Config.from_dict(paper)).steps == RAW["model_step"]["steps"] == 8
    committed = json.loads((REPO / "results" / "config.json").read_text())
    assert config_hash(effective(RAW, "paper", {"run": "reference"})) == config_hash(committed)


def test_the_schema_names_the_shapes_and_engines_the_code_has():
    props = load_schema()["$defs"]["sections"]["model_step"]["properties"]
    assert props["shapes"]["items"]["enum"] == list(runners.MODEL_SHAPES)
    assert set(props["engines"]["items"]["enum"]) == {*runners.GPU_ENGINES, *runners.CPU_ENGINES}
    assert props["engines"]["items"]["enum"] == list(table.RUNNERS)     # set at load from the runner table


@pytest.mark.parametrize("section, message", [
    ({"engines": ["nope"]}, "model_step.engines"),
    ({"shapes": ["llama-3t"]}, "model_step.shapes"),
    ({"buckets": [0]}, "model_step.buckets"),
    ({"typo": 1}, "typo"),
])
def test_the_schema_refuses_a_bad_section(section, message):
    cfg = {**copy.deepcopy(SMOKE), "model_step": {**SMOKE["model_step"], **section}}
    with pytest.raises(ValueError, match=message):
        validate_config(cfg, load_schema(), "config")


def test_plan_refuses_engines_of_the_other_profile_and_fp8_first():
    with pytest.raises(ConfigError, match="smoke profile runs engines from pkv-graph, reference"):
        smoke_plan(engines=["flashinfer-graph"])
    with pytest.raises(ConfigError, match="16-bit cache"):
        smoke_plan(kv_dtypes=["fp8", "auto"])


def test_smoke_end_to_end_through_pkv_measure(frozen, capsys):
    out = frozen / "raw" / "model_step" / f"s{SEED}.parquet"
    assert measure(frozen, "model-step", "--seed", str(SEED), out=out) == 0
    ext = frozen / "raw" / "model_step" / "azure2023.parquet"
    assert measure(frozen, "model-step-external", "--trace", str(REPO / SMOKE["external"]["path"]), out=ext) == 0
    frame = pq.read_table(out).to_pandas()
    assert list(frame.columns) == list(ms.COLUMNS)
    assert set(frame["engine"]) == {"pkv-graph", "reference"} and set(frame["kind"]) == {"step", "pipelined"}
    assert set(frame["model"]) == {"smoke", "smoke-gqa8"} and set(frame["kv_dtype"]) == {"auto", "fp8"}
    assert (frame["kv_layers"] == frame["layers"]).all() and set(frame["family"]) == {"bimodal"}
    steps = frame[frame["kind"] == "step"]
    assert not steps["failed"].any() and steps["wall_s"].gt(0).all() and steps["device_s"].isna().all()
    assert (steps[steps["kv_dtype"] == "auto"]["rel_err"] < 1e-3).all()
    fp8 = steps[steps["kv_dtype"] == "fp8"]["rel_err"]   # FP8's accuracy: rounding, well inside the bound
    assert (fp8 > 1e-4).all() and (fp8 < ms.FP8_TOLERANCE).all()
    meta = read_meta(out)
    for key in ("git_commit", "torch", "config_hash", "constants_hash", "command", "method", "profile",
                "kv_memory", "simulated_layers", "memory_note"):
        assert key in meta
    assert meta["profile"] == "smoke" and meta["command"] == f"pkv measure model-step --seed {SEED}"
    mem = json.loads(meta["kv_memory"])[f"smoke/bimodal-{SEED}"]
    shape = runners.MODEL_SHAPES["smoke"].attention(SMOKE["shape"]["page_size"], SMOKE["shape"]["dtype"])
    assert mem["bytes_16bit"] == mp.kv_bytes(shape, mem["pages"], 2) > 0
    assert set(pq.read_table(ext).to_pandas()["family"]) == {"external"}

    md = frozen / "tables" / "model_step.md"
    assert rm.main(["--target", str(md)]) == 0
    text = md.read_text()
    assert "CPU smoke — not a performance result" in text and "| smoke-gqa8 " in text and "| fp8 " in text
    assert "served at max_active = 1 and 4 (continuous batching)" in text      # the smoke section's buckets
    assert "its own KV tensor" in text and "Azure conv" in text
    assert re.search(r"\| 0/\d+ +\|", text) and not re.search(r"\| [1-9]\d*/\d+ +\|", text)


def test_the_calibration_seed_is_refused_in_one_line(frozen, capsys):
    cal = SMOKE["seeds"]["calibration"]
    assert measure(frozen, "model-step", "--seed", str(cal)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is the calibration seed" in err[0] and "model_step runs on the held-out seeds" in err[0]
    assert not (frozen / "out.parquet").exists()
    with pytest.raises(SystemExit):   # --seed is required
        measure(frozen, "model-step")


# ---------------------------------------------------------------- per-layer KV


def test_each_layer_attends_over_its_own_kv():
    """pkv-graph through the public DecodeWrapper (one update(), run per layer): layer i's
    attention equals the FP32 reference over layer i's own cache, not another layer's."""
    shape = runners.MODEL_SHAPES["smoke-gqa8"]
    s = shape.attention(4, "float16")
    step, caches = per_layer(s, [9, 30, 1], [12, 31, 40, 5], shape.layers)
    model = runners.DecoderModel(shape, torch.float16, "cpu", 1)
    runner = mr.PkvGraphRunner(model, caches, {4: torch.zeros(4, shape.hidden, dtype=torch.float16)}, [4])
    runner.prepare(step, 4)
    attend = runner.attend(4)
    q = caches[0].query(4, 5)
    table = caches[0].block_table[torch.as_tensor(step.request_ids)]
    lens = torch.as_tensor(step.seq_lens)
    outs = [attend(i, q)[:3].float() for i in range(shape.layers)]
    for i, c in enumerate(caches):
        ref = attention_reference(q[:3], c.values(), table, lens)
        torch.testing.assert_close(outs[i], ref, atol=2e-3, rtol=2e-3)
        assert not torch.allclose(outs[i], attention_reference(q[:3], caches[1 - i].values(), table, lens), atol=1e-2)
    assert not torch.equal(caches[0].kv, caches[1].kv)
    assert all(c.block_table is caches[0].block_table or torch.equal(c.block_table, caches[0].block_table)
               for c in caches)


def test_compact_keeps_only_the_pages_the_steps_read():
    a = assign_pages(np.array([40, 17, 3, 64]), 16, 0.5, seed=7)
    steps = [StepState(0, np.array([0, 3]), np.array([20, 5], dtype=np.int32)),
             StepState(1, np.array([0]), np.array([33], dtype=np.int32))]
    c = compact(a, steps)
    assert c.num_pages == 3 + 1   # request 0 reads 3 pages at its longest (33 tokens), request 3 one
    for st in steps:   # the pages each row reads are distinct, in range, and in the original physical order
        old = flashinfer_view(a, st.request_ids, st.seq_lens).indices
        new = flashinfer_view(c, st.request_ids, st.seq_lens).indices
        assert new.max() < c.num_pages and len(set(new)) == len(new)
        assert (np.argsort(old) == np.argsort(new)).all()


def test_model_shapes_and_the_70b_like_shape():
    assert runners.MODEL_SHAPES["llama-1b"] == runners.ModelShape("llama-1b", 16, 2048, 32, 8, 64, 8192)
    assert runners.MODEL_SHAPES["llama-8b"] == runners.ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336)
    big = runners.MODEL_SHAPES["llama-70b"]
    s = big.attention(16, "float16")
    assert (big.hidden, big.num_qo_heads, big.num_kv_heads, big.head_dim, big.mlp) == (8192, 64, 8, 128, 28672)
    assert s.group == 8 and big.qkv == 10240 and big.of_layers == 80 and big.layers < big.of_layers
    assert runners.MODEL_SHAPES["smoke-gqa8"].attention(4, "float16").group == 8
    with pytest.raises(ValueError, match="hidden"):
        runners.ModelShape("bad", 2, 100, 4, 2, 16, 64)
    m = runners.DecoderModel(runners.MODEL_SHAPES["smoke-gqa8"], torch.float16, "cpu", 0)
    assert len(m.layers) == 2 and m.layers[0].wqkv.shape == (512, (8 + 2) * 64)


def _weight_bytes(shape) -> int:
    return shape.layers * shape.layer_weight_bytes(2)


def test_layer_weight_bytes_count_the_models_tensors():
    m = runners.DecoderModel(runners.MODEL_SHAPES["smoke-gqa8"], torch.float16, "cpu", 0)
    layer = m.layers[0]
    tensors = (layer.ln1, layer.wqkv, layer.wo, layer.ln2, layer.wgu, layer.wdown)
    assert m.shape.layer_weight_bytes(2) == sum(t.numel() * t.element_size() for t in tensors)


def _paper_pages():
    """The pages each paper trace's measured steps read, by model shape (the largest per shape)."""
    cfg = Config.from_dict(effective(RAW, "paper"))
    d = mp.settings(cfg)
    traces = [ms.synthetic_trace(cfg, f, s) for f in d.families for s in cfg.seeds.heldout]
    traces.append(ms.external_trace(cfg, REPO / cfg.external.path))
    worst = {}
    for name in d.shapes:
        s = runners.MODEL_SHAPES[name].attention(cfg.shape.page_size, cfg.shape.dtype)
        for t in traces:
            steps = [st for b in d.buckets for st in mp.spread_steps(t, b, d.steps)]
            worst[name] = max(worst.get(name, 0), stages.layer_assignment(t, s, cfg.measure.holes, 1, steps).num_pages)
    return cfg, worst


def test_the_paper_shapes_fit_an_h200():
    """docs/graph-decode.md's arithmetic on the paper config's traces: per-layer KV (the pages
    the measured steps read, 16-bit; FP8 replaces it in place) plus one shape's weights < 139 GiB."""
    cfg, pages = _paper_pages()
    worst = {}
    for name, n in pages.items():
        shape = runners.MODEL_SHAPES[name]
        s = shape.attention(cfg.shape.page_size, cfg.shape.dtype)
        # + one layer of FP8 during the in-place quantization
        worst[name] = _weight_bytes(shape) + mp.kv_bytes(s, n, shape.layers) + mp.kv_bytes(s, n, 1)
        assert mp.fitted(shape, s, n, 139 * 2 ** 30) is shape      # the stage runs every configured layer
    assert max(worst.values()) < 139 * 2 ** 30 * 0.9, {k: v / 2 ** 30 for k, v in worst.items()}
    # 80 layers of the 70B-like shape would not: why it is simulated with fewer.
    full = runners.ModelShape("llama-70b", 80, 8192, 64, 8, 128, 28672)
    assert _weight_bytes(full) > 139 * 2 ** 30 * 0.9


def test_a_smaller_card_simulates_the_model_with_the_layers_that_fit():
    """An H100's 79 GiB hold neither the 8B-like shape's 32 layers of bimodal B8 KV nor the
    70B-like shape's 24: each runs the most layers that fit beside the reserve and one FP32
    draw, named as a simulation of the model's own count; a card short of one layer is refused."""
    cfg, pages = _paper_pages()
    h100 = 79 * 2 ** 30
    for name in ("llama-8b", "llama-70b"):
        shape = runners.MODEL_SHAPES[name]
        s = shape.attention(cfg.shape.page_size, cfg.shape.dtype)
        fit = mp.fitted(shape, s, pages[name], h100)
        assert 1 <= fit.layers < shape.layers and fit.of_layers == (shape.of_layers or shape.layers)
        assert (fit.hidden, fit.mlp, fit.name) == (shape.hidden, shape.mlp, shape.name)
        # n layers need n * per_layer (weights, KV) + fixed (the FP32 draw of the layer being made, the reserve).
        per_layer = fit.layer_weight_bytes(2) + mp.kv_bytes(s, pages[name], 1)
        fixed = 2 * mp.kv_bytes(s, pages[name], 1) + mp.RESERVE_BYTES
        assert fit.layers * per_layer + fixed <= h100 < (fit.layers + 1) * per_layer + fixed
        with pytest.raises(MemoryError, match=rf"{name}: one layer of {pages[name]} KV pages needs .* GiB is free"):
            mp.fitted(shape, s, pages[name], per_layer + fixed - 1)
    small = runners.MODEL_SHAPES["smoke"]
    assert mp.fitted(small, small.attention(4, "float16"), 10 ** 9, None) is small    # the CPU: no limit


def test_the_stage_runs_the_layers_that_fit_and_names_the_simulation(monkeypatch):
    """run() sizes each shape before building it: one layer of `smoke` fits (its rows, caches
    and `simulated` say 1 of 2), none of `smoke-gqa8` (named in dropped; nothing of it runs)."""
    real = mp.fitted

    def free_for_one_layer(shape, s, pages, free):
        one = mp.RESERVE_BYTES + 3 * mp.kv_bytes(s, pages, 1) + shape.layer_weight_bytes(s.itemsize)
        return real(shape, s, pages, one if shape.name == "smoke" else one - 1)

    monkeypatch.setattr(ms, "fitted", free_for_one_layer)
    plan = smoke_plan(buckets=[2], steps=1, kv_dtypes=["auto"])
    dropped, memory, simulated = {}, {}, {}
    frame = ms.run(plan, log=lambda m: None, dropped=dropped, memory=memory, simulated=simulated)
    assert set(frame["model"]) == {"smoke"} and set(frame["layers"]) == {1} and set(frame["kv_layers"]) == {1}
    assert not frame[frame["kind"] == "step"]["failed"].any()
    assert simulated == {"smoke": "1 of 2 layers"} and memory[f"smoke/bimodal-{SEED}"]["layers"] == 1
    assert list(dropped) == ["smoke-gqa8"] and dropped["smoke-gqa8"].startswith("MemoryError: model shape smoke-gqa8")


def test_a_stage_sizes_its_shapes_over_every_held_out_seed(monkeypatch):
    """Every seed's file of `pkv measure model-step` runs the same layers: the fit reads the most
    pages any held-out seed's trace reads, not the seed's own (the external stage: its trace)."""
    cfg = smoke_cfg()
    seen = {}

    def stage(cfg, k, jobs, command, sizing=None):
        seen[command] = ([j.seed for j in jobs], sorted({j.seed for j in sizing or jobs}))

    monkeypatch.setattr(ms, "_stage", stage)
    ms.model_step(cfg, None, SEED)
    assert seen[f"pkv measure model-step --seed {SEED}"] == ([SEED], sorted(cfg.seeds.heldout))

    sizing = [mp.TraceJob(t.name, "bimodal", s, t) for s in cfg.seeds.heldout
              for t in (ms.synthetic_trace(cfg, "bimodal", s),)]
    plan = mp.build_plan(cfg, [j for j in sizing if j.seed == SEED], None, sizing)
    shape = runners.MODEL_SHAPES["smoke"].attention(cfg.shape.page_size, cfg.shape.dtype)
    pages = {j.seed: ms._layout(plan, shape, j).assignment.num_pages for j in sizing}
    assert len(set(pages.values())) > 1       # the seeds differ, so the bound is not the own trace's by chance
    own = {j.name: ms._layout(plan, shape, j) for j in plan.traces}
    assert ms._sizing_pages(plan, shape, own) == max(pages.values())
    assert ms._sizing_pages(mp.build_plan(cfg, plan.traces), shape, own) == pages[SEED]


# ---------------------------------------------------------------- buckets, padding, failures


def test_bucket_of():
    buckets = [32, 1, 8]
    assert [mp.bucket_of(b, buckets) for b in (1, 2, 7, 8, 9, 31, 32)] == [1, 8, 8, 8, 32, 32, 32]
    for bad in (0, 33):
        with pytest.raises(ValueError, match="fits none of the batch buckets"):
            mp.bucket_of(bad, buckets)


def test_padded_flashinfer_view():
    assignment = assign_pages(np.array([40, 17, 3, 64, 5]), 16, 0.5, seed=7)
    step = StepState(0, np.array([3, 0, 2]), np.array([33, 40, 1], dtype=np.int32))
    real = flashinfer_view(assignment, step.request_ids, step.seq_lens)
    v = padded_flashinfer_view(assignment, step, 8, pad_page=0)
    assert len(v.indptr) == 9 and len(v.last_page_len) == 8
    np.testing.assert_array_equal(v.indptr[:4], real.indptr)
    np.testing.assert_array_equal(v.indices[:real.indptr[-1]], real.indices)
    np.testing.assert_array_equal(v.last_page_len[:3], real.last_page_len)
    # Padding rows: one page each (page 0), one token on it.
    np.testing.assert_array_equal(np.diff(v.indptr)[3:], np.ones(5))
    np.testing.assert_array_equal(v.indices[real.indptr[-1]:], np.zeros(5))
    np.testing.assert_array_equal(v.last_page_len[3:], np.ones(5))
    assert v.indptr.dtype == v.indices.dtype == v.last_page_len.dtype == np.int32
    with pytest.raises(ValueError, match="cannot be padded"):
        padded_flashinfer_view(assignment, step, 2)


def test_spread_steps_cover_the_whole_trace():
    from pkv.core.harness import decode_steps
    from pkv.core.traces import SyntheticSpec, synthetic

    trace = synthetic(SyntheticSpec("bimodal", 3, num_requests=6, decode_min=4, decode_max=9, scale=1 / 64))
    every = list(decode_steps(trace, 4))
    picked = mp.spread_steps(trace, 4, 5)
    assert [s.step for s in picked] == [every[i].step for i in np.linspace(0, len(every) - 1, 5).round().astype(int)]
    assert [s.step for s in mp.spread_steps(trace, 4, 10_000)] == [s.step for s in every]


def test_adaptive_point():
    k = SimpleNamespace(operating_points={"bimodal-b4": {}, "bimodal-b8": {}, "zipf-b8": {}})
    assert mp.adaptive_point(k, "bimodal", 8, "fb") == "bimodal-b8"
    assert mp.adaptive_point(k, "bimodal", 32, "fb") == "bimodal-b8"
    assert mp.adaptive_point(k, "bimodal", 1, "fb") == "bimodal-b4"
    assert mp.adaptive_point(k, "external", 8, "fb") == "fb"


def test_padded_steps_match_the_reference():
    """Steps of 2-4 rows run in bucket 8: pkv-graph (padded, its CPU oracle) equals the reference."""
    frame = ms.run(smoke_plan(("homogeneous",), buckets=[1, 8], steps=2, shapes=["smoke"], kv_dtypes=["auto"]),
                   log=lambda m: None)
    steps = frame[(frame["kind"] == "step") & (frame["max_active"] == 8)]
    padded = steps[steps["bucket"] == 8]
    assert len(padded) and (padded["active"] < 8).all() and 4 in set(padded["active"])
    assert not steps["failed"].any() and (steps["rel_err"] < 1e-3).all()


def test_a_wrong_attention_fails_the_check(monkeypatch):
    monkeypatch.setattr(mr.PkvGraphRunner, "attend", lambda self, bucket: (lambda i, q: torch.zeros_like(q)))
    frame = ms.run(smoke_plan(buckets=[4], steps=2, shapes=["smoke"]), log=lambda m: None)
    steps = frame[frame["kind"] == "step"]
    assert steps[steps["engine"] == "pkv-graph"]["failed"].all()
    assert not steps[steps["engine"] == "reference"]["failed"].any()


def test_failures_drop_an_engine_or_a_job_and_keep_the_rest(monkeypatch):
    def broken_capture(self, bucket, step):
        raise RuntimeError("capture failed\nsecond line")

    monkeypatch.setattr(mr.PkvGraphRunner, "capture", broken_capture)
    plan = smoke_plan(("bimodal", "zipf"), buckets=[2], steps=1, shapes=["smoke"], kv_dtypes=["auto"])
    real = ms.measure_job

    def measure_job(plan, model, caches, job, *rest):
        if job.family == "zipf":
            raise ValueError("measurement failed")
        return real(plan, model, caches, job, *rest)

    monkeypatch.setattr(ms, "measure_job", measure_job)
    dropped = {}
    frame = ms.run(plan, log=lambda m: None, dropped=dropped)
    assert set(frame["engine"]) == {"reference"} and set(frame["family"]) == {"bimodal"}
    assert dropped == {"pkv-graph": "RuntimeError: capture failed",
                       f"smoke/zipf-{SEED}": "ValueError: measurement failed"}


# ---------------------------------------------------------------- the report on synthetic frames


def synthetic_frame(kv: bool = False) -> pd.DataFrame:
    """Two seeds; pkv-graph takes half of flashinfer-graph's wall and device time per step and
    pipelines at 1.5x its throughput; one failed check. With `kv`: also an FP8 cache on which
    every engine is 2x faster than on 16-bit, at rel. error 2e-2."""
    rows = []
    times = {"pkv-graph": (1.0, 0.5, 3.0), "flashinfer-graph": (2.0, 1.0, 2.0), "flashinfer-eager": (4.0, 2.0, 1.0)}
    for kv_dtype, speed, err in (("auto", 1.0, 1e-4), ("fp8", 2.0, 2e-2))[:2 if kv else 1]:
        for seed in (1, 2):
            for engine, (wall, dev, pipe) in times.items():
                base = {c: None for c in ms.COLUMNS}
                base.update(stage="model_step", model="llama-1b", layers=16, hidden=2048, head_dim=64,
                            num_qo_heads=32, num_kv_heads=8, mlp=8192, window=0, global_every=0, sinks=False,
                            q_len=1, dtype="float16", kv_dtype=kv_dtype,
                            kv_layers=16, trace=f"bimodal-{seed}", family="bimodal", seed=seed, max_active=8,
                            bucket=8, engine=engine, route=engine,
                            launch="eager" if engine.endswith("eager") else "graph")
                for step in range(3):
                    rows.append({**base, "kind": "step", "step": step, "active": 8, "total_tokens": 8000 + step,
                                 "max_len": 1000, "steps": 1, "tokens": 8,
                                 "wall_s": wall * 1e-3 * (1 + 0.1 * step) / speed, "prepare_s": 20e-6,
                                 "device_s": dev * 1e-3 * (1 + 0.1 * step) / speed, "rel_err": err,
                                 "max_rel_err": 2 * err,
                                 "failed": engine == "pkv-graph" and seed == 2 and step == 1 and kv_dtype == "auto"})
                rows.append({**base, "kind": "pipelined", "step": -1, "active": 8, "total_tokens": 24003,
                             "max_len": 1000, "steps": 3, "tokens": 24, "wall_s": 24 / (1000 * pipe * speed),
                             "prepare_s": math.nan, "device_s": math.nan, "rel_err": math.nan,
                             "max_rel_err": math.nan, "failed": False})
    frame = pd.DataFrame(rows, columns=list(ms.COLUMNS)).astype(ms.COLUMNS)
    return frame if kv else frame.drop(columns=["kv_dtype", "kv_layers"])   # without: the earlier files' columns


def test_report_ratios_on_a_synthetic_frame(tmp_path):
    frame = synthetic_frame()
    t = rm.t_model_step(SimpleNamespace(frame=frame))
    assert list(t["Engine"]) == ["pkv-graph", "flashinfer-graph", "flashinfer-eager"] and "KV" not in t
    row = t.iloc[0]
    assert row["Wall × flashinfer-graph"] == "2.000±0.000" and row["Device × flashinfer-graph"] == "2.000±0.000"
    assert row["Pipelined × flashinfer-graph"] == "1.500±0.000"
    assert row["Wall ms"] == "1.100" and row["Pipelined tok/s"] == "3000" and row["Prepare µs"] == "20.0"
    assert row["Check fails"] == "1/6" and row["Seeds"] == 2
    assert t.iloc[2]["Wall × flashinfer-graph"] == "0.500±0.000"

    write_parquet(frame, tmp_path / "raw" / "model_step" / "a.parquet",
                  {"gpu": "NVIDIA H200", "profile": "paper", "command": "pkv measure model-step --seed 1",
                   "skipped": '["llama-8b/zipf-1/B32"]'})
    md, png = tmp_path / "tables" / "model_step.md", tmp_path / "figures" / "model_step.png"
    rm.write_targets(tmp_path, [md, png])
    text = md.read_text()
    assert "not a performance result" not in text and "NVIDIA H200" in text
    assert "skipped past the time budget: llama-8b/zipf-1/B32" in text and "pkv measure model-step" in text
    assert png.stat().st_size > 1000


def test_report_per_kv_dtype_with_accuracy_and_the_16_bit_ratio(tmp_path):
    t = rm.t_model_step(SimpleNamespace(frame=synthetic_frame(kv=True)))
    assert list(t["KV"]) == ["16-bit"] * 3 + ["fp8"] * 3
    fp8 = t[(t["KV"] == "fp8") & (t["Engine"] == "pkv-graph")].iloc[0]
    assert fp8["Device × flashinfer-graph"] == "2.000±0.000"            # over FlashInfer FP8
    assert fp8["Device × flashinfer-graph 16-bit"] == "4.000±0.000"     # over FlashInfer 16-bit
    assert fp8["Rel err (max)"] == "2.0e-02" and fp8["Check fails"] == "0/6"
    b16 = t[(t["KV"] == "16-bit") & (t["Engine"] == "flashinfer-graph")].iloc[0]
    assert b16["Device × flashinfer-graph 16-bit"] == "1.000±0.000" and b16["Rel err (max)"] == "1.0e-04"
    write_parquet(synthetic_frame(kv=True), tmp_path / "raw" / "model_step" / "s1.parquet",
                  {"gpu": "NVIDIA H200", "simulated_layers": json.dumps({"llama-70b": "24 of 80 layers"})})
    text = rm.render_md(*rm.load(tmp_path))
    assert "its own KV tensor" in text and "simulated layers: llama-70b: 24 of 80 layers" in text
    assert "served at max_active = 8 (continuous batching)" in text


def test_report_refuses_a_missing_stage_and_mixed_gpus(tmp_path):
    with pytest.raises(ValueError, match="no Parquet"):
        rm.load(tmp_path)
    frame = synthetic_frame()
    for name, gpu in (("a", "NVIDIA H200"), ("b", "NVIDIA H100")):
        write_parquet(frame, tmp_path / "raw" / "model_step" / f"{name}.parquet", {"gpu": gpu})
    with pytest.raises(ValueError, match="several GPU models"):
        rm.load(tmp_path)


@pytest.mark.parametrize("name", table.cpu_engines())
def test_one_plan_serves_every_layer_on_its_own_kv(name):
    """Any engine: one prepare() a step, then run(q, plan, caches[i]) reads layer i's KV (not
    the engine's own cache); a cache over another page table is refused by name."""
    from pkv.engines import make_engine

    s = runners.MODEL_SHAPES["smoke"].attention(4, "float16")
    step, caches = per_layer(s, [30, 9, 1], [12, 31, 40, 5], 3)
    options = {"constants": cpu_constants(), "point": "p"} if name == "adaptive" else {}
    engine = make_engine(name, caches[0], **options)
    plan = engine.prepare(step)
    rows = getattr(plan, "rows", step.active)
    q = caches[0].query(rows, 5)
    table, lens = caches[0].block_table[torch.as_tensor(step.request_ids)], torch.as_tensor(step.seq_lens)
    for c in caches:
        out = engine.run(q, plan, c)[:step.active].float()
        torch.testing.assert_close(out, attention_reference(q[:step.active], c.values(), table, lens),
                                   atol=2e-3, rtol=2e-3)
    other = stages.layer_caches(s, assign_pages(np.array([12, 31, 40, 5]), 4, 0.5, seed=4), "cpu", 7, 1)[0]
    with pytest.raises(ValueError, match="share the engine's page table"):
        engine.run(q, plan, other)


@pytest.mark.parametrize("graph", [True, False], ids=["routed-to-pkv-graph", "routed-to-a-host-scheduled-route"])
def test_the_router_runner_plans_once_and_reads_each_layers_kv(graph):
    """adaptive in the model step: one engine, one prepare() a step, each layer its own KV:
    the runner's output equals the reference runner's over the same per-layer caches."""
    shape = runners.MODEL_SHAPES["smoke"]
    s = shape.attention(4, "float16")
    step, caches = per_layer(s, [301, 150, 40], [160, 310, 400, 50], shape.layers)
    model = runners.DecoderModel(shape, torch.float16, "cpu", 1)
    xs = {4: torch.randn(4, shape.hidden).to(torch.float16)}
    k = cpu_constants(min_context=1) if graph else cpu_constants(graph=None, min_context=1)
    got = mr.build_runners(["adaptive", "reference"], model, caches, xs, [4], constants=k, point="p")
    outs = {}
    for name, runner in got.items():
        runner.prepare(step, 4)
        outs[name] = runner.launch(step, 4)[:step.active].float()   # graph runners return the bucket's rows
    assert got["adaptive"].route.startswith("pkv-graph" if graph else "pkv-")
    torch.testing.assert_close(outs["adaptive"], outs["reference"], atol=2e-2, rtol=2e-2)
    # A step routed to pkv-graph runs pkv-graph's per-bucket runner (its captured graph on a
    # GPU), any other route the adaptive engine's plan over the layers.
    runner = got["adaptive"]
    assert (runner.current is runner.graph) == graph and (runner.current is runner.eager) != graph
    assert runner.launch_kind == runner.current.launch_kind


def test_the_fp8_pass_runs_the_engines_that_read_fp8_and_names_the_others(monkeypatch):
    """adaptive reads no FP8 cache (its host-scheduled routes read 16-bit KV): the FP8 pass measures the
    other engines and names adaptive in `dropped`, instead of losing the whole FP8 pass."""
    monkeypatch.setattr(mp, "CPU_ENGINES", ("pkv-graph", "reference", "adaptive"))
    cfg = smoke_cfg(buckets=[2], steps=1, shapes=["smoke"], kv_dtypes=["auto", "fp8"],
                    engines=["pkv-graph", "reference", "adaptive"])
    jobs = [mp.TraceJob(t.name, "bimodal", SEED, t) for t in (ms.synthetic_trace(cfg, "bimodal", SEED),)]
    plan = mp.build_plan(cfg, jobs, constants=cpu_constants(min_context=1, operating_points={
        "bimodal-b8": {"bucket": 4, "workqueue": 4}}))
    dropped = {}
    frame = ms.run(plan, log=lambda m: None, dropped=dropped)
    by_dtype = frame.groupby("kv_dtype")["engine"].apply(set).to_dict()
    assert by_dtype["auto"] == {"pkv-graph", "reference", "adaptive"}
    assert by_dtype["fp8"] == {"pkv-graph", "reference"}
    assert list(dropped) == ["adaptive/fp8"] and "16-bit" in dropped["adaptive/fp8"]
