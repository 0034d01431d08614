"""Build every kernel a run will load, side by side, before the run measures anything.

On a fresh machine our extension and each FlashInfer module a run
touches (decode, tensor-core and persistent, per head_dim and KV dtype), each for many seconds,
are compiled on first use, one after the other, inside the measuring jobs, with the GPU
idle. `pkv build-kernels` builds them at once: one process per variant, each running
the engine's own prepare() and run() on a two-row batch, so what gets built is exactly
what the engines ask for (the planned wrappers' module names do not depend on the GQA group,
the page size or the batch). FlashInfer's plan-free XQA compiles one module per query and KV
dtype, page size, head_dim and GQA group (~1-2 min each): those are built for every shape a
run's stages give it (the serving shape, the kernel sweep's suites, the GQA sweep's groups,
the model step's models). A variant missed here is built on first use, as before; a machine
whose caches are warm spends a few seconds. The manifest records what was built and how long.
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
PER_HEAD_DIM = tuple(e for e in table.baselines() if e in table.planned())   # the decode wrappers, per head_dim
PER_SHAPE = tuple(e for e in table.baselines() if e not in table.planned())  # XQA: a module per shape
SERVING_ONLY = tuple(e for e in table.planned() if e not in PER_HEAD_DIM)   # the persistent kernel
BUILD_GROUP, BUILD_PAGE = 4, 16        # the tiny cache's shape for the group-free modules

# (engine, head_dim, dtype, kv_dtype, group, page_size)
Variant = tuple[str, int, str, str, int, int]


Shaped = tuple[int, str, str, int, int]    # (head_dim, dtype, kv_dtype, group, page_size)


def shaped_variants(cfg: dict, sweep: tuple[Shaped, ...] = ()) -> list[Shaped]:
    """Every shape a run's stages build an engine at: the serving shape (16-bit and FP8), the
    kernel sweep's cases (`sweep`: pkv.bench.kernels.suite_shapes(), which the CLI passes; the
    benchmarks sit above this layer), the GQA sweep's groups and the model step's models."""
    from pkv.engines.model import MODEL_SHAPES

    s = cfg["shape"]
    dtype, d, page = s["dtype"], int(s["head_dim"]), int(s["page_size"])
    group = int(s["num_qo_heads"]) // int(s["num_kv_heads"])
    out = [(d, dtype, kv, group, page) for kv in (Config.of(cfg).shape.kv_dtype, "auto", "fp8")]
    out += list(sweep)
    gqa = cfg.get("ablations", {}).get("gqa_sweep", {})
    out += [(d, dtype, "auto", int(g), page) for g in gqa.get("groups", [])]
    ms = cfg.get("model_step", {})
    for name in ms.get("shapes", []):
        m = MODEL_SHAPES[name]
        out += [(m.head_dim, dtype, kv, m.num_qo_heads // m.num_kv_heads, page) for kv in ms.get("kv_dtypes", ["auto"])]
    return list(dict.fromkeys(out))


def variants(cfg: dict, sweep: tuple[Shaped, ...] = ()) -> list[Variant]:
    """The variants to build for a resolved config (and the kernel sweep's shapes), ours first."""
    shape = Config.of(cfg).shape
    dtype, head_dim, kv = shape.dtype, shape.head_dim, shape.kv_dtype
    g, p = BUILD_GROUP, BUILD_PAGE
    out = [(table.PKV_KERNEL, head_dim, dtype, kv, g, p)]          # our one extension serves every shape
    for d, kv_dtype in dict.fromkeys([*((d, "auto") for d in sorted({head_dim, *SWEEP_HEAD_DIMS})),
                                      (head_dim, kv), (head_dim, "fp8")]):   # FP8 stages: the serving head_dim
        out += [(e, d, dtype, kv_dtype, g, p) for e in PER_HEAD_DIM]
    out += [(e, head_dim, dtype, kv, g, p) for e in SERVING_ONLY]
    out += [(e, *v) for v in shaped_variants(cfg, sweep) for e in PER_SHAPE]
    return out


def build_one(variant: Variant) -> dict:
    """Construct the engine for `variant` on a tiny cache and run one step (in a process of its own)."""
    engine, head_dim, dtype, kv_dtype, group, page = variant
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

        shape = Shape(2 * group, 2, head_dim, page, dtype, kv_dtype)
        lens = np.asarray([17, 40], dtype=np.int64)
        cache = PagedCache.random(shape, assign_pages(lens, page, 0.0, 0), device="cuda", seed=0, fp8_policy="tensor")
        e = make_engine(engine, cache)
        step = StepState(0, np.arange(len(lens)), lens.astype(np.int32))
        e.run(cache.query(len(lens), 1), e.prepare(step))
        torch.cuda.synchronize()
    except Exception as e:                      # recorded: the job that needs it builds it or fails there
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    return {"engine": engine, "head_dim": head_dim, "dtype": dtype, "kv_dtype": kv_dtype, "group": group,
            "page_size": page, "seconds": round(time.perf_counter() - started, 2), "error": error}


def build_all(cfg: dict, sweep: tuple[Shaped, ...] = ()) -> dict:
    """Build every variant of `cfg` (and of the kernel sweep's shapes) at once; the manifest."""
    import torch

    if not torch.cuda.is_available():
        return {"built": [], "wall_s": 0.0, "note": "no CUDA device: nothing is compiled (CPU engines)"}
    return build_variants(variants(cfg, sweep))


def build_variants(todo: list[Variant]) -> dict:
    """Build `todo` side by side, a process each (pkv build-kernels; the GPU tests' warm-up)."""
    started = time.perf_counter()
    workers = min(len(todo), os.cpu_count() or 1)
    # spawn: a CUDA context does not survive fork; each child builds one variant.
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        built = list(pool.map(build_one, todo))
    for b in built:
        status = f"failed: {b['error']}" if b["error"] else "ok"
        print(f"{b['engine']} d{b['head_dim']} G{b['group']} p{b['page_size']} {b['dtype']}/{b['kv_dtype']}: "
              f"{b['seconds']:.1f} s {status}",
              file=sys.stderr)
    return {"built": built, "wall_s": round(time.perf_counter() - started, 2), "workers": workers}


def write_manifest(manifest: dict, cfg: dict, path: str) -> None:
    from pkv.config.resolve import config_hash
    from pkv.core.io import atomic_write_text, provenance

    facts = {k: v for k, v in provenance(config_hash(cfg)).items() if k != "packages"}
    atomic_write_text(path, json.dumps({**manifest, "provenance": facts}, indent=1, sort_keys=True) + "\n")
