"""The model-level decode step on the GPU (pkv measure model-step): per-layer KV, the whole
N-layer step captured once per bucket (pkv-graph through the public DecodeWrapper, and
FlashInfer's CUDA-graph path) and replayed over ragged, padded steps, checked at every step
against the correctness baseline on the 16-bit cache (FlashInfer eager; for a sink model, which
FlashInfer's planned decode would run without its sinks, XQA's graph path), on the 16-bit and on
the FP8 cache.

Small shapes (4 layers) so the tests take seconds; the benchmark itself is the stage
(`pkv measure model-step --seed S`, workflow/rules/model.smk).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from pkv.config.resolve import effective
from pkv.config.typed import Config
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.engines import model as runners
from pkv.engines import table
from pkv.measure import model_plan as mp
from pkv.measure import model_runners as mr
from pkv.measure import model_step as ms
from pkv.measure import stages

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

REPO = Path(__file__).resolve().parents[2]
RAW = yaml.safe_load((REPO / "config.yaml").read_text())
ENGINES = ["pkv-graph", "flashinfer-graph", "flashinfer-eager"]


def plan(shape: runners.ModelShape, kv_dtypes, engines=ENGINES, constants=None, q_lens=(1,)) -> mp.ModelStepPlan:
    section = {**RAW["model_step"], "buckets": [1, 8, 32], "steps": 3, "engines": engines, "kv_dtypes": kv_dtypes,
               "q_lens": list(q_lens)}
    raw = {**RAW, "model_step": section}
    cfg = Config.from_dict(effective(raw, "paper"))
    seed = cfg.seeds.heldout[0]
    jobs = [mp.TraceJob(t.name, f, seed, t) for f in ("homogeneous", "bimodal")
            for t in (ms.synthetic_trace(cfg, f, seed),)]
    p = mp.build_plan(cfg, jobs, constants)
    p.shapes = [shape]
    return p


@pytest.mark.parametrize("kv_heads", [2, 1])   # GQA-4 (8B-like) and GQA-8 (70B-like)
def test_four_layers_per_layer_kv_in_one_graph_match_flashinfer_eager(kv_heads):
    heads, d = 8, 128
    shape = runners.ModelShape(f"tiny-g{heads // kv_heads}", 4, heads * d, heads, kv_heads, d, 4 * heads * d)
    dropped = {}
    frame = ms.run(plan(shape, ["auto", "fp8"]), log=print, dropped=dropped)
    assert dropped == {}
    steps = frame[frame["kind"] == "step"]
    assert set(steps["engine"]) == set(ENGINES) and set(steps["kv_dtype"]) == {"auto", "fp8"}
    assert (steps["kv_layers"] == 4).all()
    assert set(steps[steps["engine"] != "flashinfer-eager"]["launch"]) == {"graph"}
    assert (steps["bucket"] > steps["active"]).any()   # padded steps ran
    bad = steps[steps["failed"]]
    assert bad.empty, bad[["trace", "kv_dtype", "max_active", "step", "engine", "rel_err"]].to_string()
    assert steps["device_s"].gt(0).all() and steps["prepare_s"].gt(0).all()
    auto = steps[steps["kv_dtype"] == "auto"]
    assert (auto["rel_err"] < ms.TOLERANCE["float16"]).all()
    # FP8 against the 16-bit baseline: pkv-graph's rounding error is FlashInfer FP8's, give or take.
    fp8 = steps[steps["kv_dtype"] == "fp8"].groupby("engine")["rel_err"].max()
    assert fp8["pkv-graph"] <= 2 * fp8["flashinfer-graph"] + 1e-3, fp8.to_dict()
    pipe = frame[frame["kind"] == "pipelined"]
    assert (pipe["wall_s"] > 0).all() and len(pipe) == 2 * 2 * 3 * 3   # kv dtypes x traces x buckets x engines


def test_the_captured_graph_reads_each_layers_kv_and_the_new_metadata():
    """One graph over 4 layers' own caches: a ragged padded step, then a second step with other
    lengths replayed after update(), each against the FP32 reference of every layer's own KV."""
    shape = runners.ModelShape("tiny", 4, 8 * 128, 8, 2, 128, 2048)
    s = shape.attention(16, "float16")
    a = assign_pages(np.array([700, 90, 3000, 17, 1500]), 16, 0.5, seed=5)
    caches = stages.layer_caches(s, a, "cuda", 11, shape.layers)
    model = runners.DecoderModel(shape, torch.float16, "cuda", 3)
    xs = {8: torch.zeros(8, shape.hidden, dtype=torch.float16, device="cuda")}
    built = mr.build_runners(["pkv-graph", "reference"], model, caches, xs, [8])
    graph, ref = built["pkv-graph"], built["reference"]
    first = StepState(0, np.array([2, 0, 4]), np.array([3000, 650, 1], dtype=np.int32))
    second = StepState(1, np.array([1, 2, 3, 4, 0]), np.array([90, 17, 5, 1400, 700], dtype=np.int32))
    graph.capture(8, first)
    assert graph.launch_kind == "graph" and 8 in graph.graphs
    for step in (first, second):
        xs[8].normal_()
        xs[8][step.active:].zero_()
        graph.prepare(step, 8)
        out = graph.launch(step, 8)[:step.active].clone()
        ref.prepare(step, 8)
        want = ref.launch(step, 8)
        rel, _ = ms.errors(out, want)
        assert rel < 1e-2, (step.step, rel)
    # The graph reads layer 2's tensor at its address: changing it changes the replay.
    before = graph.launch(second, 8)[:second.active].clone()
    caches[2].kv.mul_(-1)
    after = graph.launch(second, 8)[:second.active].clone()
    assert not torch.allclose(before, after, atol=1e-3)


