"""The model step's sliding-window models and its speculative step (pkv measure model-step), on
the CPU: the window and sink shapes (ModelShape.window / global_every / sinks), the speculative
step (model_step.q_lens: q_len query tokens a row), each runner passing every layer's window and
sinks and the step's q_len, the refusals of a runner that lacks one (FlashInfer's planned runners
for a sink model), each pass's correctness baseline and a pass without one, the config key and
the report's label. pkv-graph runs its CPU oracle through the public DecodeWrapper; the FP32
reference is the baseline.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest
import torch

from pkv.config.resolve import ConfigError, load_schema, validate_config
from pkv.config.typed import Config
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages, flashinfer_view
from pkv.engines import model as runners
from pkv.engines import table
from pkv.engines.model_flashinfer import (
    FlashInferEagerRunner,
    FlashInferGraphRunner,
    XqaGraphRunner,
    padded_flashinfer_view,
)
from pkv.kernels.reference import attention_reference
from pkv.measure import model_plan as mp
from pkv.measure import model_runners as mr
from pkv.measure import model_step as ms
from pkv.report import model as rm
from router_constants import cpu_constants
from test_model_step import SMOKE, per_layer, smoke_cfg, smoke_plan

SHAPES = runners.MODEL_SHAPES


# ---------------------------------------------------------------- the shapes


def test_window_patterns_of_the_new_shapes():
    oss, gemma = SHAPES["gpt-oss-20b"], SHAPES["gemma3-4b"]
    assert oss.windows()[:4] == [127, -1, 127, -1] and oss.sinks and oss.attention(16, "float16").group == 8
    assert gemma.windows()[:12] == [1023] * 5 + [-1] + [1023] * 5 + [-1] and not gemma.sinks
    assert gemma.head_dim == 256 and gemma.attention(16, "bfloat16").group == 2
    mistral = runners.ModelShape("mistral-like", 3, 256, 4, 1, 64, 256, window=4096)   # every layer windowed
    assert mistral.windows() == [4095] * 3 and mistral.features() == ["window"]
    assert SHAPES["llama-8b"].windows() == [-1] * 32 and SHAPES["llama-8b"].features() == []
    assert SHAPES["smoke-swa-sinks"].features(4) == ["window", "sinks", "q_len"]
    with pytest.raises(ValueError, match="window >= 1 tokens where global_every is set"):
        runners.ModelShape("bad", 2, 256, 4, 1, 64, 256, global_every=2)
    # A simulated model (fewer layers, model_plan.fitted) keeps its pattern.
    fit = replace(gemma, layers=12, of_layers=34)
    assert fit.windows() == gemma.windows()[:12]


def test_sinks_are_drawn_after_the_weights():
    """A shape with sinks draws them last (float32 [Hq] per layer): a shape without keeps the weights it had."""
    plain = runners.DecoderModel(SHAPES["smoke"], torch.float16, "cpu", 3)
    sunk = runners.DecoderModel(replace(SHAPES["smoke"], sinks=True), torch.float16, "cpu", 3)
    assert all(layer.sinks is None for layer in plain.layers)
    for a, b in zip(plain.layers, sunk.layers):
        assert torch.equal(a.wqkv, b.wqkv) and torch.equal(a.wdown, b.wdown)
        assert b.sinks.dtype == torch.float32 and b.sinks.shape == (4,)
    assert not torch.equal(sunk.layers[0].sinks, sunk.layers[1].sinks)


def test_the_new_shapes_fit_an_h100_at_a_bimodal_b8_step():
    """Weights and per-layer KV of ~300K tokens (bimodal B8 at its longest) on an H100, or the
    layers that fit (model_plan.fitted), at least 8 of them."""
    pages = 300_000 // 16
    for name in ("gpt-oss-20b", "gemma3-4b"):
        shape = SHAPES[name]
        fit = mp.fitted(shape, shape.attention(16, "bfloat16"), pages, 79 << 30)
        assert fit.layers >= 8 and fit.windows() == shape.windows()[:fit.layers]


# ---------------------------------------------------------------- each layer's window and sinks


@pytest.mark.parametrize("q_len", [1, 3])
def test_pkv_graph_passes_each_layers_window_sinks_and_q_len(q_len):
    """pkv-graph through the DecodeWrapper (q_len at construction; window_left and sinks per run):
    layer i's attention equals the FP32 reference with layer i's window and sinks, and differs from
    the attention without them (the lengths are past the window)."""
    shape = SHAPES["smoke-swa-sinks"]
    s = shape.attention(4, "float16")
    step, caches = per_layer(s, [29, 40, 13], [32, 41, 44, 15], shape.layers)
    model = runners.DecoderModel(shape, torch.float16, "cpu", 1)
    runner = mr.PkvGraphRunner(model, caches, {4: torch.zeros(4 * q_len, shape.hidden, dtype=torch.float16)}, [4],
                               q_len=q_len)
    runner.prepare(step, 4)
    attend = runner.attend(4)
    q = caches[0].query(4 * q_len, 5)
    n = step.active * q_len
    table = caches[0].block_table[torch.as_tensor(step.request_ids)]
    lens = torch.as_tensor(step.seq_lens)
    for i, c in enumerate(caches):
        got = attend(i, q)[:n].float()
        want = attention_reference(q[:n], c.values(), table, lens, q_len=q_len, window_left=shape.window_left(i),
                                   sinks=model.layers[i].sinks)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
        plain = attention_reference(q[:n], c.values(), table, lens, q_len=q_len)
        assert not torch.allclose(got, plain, atol=1e-2)


def test_the_reference_runner_reads_rows_of_q_len_tokens():
    shape = SHAPES["smoke-swa-d256"]
    s = shape.attention(4, "float16")
    step, caches = per_layer(s, [29, 40, 13], [32, 41, 44, 15], shape.layers)
    model = runners.DecoderModel(shape, torch.float16, "cpu", 1)
    xs = {4: torch.randn(4 * 2, shape.hidden).to(torch.float16)}
    got = mr.build_runners(["pkv-graph", "reference"], model, caches, xs, [4], q_len=2)
    outs = {}
    for name, r in got.items():
        r.prepare(step, 4)
        outs[name] = r.launch(step, 4)[:step.active * 2].float()
    assert outs["reference"].shape == (6, shape.hidden)
    torch.testing.assert_close(outs["pkv-graph"], outs["reference"], atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------- the stage


@pytest.mark.parametrize("shape", ["smoke-swa-sinks", "smoke-swa-d256"])
def test_windowed_and_speculative_smoke_steps_match_the_reference(shape):
    """The smoke stage on a windowed model, decode and a speculative step of 3 tokens a row, 16-bit
    and FP8: pkv-graph within the tolerance of the FP32 reference on every step. pkv-graph is not
    built with an FP8 cache at head_dim 256: refused at build, named in `dropped`, the rest runs."""
    dropped = {}
    frame = ms.run(smoke_plan(buckets=[1, 4], steps=2, shapes=[shape], q_lens=[1, 3]), log=lambda m: None,
                   dropped=dropped)
    steps = frame[frame["kind"] == "step"]
    assert set(steps["q_len"]) == {1, 3} and not steps["failed"].any()
    assert (steps[steps["kv_dtype"] == "auto"]["rel_err"] < 1e-3).all()
    m = SHAPES[shape]
    assert set(frame["window"]) == {m.window} and set(frame["global_every"]) == {m.global_every}
    assert set(frame["sinks"]) == {m.sinks}
    assert (steps["max_len"] > m.window).any()                        # rows past the window
    ran = steps.groupby(["kv_dtype", "q_len"])["engine"].apply(set).to_dict()
    if shape == "smoke-swa-d256":
        assert ran[("fp8", 1)] == ran[("fp8", 3)] == {"reference"}
        assert sorted(dropped) == [f"{shape}/pkv-graph/fp8", f"{shape}/pkv-graph/fp8/q3"]
        assert "FP8 cache for head_dim" in dropped[f"{shape}/pkv-graph/fp8/q3"]
        assert "\n" not in dropped[f"{shape}/pkv-graph/fp8"]
    else:
        assert all(v == {"pkv-graph", "reference"} for v in ran.values()) and not dropped


@pytest.mark.parametrize("drop", ["window_left", "sinks"])
def test_a_runner_that_drops_a_layers_window_or_sinks_fails_the_check(monkeypatch, drop):
    def attend(self, bucket):
        wrapper, kvs = self.wrappers[bucket], [c.kv for c in self.caches]
        keep = {"window_left": lambda i: {"sinks": self.sinks[i]}, "sinks": lambda i: {"window_left": self.windows[i]}}
        return lambda i, q: wrapper.run(q, kvs[i], **keep[drop](i))

    monkeypatch.setattr(mr.PkvGraphRunner, "attend", attend)
    frame = ms.run(smoke_plan(buckets=[4], steps=2, shapes=["smoke-swa-sinks"], kv_dtypes=["auto"]),
                   log=lambda m: None)
    steps = frame[frame["kind"] == "step"]
    assert steps[steps["engine"] == "pkv-graph"]["failed"].all()
    assert not steps[steps["engine"] == "reference"]["failed"].any()


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("shape, q_len, missing", [
    ("smoke-swa-sinks", 1, "window or sinks"),
    ("smoke-swa-d256", 1, "window"),
    ("smoke", 2, "q_len"),
])
def test_the_router_runner_is_refused_in_one_line(shape, q_len, missing):
    """adaptive's host-scheduled routes take no window, sinks or q_len: refused when built; the
    runner set names it (as not run) and builds the others."""
    m = SHAPES[shape]
    step, caches = per_layer(m.attention(4, "float16"), [29, 40, 13], [32, 41, 44, 15], m.layers)
    model = runners.DecoderModel(m, torch.float16, "cpu", 1)
    xs = {4: torch.zeros(4 * q_len, m.hidden, dtype=torch.float16)}
    k = cpu_constants(min_context=1)
    with pytest.raises(runners.Refused, match=rf"^adaptive: passes no {missing} to its attention"):
        mr.build_runners(["adaptive"], model, caches, xs, [4], constants=k, point="p", q_len=q_len)
    refused = {}
    got = mr.build_runners(["adaptive", "reference"], model, caches, xs, [4], constants=k, point="p", q_len=q_len,
                           refused=refused, tag="/q2")
    key = f"{shape}/adaptive/q2"
    assert list(got) == ["reference"] and list(refused) == [key]
    assert refused[key].endswith(": not run") and "\n" not in refused[key]


def test_the_stage_names_a_refused_runner_and_runs_the_rest(monkeypatch):
    monkeypatch.setattr(mp, "CPU_ENGINES", ("pkv-graph", "reference", "adaptive"))
    cfg = smoke_cfg(buckets=[2], steps=1, shapes=["smoke", "smoke-swa-sinks"], kv_dtypes=["auto"], q_lens=[1, 2],
                    engines=["pkv-graph", "reference", "adaptive"])
    jobs = [mp.TraceJob(t.name, "bimodal", SMOKE["seeds"]["heldout"][0], t)
            for t in (ms.synthetic_trace(cfg, "bimodal", SMOKE["seeds"]["heldout"][0]),)]
    plan = mp.build_plan(cfg, jobs, constants=cpu_constants(min_context=1, operating_points={
        "bimodal-b8": {"bucket": 4, "workqueue": 4}}))
    dropped = {}
    frame = ms.run(plan, log=lambda m: None, dropped=dropped)
    ran = frame.groupby(["model", "q_len"])["engine"].apply(set).to_dict()
    assert ran[("smoke", 1)] == {"pkv-graph", "reference", "adaptive"}
    assert ran[("smoke", 2)] == ran[("smoke-swa-sinks", 1)] == ran[("smoke-swa-sinks", 2)] == {"pkv-graph", "reference"}
    assert sorted(dropped) == ["smoke-swa-sinks/adaptive", "smoke-swa-sinks/adaptive/q2", "smoke/adaptive/q2"]
    assert "passes no window or sinks" in dropped["smoke-swa-sinks/adaptive"]
    assert not frame[frame["kind"] == "step"]["failed"].any()


def test_each_runner_declares_what_it_passes():
    """The XQA graph runner (an engine per distinct window), pkv-graph and the reference pass all
    three; FlashInfer's graph and eager runners (a wrapper per distinct window) pass windows and
    q_len but no sinks (its planned decode drops them); the router passes none."""
    for cls in (XqaGraphRunner, mr.PkvGraphRunner, runners.ReferenceRunner):
        assert set(cls.features) == {"window", "sinks", "q_len"}, cls
    for cls in (FlashInferGraphRunner, FlashInferEagerRunner):
        assert set(cls.features) == {"window", "q_len"}, cls
    assert mr.AdaptiveRunner.features == () and runners.EngineRunner.features == ()


@pytest.mark.parametrize("cls", [FlashInferGraphRunner, FlashInferEagerRunner])
def test_flashinfers_planned_runners_are_refused_for_a_sink_model(cls):
    """A sink model's step refuses FlashInfer's planned runners in one line (they would run it
    without its sinks); a windowed model's speculative step does not."""
    model = runners.DecoderModel(SHAPES["smoke-swa-sinks"], torch.float16, "cpu", 1)
    with pytest.raises(runners.Refused, match=rf"^{cls.name}: passes no sinks to its attention "
                                              r"\(smoke-swa-sinks, q_len 4\): not run$"):
        cls.check(model, 4)
    cls.check(runners.DecoderModel(SHAPES["smoke-swa-d256"], torch.float16, "cpu", 1), 4)


