"""Nsight Compute targets for the v4 diagnosis (run under ncu --profile-from-start off).

B1 8K, B1 32K and batch 128 x 1K (Hq 32, Hkv 8, d 128, fp16, page 16): pkv-graph (v4),
pkv-workqueue (v3, host-planned splits, decode + merge kernels) and FlashInfer's CUDA-core
and tensor-core decode. Each engine runs twice unprofiled (JIT, allocator), then once
inside the profiled range, so every kernel of one call lands in the CSV once.
"""

import numpy as np
import torch

from pkv.engines import make_engine
from pkv.core.harness import StepState
from pkv.bench.kernels import SweepCase, build_caches
from pkv.plan.schedule import SplitPolicy

K = 1024
CASES = [SweepCase("diag", "B1 8K", (8 * K,)), SweepCase("diag", "B1 32K", (32 * K,)),
         SweepCase("diag", "B128 1K", (K,) * 128)]
ENGINES = [("pkv-graph", {}), ("pkv-workqueue", {"policy": SplitPolicy(24)}), ("flashinfer", {}),
           ("flashinfer-tc", {})]

for case in CASES:
    caches, queries = build_caches(case, 7)
    step = StepState(0, np.arange(case.batch), np.asarray(case.lens, dtype=np.int32))
    for name, opts in ENGINES:
        e = make_engine(name, caches[0], **opts)
        plan = e.prepare(step)
        for _ in range(2):
            e.run(queries[0], plan)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(f"{case.name}|{name}")
        torch.cuda.profiler.start()
        e.run(queries[0], plan)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        torch.cuda.nvtx.range_pop()
        print(case.name, name, "profiled", flush=True)
    del caches, queries
    torch.cuda.empty_cache()
