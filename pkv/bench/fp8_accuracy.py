"""`pkv bench fp8-accuracy`: the error an FP8 (e4m3) KV cache costs, per scale policy and engine.

For each data kind (random K and V; K with a few outlier channels 10x or 100x larger; KV
heads whose magnitudes spread over three decades) and seed, one 16-bit cache is quantized
with each policy of pkv.core.fp8; every engine decodes the same queries over the same FP8
bytes, and its output is compared with the FP32 reference over the *original 16-bit*
values. Rows named `dequantized` are that reference over the dequantized cache: the error
of the quantization alone, with no kernel rounding. Rows of kv `16-bit` are the engines
on the unquantized cache: the floor every kernel has. Parquet only; the table comes from
pkv.report.fp8.
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
import torch

from pkv.engines.table import PKV_KERNEL, baselines

DATA = ("random", "outliers-x10", "outliers-x100", "head-spread")
OUTLIER_CHANNELS = 4     # per KV head, the same channels for every token (as in real K caches)
DEQUANTIZED = "dequantized"


def make_cache(kind: str, shape, lens, seed: int, device: str):
    """A 16-bit cache of `kind` (module docstring) holding one request per length."""
    from pkv.core.cache import PagedCache
    from pkv.core.paging import assign_pages

    cache = PagedCache.random(shape, assign_pages(np.asarray(lens), shape.page_size, 0.5, seed), device, seed)
    rng = np.random.default_rng(seed)
    if kind.startswith("outliers-x"):
        factor = float(kind.removeprefix("outliers-x"))
        for h in range(shape.num_kv_heads):
            ch = torch.as_tensor(rng.choice(shape.head_dim, OUTLIER_CHANNELS, replace=False), device=device)
            cache.kv[:, 0, h, :, ch] *= factor
    elif kind == "head-spread":
        mags = torch.as_tensor(10.0 ** rng.uniform(-3, 0, size=(2, shape.num_kv_heads)), device=device)
        cache.kv.mul_(mags.view(1, 2, -1, 1, 1).to(cache.kv.dtype))
    elif kind != "random":
        raise ValueError(f"unknown data kind {kind!r}; choose from {DATA}")
    return cache


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    e = (out.float() - ref).abs()
    return dict(max_abs=e.max().item(), mean_abs=e.mean().item(),
                rel_rms=(torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item())


def measure(data: list[str], seeds: list[int], engines: list[str], lens: list[int], shape, device: str) -> list[dict]:
    from pkv.core.fp8 import POLICIES
    from pkv.core.harness import StepState
    from pkv.engines import make_engine
    from pkv.kernels.reference import attention_reference

    rows = []
    for kind in data:
        for seed in seeds:
            cache16 = make_cache(kind, shape, lens, seed, device)
            step = StepState(0, np.arange(len(lens)), np.asarray(lens, dtype=np.int32))
            q = cache16.query(len(lens), seed + 1)
            ref = attention_reference(q, cache16.kv, cache16.block_table, torch.as_tensor(step.seq_lens))
            for kv, cache in [("16-bit", cache16)] + [(f"fp8-{p}", cache16.quantized(p)) for p in POLICIES]:
                names = engines + ([DEQUANTIZED] if cache.shape.fp8 else [])
                for name in names:
                    base = dict(data=kind, seed=seed, kv=kv, engine=name, batch=len(lens), tokens=int(sum(lens)))
                    try:
                        if name == DEQUANTIZED:
                            out = attention_reference(q, cache.values(), cache.block_table,
                                                      torch.as_tensor(step.seq_lens))
                        else:
                            engine = make_engine(name, cache)
                            out = engine.run(q, engine.prepare(step))
                        rows.append({**base, **errors(out, ref), "error": ""})
                    except (ValueError, RuntimeError) as err:  # an engine that does not read this cache
                        rows.append({**base, "max_abs": math.nan, "mean_abs": math.nan, "rel_rms": math.nan,
                                     "error": f"{type(err).__name__}: {str(err)[:200]}"})
                    r = rows[-1]
                    print(f"{kind:14s} s{seed} {kv:10s} {name:14s} max {r['max_abs']:.3e} "
                          f"rel_rms {r['rel_rms']:.3e} {r['error'][:60]}", flush=True)
            del cache16
    return rows


def add_arguments(ap) -> None:
    ap.add_argument("--data", default=",".join(DATA), help="comma-separated data kinds: " + ",".join(DATA))
    ap.add_argument("--seeds", default="20260623,20260624,20260625", help="comma-separated seeds (caches and queries)")
    ap.add_argument("--engines", nargs="+", default=[PKV_KERNEL, *baselines()],
                    help="engines decoding each cache (one that cannot read it records its error)")
    ap.add_argument("--lens", default="1024,2048,3000,4096,8192,12000,16384,32768",
                    help="comma-separated request lengths of the batch")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="results/raw/fp8/accuracy.parquet", help="Parquet file to write")


def add_command(bench) -> None:
    p = bench.add_parser("fp8-accuracy", help="error of FP8 KV caches per scale policy and engine",
                         description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args, "pkv bench fp8-accuracy " + " ".join(sys.argv[3:])))


def run(args, command: str) -> int:
    import pandas as pd

    from pkv.core import io
    from pkv.core.shape import Shape

    data = args.data.split(",")
    unknown = sorted(set(data) - set(DATA))
    if unknown:
        raise ValueError(f"unknown data kind(s) {unknown}; choose from {DATA}")
    shape = Shape(32, 8, 128, 16, "float16")
    lens = [int(x) for x in args.lens.split(",")]
    rows = measure(data, [int(s) for s in args.seeds.split(",")], list(args.engines), lens, shape, args.device)
    meta = {**io.provenance(), "command": command, "shape": repr(shape), "lens": ",".join(map(str, lens))}
    io.write_parquet(pd.DataFrame(rows), args.out, meta)
    print(f"wrote {args.out} ({len(rows)} rows)")
    return 0