def ran(names, shape, q_len=1):
    """The runners of `names` a model step of `shape` does not refuse for a feature (Runner.check)."""
    import importlib

    model = runners.DecoderModel(shape, torch.float16, "cpu", 1)
    out = []
    for name in names:
        module, _, cls = table.RUNNERS[name].runner.partition(":")
        try:
            getattr(importlib.import_module(module), cls).check(model, q_len)
        except runners.Refused:
            continue
        out.append(name)
    return out


@pytest.mark.parametrize("shape, base", [("smoke-swa-sinks", "flashinfer-xqa-graph"),
                                         ("smoke-swa-d256", "flashinfer-eager"), ("smoke", "flashinfer-eager")])
def test_the_check_base_of_the_gpu_runners(shape, base):
    """Over every GPU runner: FlashInfer eager checks a windowed or plain model's step; a sink
    model's, which eager refuses, is checked against XQA's graph path (pkv.engines.table.check_base);
    with the FP32 reference named, against the reference."""
    for q_len in (1, 4):
        present = ran(table.runners("gpu"), SHAPES[shape], q_len)
        assert table.check_base(present) == base
        assert table.check_base(ran([*table.runners("gpu"), "reference"], SHAPES[shape], q_len)) == \
            ("reference" if base != "flashinfer-eager" else base)