def test_the_router_over_per_layer_kv_matches_flashinfer_eager():
    """adaptive: one engine, one prepare() a step, every layer runs its plan on its own KV."""
    from pkv.plan.costmodel import Constants

    k = Constants.load(REPO / "results" / "calibration" / "constants.json")
    shape = runners.ModelShape("tiny-router", 4, 32 * 128, 32, 8, 128, 4096)
    dropped = {}
    frame = ms.run(plan(shape, ["auto"], ["flashinfer-eager", "adaptive"], k), log=print, dropped=dropped)
    assert dropped == {}
    steps = frame[frame["kind"] == "step"]
    assert set(steps["engine"]) == {"flashinfer-eager", "adaptive"}
    bad = steps[steps["failed"]]
    assert bad.empty, bad[["trace", "max_active", "step", "route", "rel_err"]].to_string()


def test_steps_the_router_sends_to_pkv_graph_replay_its_captured_graph():
    """adaptive with a pkv-graph fit: the steps routed there replay pkv-graph's per-bucket
    graph (launch "graph") and match FlashInfer eager on every layer's own KV."""
    import dataclasses

    from pkv.plan.costmodel import Constants, GraphFit

    k = Constants.load(REPO / "results" / "calibration" / "constants.json")
    k = dataclasses.replace(k, graph=GraphFit(1e-9, 1e-15, 1e-15, 264, 4), min_context=1)   # pkv-graph wins every step
    shape = runners.ModelShape("tiny-router-graph", 4, 32 * 128, 32, 8, 128, 4096)
    dropped = {}
    frame = ms.run(plan(shape, ["auto"], ["flashinfer-eager", "adaptive"], k), log=print, dropped=dropped)
    assert dropped == {}
    steps = frame[(frame["kind"] == "step") & (frame["engine"] == "adaptive")]
    assert set(steps["route"]) == {"pkv-graph"} and set(steps["launch"]) == {"graph"}
    assert not steps["failed"].any(), steps[steps["failed"]][["trace", "step", "rel_err"]].to_string()


