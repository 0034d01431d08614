"""Eager pkv-graph calls for Nsight Compute: B8 32K and B1 128K over an FP8 cache, and B8 32K
16-bit for comparison (two calls each; profile with -k regex:graph_decode)."""
import numpy as np
import torch

from pkv.engines import make_engine
from pkv.core.harness import StepState
from pkv.bench.kernels import K, SweepCase, build_caches

for lens, kv in (((32 * K,) * 8, "fp8"), ((128 * K,), "fp8"), ((32 * K,) * 8, "auto")):
    case = SweepCase("diag", "diag", lens, kv_dtype=kv, fp8_policy="tensor" if kv == "fp8" else "")
    caches, queries = build_caches(case, 7)
    step = StepState(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32))
    e = make_engine("pkv-graph", caches[0])
    for _ in range(2):
        e.run(queries[0], e.prepare(step))
    torch.cuda.synchronize()
    del caches, queries