def test_a_pass_without_a_baseline_is_visibly_unchecked(capsys):
    """A pass where no check_base runner ran (here pkv-graph alone) is not counted as passed: its
    steps have no rel_err, the file's metadata and the stage's log line name it, and the report
    says "unchecked" (and the count where only some steps had a baseline)."""
    cfg = smoke_cfg(buckets=[2], steps=1, shapes=["smoke-swa-sinks"], kv_dtypes=["auto", "fp8"], q_lens=[1, 2],
                    engines=["pkv-graph"])
    frame, meta = ms.model_step(cfg, None, SMOKE["seeds"]["heldout"][0])
    steps = frame[frame["kind"] == "step"]
    assert len(steps) and steps["rel_err"].isna().all() and not steps["failed"].any()
    names = ["smoke-swa-sinks/pkv-graph", "smoke-swa-sinks/pkv-graph/fp8", "smoke-swa-sinks/pkv-graph/fp8/q2",
             "smoke-swa-sinks/pkv-graph/q2"]
    assert json.loads(meta["unchecked"]) == names
    assert f"unchecked, no correctness baseline ran: {names}" in capsys.readouterr().err
    assert set(rm.table(rm.speculative(frame))["Check fails"]) == {"unchecked"}
    first = steps.index[0]   # a step whose output was not finite against a baseline: failed, so checked
    frame.loc[first, "failed"] = True
    got = rm.table(rm.speculative(frame)).set_index(["Model", "KV", "Engine"])["Check fails"]
    row = frame.loc[first]
    assert got[(row["model"], rm.KV_LABEL[row["kv_dtype"]], row["engine"])] == "1/1"
    assert f"unchecked (no correctness baseline ran): {', '.join(names)}" in rm.provenance_line([meta])
    g = pd.DataFrame({"steps": [3, 3], "checked": [3, 1], "fails": [1, 0]})
    assert rm.checks(g) == "1/4 (2 unchecked)" and rm.checks(g.assign(checked=0)) == "unchecked"
    assert rm.checks(g.assign(checked=3)) == "1/6"


