"""Build every kernel a run will load, side by side, before the run measures anything.

On a fresh machine our extension (~30 s on the H200) and each FlashInfer module a run
touches (decode, tensor-core and persistent, per head_dim and KV dtype: ~10-25 s each)
are compiled on first use, one after the other, inside the measuring jobs, with the GPU
idle. `pkv build-kernels` builds them at once: one process per variant, each running
the engine's own prepare() and run() on a two-row batch, so what gets built is exactly
what the engines ask for (FlashInfer's module names do not depend on the GQA group or
the batch). A variant missed here is built on first use, as before; a machine whose
caches are warm spends a few seconds. The manifest records what was built and how long.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from pkv.config.typed import Config
from pkv.engines import table

# The FlashInfer variants the pipeline's stages construct: the decode wrappers at every
# head_dim of the config and of the kernel sweep's suites on a 16-bit cache, and at the
# serving head_dim on an FP8 one; the persistent kernel at the serving shape (Table 2).
SWEEP_HEAD_DIMS = (64, 128, 256)       # pkv.bench.kernels' `shapes` suite
PER_HEAD_DIM = table.baselines()       # the decode wrappers, which the sweep runs at every head_dim
SERVING_ONLY = tuple(e for e in table.flashinfer() if e not in PER_HEAD_DIM)   # the persistent kernel


def variants(cfg: Config | dict) -> list[tuple[str, int, str, str]]:
    """(engine, head_dim, dtype, kv_dtype) to build for a resolved config, ours first."""
    shape = Config.of(cfg).shape
    dtype, head_dim, kv = shape.dtype, shape.head_dim, shape.kv_dtype
    out = [("pkv-graph", head_dim, dtype, kv)]          # our one extension serves every shape
    for d, kv_dtype in dict.fromkeys([*((d, "auto") for d in sorted({head_dim, *SWEEP_HEAD_DIMS})),
                                      (head_dim, kv), (head_dim, "fp8")]):   # FP8 stages: the serving head_dim
        out += [(e, d, dtype, kv_dtype) for e in PER_HEAD_DIM]
    out += [(e, head_dim, dtype, kv) for e in SERVING_ONLY]
    return out


def build_one(variant: tuple[str, int, str, str]) -> dict:
    """Construct the engine for `variant` on a tiny cache and run one step (in a process of its own)."""
    engine, head_dim, dtype, kv_dtype = variant
    started = time.perf_counter()
    error = ""
    try:
        import numpy as np
        import torch

        from pkv.core.cache import PagedCache
        from pkv.core.harness import StepState
        from pkv.core.paging import assign_pages
        from pkv.core.shape import Shape
        from pkv.engines import make_engine

        shape = Shape(8, 2, head_dim, 16, dtype, kv_dtype)
        lens = np.asarray([17, 40], dtype=np.int64)
        cache = PagedCache.random(shape, assign_pages(lens, 16, 0.0, 0), device="cuda", seed=0, fp8_policy="tensor")
        e = make_engine(engine, cache)
        step = StepState(0, np.arange(len(lens)), lens.astype(np.int32))
        e.run(cache.query(len(lens), 1), e.prepare(step))
        torch.cuda.synchronize()
    except Exception as e:                      # recorded: the job that needs it builds it or fails there
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    return {"engine": engine, "head_dim": head_dim, "dtype": dtype, "kv_dtype": kv_dtype,
            "seconds": round(time.perf_counter() - started, 2), "error": error}


def build_all(cfg: dict) -> dict:
    """Build every variant of `cfg` at once; the manifest of what was built."""
    import torch

    started = time.perf_counter()
    if not torch.cuda.is_available():
        return {"built": [], "wall_s": 0.0, "note": "no CUDA device: nothing is compiled (CPU engines)"}
    todo = variants(cfg)
    workers = min(len(todo), os.cpu_count() or 1)
    # spawn: a CUDA context does not survive fork; each child builds one variant.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        built = list(pool.map(build_one, todo))
    for b in built:
        status = f"failed: {b['error']}" if b["error"] else "ok"
        print(f"{b['engine']} d{b['head_dim']} {b['dtype']}/{b['kv_dtype']}: {b['seconds']:.1f} s {status}",
              file=sys.stderr)
    return {"built": built, "wall_s": round(time.perf_counter() - started, 2), "workers": workers}


def write_manifest(manifest: dict, cfg: dict, path: str) -> None:
    from pkv.config.resolve import config_hash
    from pkv.core.io import atomic_write_text, provenance

    facts = {k: v for k, v in provenance(config_hash(cfg)).items() if k != "packages"}
    atomic_write_text(path, json.dumps({**manifest, "provenance": facts}, indent=1, sort_keys=True) + "\n")
