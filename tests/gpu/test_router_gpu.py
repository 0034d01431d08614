"""The router on the GPU (needs a CUDA device; not run in CPU CI): `adaptive` routes a step
to pkv-graph's kernel with constants that carry its fit, the output matches the FP32
reference, the plan's counters are the device rule's, and inside a CUDA-graph bucket a
graph of run() captured once replays every later step the router sends to pkv-graph."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pkv.core.harness import StepState
from pkv.core.units import K
from pkv.engines import make_engine
from pkv.engines.graph import GraphEngine
from pkv.plan.costmodel import Constants, GraphFit, graph_counts
from test_kernels import check, make_case, reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _constants(objective_host: float = 5e-4) -> Constants:
    """H200-like constants whose pkv-graph fit is the grid of this GPU (CTAs/SM x SMs at
    head_dim 128) and cheap on the host: the serial router takes pkv-graph."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return Constants("gpu test", 4e12, 1e-5, sms, 1.3, {"flashinfer": 4.0, "flashinfer-tc": 4.0},
                     ((1024, 1.05),), (1, 2, 4, 8), 1, 4, {"p": {"bucket": 16, "workqueue": 8}},
                     {"flashinfer": objective_host, "flashinfer-tc": objective_host, "bucket": objective_host,
                      "workqueue": objective_host, "graph": 6e-5},
                     GraphFit(11e-6, 1 / 4.2e12, 1 / 4.2e12, 2 * sms, 4))


def test_adaptive_routes_to_the_pkv_graph_kernel_and_matches_the_reference():
    cache, step, q = make_case([8 * K + 7, 300, 17 * K, 1], seed=23)
    engine = make_engine("adaptive", cache, constants=_constants(), point="p")
    plan = engine.prepare(step)
    assert plan.route == "pkv-graph" and isinstance(plan.engine, GraphEngine) and plan.engine.gpu
    out = engine.run(q, plan)
    torch.cuda.synchronize()
    check(out, reference(cache, step, q), "float16", "adaptive -> pkv-graph")
    c = plan.inner.counters
    g = plan.engine
    assert (c.decode_ctas, c.decode_ctas + c.empty_ctas) == (
        graph_counts(step.seq_lens, cache.shape.num_kv_heads, g.num_ctas, g.min_tiles)[0], g.num_ctas)


def test_overlapped_objective_is_not_taken_in_by_host_time():
    """Same step, host times that would decide: serial takes pkv-graph, overlapped compares device time only."""
    cache, step, q = make_case([2 * K, 3 * K], seed=24)
    k = _constants(objective_host=3e-3)
    k = dataclasses.replace(k, graph=GraphFit(1e-3, 0.0, 0.0, 2 * k.sm_count, 4))
    routes = {o: make_engine("adaptive", cache, constants=k, point="p", objective=o).prepare(step).route
              for o in ("serial", "overlapped")}
    assert routes["serial"] == "pkv-graph" and routes["overlapped"] != "pkv-graph"


def test_a_step_routed_to_pkv_graph_inside_a_cuda_graph_bucket_replays_the_captured_graph():
    bucket = 8
    rng = np.random.default_rng(5)
    lens = rng.integers(1, 20 * K, size=bucket + 2)
    cache, _, _ = make_case(lens.tolist(), seed=25)
    engine = make_engine("adaptive", cache, constants=_constants(), point="p")
    ids = np.arange(bucket + 2)

    def step_of(t: int, b: int) -> StepState:
        rows = ids[t % 3: t % 3 + b]
        reserved = cache.assignment.reserved_len[rows]
        return StepState(t, rows, np.clip(reserved - 40 + t, 1, reserved).astype(np.int32))

    first = step_of(0, 5)
    plan = engine.prepare(first, rows=bucket)
    assert plan.route == "pkv-graph" and plan.inner.rows == bucket
    q = cache.query(bucket, seed=7)
    engine.run(q, plan)                                  # warm-up off the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = engine.run(q, plan)
    for t, b in ((1, 8), (2, 3), (3, 6), (4, 1)):
        step = step_of(t, b)
        p = engine.prepare(step, rows=bucket)            # one metadata upload into the captured buffers
        assert p.route == "pkv-graph" and p.engine is plan.engine
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(out[:b], reference(cache, step, q[:b]), "float16", f"replayed bucket step {t} ({b} rows)")