def test_padding_rows_hold_q_len_tokens():
    assignment = assign_pages(np.array([40, 17, 3]), 16, 0.5, seed=7)
    step = StepState(0, np.array([2, 0]), np.array([3, 40], dtype=np.int32))
    v = padded_flashinfer_view(assignment, step, 5, pad_tokens=4)
    real = flashinfer_view(assignment, step.request_ids, step.seq_lens)
    np.testing.assert_array_equal(v.last_page_len, [*real.last_page_len, 4, 4, 4])
    np.testing.assert_array_equal(np.diff(v.indptr)[2:], [1, 1, 1])


# ---------------------------------------------------------------- config and report


def test_q_lens_default_to_decode_and_are_checked():
    absent = copy.deepcopy(SMOKE)
    absent["model_step"].pop("q_lens", None)
    assert Config.from_dict(absent).model_step.q_lens == (1,)    # absent: decode only (the runs so far)
    assert mp.settings(smoke_cfg(q_lens=[1, 4])).q_lens == (1, 4)
    with pytest.raises(ConfigError, match="decode \\(1\\) comes first"):
        smoke_plan(q_lens=[4, 1])
    for bad in ([0], [9], [1, 1], []):
        cfg = {**copy.deepcopy(SMOKE), "model_step": {**SMOKE["model_step"], "q_lens": bad}}
        with pytest.raises(ValueError, match="model_step.q_lens"):
            validate_config(cfg, load_schema(), "config")
    assert Config.from_dict(absent).to_dict()["model_step"]["q_lens"] == [1]


def test_the_report_labels_a_speculative_steps_rows():
    frame = pd.DataFrame({"model": pd.Series(["gpt-oss-20b"] * 3, dtype="string"), "q_len": [1, 4, 1]})
    got = rm.speculative(frame)
    assert list(got["model"]) == ["gpt-oss-20b", "gpt-oss-20b (q_len 4)", "gpt-oss-20b"]
    assert list(rm.speculative(got)["model"]) == list(got["model"])        # once
    assert rm.speculative(frame.drop(columns="q_len")) is not None
