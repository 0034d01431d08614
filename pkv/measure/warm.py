"""Build every kernel a run will load, side by side, before the run measures anything.

On a fresh machine our extension and each FlashInfer module a run
touches (decode, tensor-core and persistent, per head_dim and KV dtype), each for many seconds,
are compiled on first use, one after the other, inside the measuring jobs, with the GPU
idle. `pkv build-kernels` builds them at once: one process per variant, each running
the engine's own prepare() and run() on a two-row batch, so what gets built is exactly
what the engines ask for (the planned wrappers' module names do not depend on the GQA group,
the page size, the batch or q_len; they do on a sliding window). FlashInfer's plan-free XQA
compiles one module per query and KV dtype, page size, head_dim, GQA group, sliding window and
q_len (~1-2 min each): those are built for every shape a run's stages give it (the serving
shape, the suites of the kernel sweeps the run measures, the GQA sweep's groups, the model
step's models), with the windows, sinks and q_len the stage runs them with. A variant missed
here is built on first use, as before; a machine whose caches are warm spends a few seconds.
The manifest records what was built and how long.
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

# The FlashInfer variants the pipeline's stages construct, each by running its engine: the
# decode wrappers (planned) at every head_dim and KV dtype of the run's shapes, with a sliding
# window and with sinks where a shape has them (FlashInfer keys a wrapper's module by head_dim,
# dtypes and whether a window is set, not by the GQA group, the page size, the batch or q_len,
# a plan() argument); the persistent kernel at the serving shape (Table 2); XQA per shape,
# window and q_len (one module each; sinks are an argument of its run).
PER_HEAD_DIM = tuple(e for e in table.baselines() if e in table.planned())   # the decode wrappers, per head_dim
PER_SHAPE = tuple(e for e in table.baselines() if e not in table.planned())  # XQA: a module per shape
SERVING_ONLY = tuple(e for e in table.planned() if e not in PER_HEAD_DIM)   # the persistent kernel
BUILD_GROUP, BUILD_PAGE = 4, 16        # the tiny cache's shape for the group-free modules
BUILD_WINDOW = 15                      # window_left of a sliding variant (the window's size is no module key)

# (head_dim, dtype, kv_dtype, group, page_size, sliding, q_len, sinks): a shape and the features
# an engine runs it with (a sliding window, query tokens per row, attention sinks).
Shaped = tuple[int, str, str, int, int, bool, int, bool]
Variant = tuple[str, int, str, str, int, int, bool, int, bool]   # (engine, *Shaped)
PLAIN = (False, 1, False)              # (sliding, q_len, sinks) of plain decode


def shaped_variants(cfg: dict, sweep: tuple[Shaped, ...] = ()) -> list[Shaped]:
    """Every shape (and features) a run's stages build an engine at: the serving shape (16-bit and
    FP8), the kernel sweep's cases (`sweep`: pkv.bench.kernels.suite_shapes() of the run's suites,
    which the CLI passes; the benchmarks sit above this layer), the GQA sweep's groups and the model
    step's models, each with its windowed and full layers, sinks and q_lens."""
    from pkv.engines.model import MODEL_SHAPES

    s = cfg["shape"]
    dtype, d, page = s["dtype"], int(s["head_dim"]), int(s["page_size"])
    group = int(s["num_qo_heads"]) // int(s["num_kv_heads"])
    out = [(d, dtype, kv, group, page, *PLAIN) for kv in (Config.of(cfg).shape.kv_dtype, "auto", "fp8")]
    out += list(sweep)
    gqa = cfg.get("ablations", {}).get("gqa_sweep", {})
    out += [(d, dtype, "auto", int(g), page, *PLAIN) for g in gqa.get("groups", [])]
    ms = cfg.get("model_step", {})
    q_lens = Config.of(cfg).model_step.q_lens
    for name in ms.get("shapes", []):
        m = MODEL_SHAPES[name]
        slidings = sorted({w >= 0 for w in m.windows()})   # its windowed layers, its full ones
        out += [(m.head_dim, dtype, kv, m.num_qo_heads // m.num_kv_heads, page, sliding, q, m.sinks)
                for kv in ms.get("kv_dtypes", ["auto"]) for sliding in slidings for q in q_lens]
    return list(dict.fromkeys(out))


def variants(cfg: dict, sweep: tuple[Shaped, ...] = ()) -> list[Variant]:
    """The variants to build for a resolved config (and the kernel sweep's shapes), ours first. A
    sweep shape with features (the features suite's) is built for the engines of the config's
    feature_kernels section only (all where it has none); the config's own stages' for each."""
    c = Config.of(cfg)
    dtype, head_dim, kv = c.shape.dtype, c.shape.head_dim, c.shape.kv_dtype
    g, p = BUILD_GROUP, BUILD_PAGE
    own, shaped = shaped_variants(cfg), shaped_variants(cfg, sweep)
    only = None if c.feature_kernels is None else {table.parse_spec(e)[0] for e in c.feature_kernels.engines}

    def builds(engine: str, v: Shaped) -> bool:
        return tuple(v[5:]) == PLAIN or v in own or only is None or engine in only

    out = [(table.PKV_KERNEL, head_dim, dtype, kv, g, p, *PLAIN)]          # our one extension serves every shape
    # a decode wrapper per head_dim, dtypes, window and sinks (at the group-free build shape, q_len 1)
    out += list(dict.fromkeys((e, v[0], v[1], v[2], g, p, v[5], 1, v[7])
                              for v in shaped for e in PER_HEAD_DIM if builds(e, v)))
    out += [(e, head_dim, dtype, kv, g, p, *PLAIN) for e in SERVING_ONLY]
    # XQA: a module per shape, window and q_len (pkv.engines.xqa.xqa_module; its sinks are a run() argument)
    out += list(dict.fromkeys((e, *v[:7], False) for v in shaped for e in PER_SHAPE if builds(e, v)))
    return out


def build_one(variant: Variant) -> dict:
    """Construct the engine for `variant` on a tiny cache and run one step with its features (in a
    process of its own); a variant of six fields (no features) is plain decode."""
    engine, head_dim, dtype, kv_dtype, group, page, *features = variant
    sliding, q_len, sinks = features or PLAIN
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
        options = {"window_left": BUILD_WINDOW} if sliding else {}
        options |= {"q_len": q_len} if q_len > 1 else {}
        options |= {"sinks": torch.zeros(shape.num_qo_heads, dtype=torch.float32, device="cuda")} if sinks else {}
        e = make_engine(engine, cache, **options)
        step = StepState(0, np.arange(len(lens)), lens.astype(np.int32))
        e.run(cache.query(len(lens) * q_len, 1), e.prepare(step))
        torch.cuda.synchronize()
    except Exception as e:                      # recorded: the job that needs it builds it or fails there
        error = f"{type(e).__name__}: {e}".splitlines()[0]
    return {"engine": engine, "head_dim": head_dim, "dtype": dtype, "kv_dtype": kv_dtype, "group": group,
            "page_size": page, "sliding": sliding, "q_len": q_len, "sinks": sinks,
            "seconds": round(time.perf_counter() - started, 2), "error": error}


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
        features = "".join((" sliding" if b["sliding"] else "", f" q{b['q_len']}" if b["q_len"] > 1 else "",
                            " sinks" if b["sinks"] else ""))
        print(f"{b['engine']} d{b['head_dim']} G{b['group']} p{b['page_size']} {b['dtype']}/{b['kv_dtype']}{features}: "
              f"{b['seconds']:.1f} s {status}",
              file=sys.stderr)
    return {"built": built, "wall_s": round(time.perf_counter() - started, 2), "workers": workers}


def write_manifest(manifest: dict, cfg: dict, path: str) -> None:
    from pkv.config.resolve import config_hash
    from pkv.core.io import atomic_write_text, provenance

    facts = {k: v for k, v in provenance(config_hash(cfg)).items() if k != "packages"}
    atomic_write_text(path, json.dumps({**manifest, "provenance": facts}, indent=1, sort_keys=True) + "\n")