FEATURE_RUNNERS = ["pkv-graph", "flashinfer-graph", "flashinfer-xqa-graph", "flashinfer-eager"]
# A sink logit adds exp(sink) to its head's softmax denominator. Drawn N(0, 1) (DecoderModel), it
# is lost beside the exp of a row's 1.5K-65K N(0, 1) scores: on the CPU (FP32 reference, this
# file's bimodal trace, the first B8 and B32 steps, tiny-swa-sinks) dropping the sinks moves the
# final state by 2.3e-3, inside fp16's tolerance of 1e-2. Shifted by ln 128 + 1/2, a sink weighs
# about as much as a 128-token window's keys (e^(1/2) each), and dropping the sinks moves the
# final state by 0.13 (dropping the windows, by 0.13 too).
SINK_SHIFT = math.log(128) + 0.5


class HeavySinks(runners.DecoderModel):
    """The decoder with every layer's sinks shifted by SINK_SHIFT: a runner that drops them fails the check."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for layer in self.layers:
            if layer.sinks is not None:
                layer.sinks += SINK_SHIFT


@pytest.mark.parametrize("shape, base", [
    # gpt-oss-like: GQA-8 d 64, sinks, window 128 on alternate layers; FlashInfer's planned runners
    # refuse it (its planned decode drops sinks), so XQA's graph path is the check base
    pytest.param(runners.ModelShape("tiny-swa-sinks", 4, 8 * 64, 8, 1, 64, 2048, window=128, global_every=2,
                                    sinks=True), "flashinfer-xqa-graph", id="tiny-swa-sinks"),
    # Gemma-3-like: GQA-2 d 256, window 1024 on 3 layers of 4
    pytest.param(runners.ModelShape("tiny-swa-d256", 4, 4 * 256, 4, 2, 256, 2048, window=1024, global_every=4),
                 "flashinfer-eager", id="tiny-swa-d256"),
])
def test_windowed_and_speculative_steps_match_the_check_base(shape, base, monkeypatch):
    """Each layer's window and sinks (heavy: HeavySinks), decode and a speculative step of 4 tokens
    a row, 16-bit and FP8, every GPU runner that has the features: every step that ran within the
    tolerance of the pass's check base (pkv.engines.table.check_base: FlashInfer eager, or for the
    sink model XQA's graph path). A runner refused or dropped is named (printed); pkv-graph and the
    base must run on 16-bit (a pass without its base is unchecked), and for the sink model the
    planned FlashInfer runners must have been refused, not run without the sinks."""
    monkeypatch.setattr(ms, "DecoderModel", HeavySinks)
    dropped = {}
    frame = ms.run(plan(shape, ["auto", "fp8"], FEATURE_RUNNERS, q_lens=(1, 4)), log=print, dropped=dropped)
    print("dropped:", dropped)
    steps = frame[frame["kind"] == "step"]
    assert set(steps["q_len"]) == {1, 4}
    auto = steps[steps["kv_dtype"] == "auto"]
    for q_len in (1, 4):
        ran = set(auto[auto["q_len"] == q_len]["engine"])
        assert {"pkv-graph", base} <= ran and table.check_base(ran) == base, (q_len, ran, dropped)
    if shape.sinks:
        planned = [f"{shape.name}/{r}{tag}" for r in ("flashinfer-graph", "flashinfer-eager") for tag in ("", "/q4")]
        assert all("passes no sinks" in dropped.get(k, "") for k in planned), dropped
        assert not set(steps["engine"]) & {"flashinfer-graph", "flashinfer-eager"}
    bad = steps[steps["failed"]]
    assert bad.empty, bad[["trace", "kv_dtype", "q_len", "max_active", "step", "engine", "rel_err"]].to_string()
    assert auto["rel_err"].notna().all() and (auto["rel_err"] < ms.TOLERANCE["float16"]).all()
