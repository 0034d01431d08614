"""The model-level decode step on the GPU (pkv.measure.model_step): graphs captured once per bucket,
replayed over traces whose steps are padded, checked against FlashInfer eager at every step.

Small shapes (2-3 layers) so the test takes seconds; the benchmark itself is
`python -m pkv.measure.model_step`.
"""

from __future__ import annotations

import pytest
import torch

from pkv.measure import model_step as ms
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_graph_steps_match_flashinfer_eager(head_dim):
    args = ms.build_parser().parse_args(["--out", "unused", "--families", "homogeneous,azure", "--buckets", "1,8,32",
                                         "--steps", "3", "--engines", "pkv-graph,flashinfer-graph,flashinfer-eager"])
    plan = ms.build_plan(args)
    heads = 8
    plan.shapes = [ms.ModelShape(f"tiny-d{head_dim}", 3 if head_dim == 64 else 2, heads * head_dim, heads, 2,
                                 head_dim, 4 * heads * head_dim)]
    dropped = {}
    frame, skipped = ms.run(plan, log=print, dropped=dropped)
    assert dropped == {} and skipped == []
    steps = frame[frame["kind"] == "step"]
    assert set(steps["engine"]) == {"pkv-graph", "flashinfer-graph", "flashinfer-eager"}
    # homogeneous has 16 requests: max_active 32 runs 16-row steps in bucket 32 (padded).
    assert ((steps["bucket"] > steps["active"]).any())
    bad = steps[steps["failed"]]
    assert bad.empty, bad[["trace", "max_active", "step", "engine", "rel_err"]].to_string()
    assert steps["device_s"].gt(0).all() and steps["prepare_s"].gt(0).all()
    pipe = frame[frame["kind"] == "pipelined"]
    assert (pipe["wall_s"] > 0).all() and len(pipe) == 3 * 2 * 3
