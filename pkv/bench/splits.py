"""`pkv bench splits`: the host-planned kernels' isolated timings against the read roofline.

One run measures the read roofline (a sum over a multi-GB tensor), then, for each case
and engine, device time by CUDA-graph replay and by CUDA events (medians after warm-up),
and the host path (prepare + run + synchronize, wall clock). Several KV copies with their
own page assignments rotate so the working set is far beyond the L2. PersistentKV's split
count per case is the best of a small sweep (by graph replay), recorded in the row.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import numpy as np
import pandas as pd
import torch

from pkv.bench.cases import BENCH_SEED, Case, build_caches
from pkv.bench.roofline import read_roofline
from pkv.core import io
from pkv.core.harness import StepState
from pkv.core.units import K
from pkv.engines import make_engine, table
from pkv.measure.timing import HostClock, events_us, graph_us_per_call
from pkv.plan.schedule import SplitPolicy

PKV_ENGINES = table.names("pkv")
BASELINES = (*table.flashinfer(), *table.names("sdpa"))
SPLIT_CANDIDATES = (4, 8, 12, 16, 24, 33, 48, 66)


def uniform(batch: int, seq_len: int, group: int, num_qo_heads: int = 32) -> Case:
    """`batch` rows of `seq_len` tokens at GQA group `group`."""
    return Case("splits", f"B{batch} {seq_len // K}K G{group}", (seq_len,) * batch, num_qo_heads=num_qo_heads,
                num_kv_heads=num_qo_heads // group)


CASES = (
    [uniform(1, n * K, 4) for n in (8, 16, 32, 64)]
    + [uniform(4, 32 * K, 4), uniform(8, 32 * K, 4)]
    + [uniform(8, 16 * K, g) for g in (1, 4, 8)]
)


class Workload:
    """The case's rotated caches (pkv.bench.cases.build_caches) and its one decode step."""

    def __init__(self, case: Case, seed: int = BENCH_SEED):
        self.case = case
        self.step = StepState(0, np.arange(case.batch), np.asarray(case.lens, dtype=np.int32))
        self.caches, self.queries = build_caches(case, seed)


def _graph_us(name: str, calls: list, reps: int) -> float:
    """Median device µs per call by replaying one graph that runs every copy once."""
    try:
        return graph_us_per_call(calls, reps)
    except RuntimeError as err:  # an engine whose run() cannot be captured keeps its event timing
        print(f"  {name}: graph capture failed: {err}", file=sys.stderr)
        torch.cuda.synchronize()
        return math.nan


def replay_and_event_us(work: Workload, name: str, splits: int | None, reps: int, sweep: bool = False) -> dict:
    """Graph-replay and event medians (µs per call) of one engine, rotating over the copies.

    `sweep` times graph replay only (the split sweep's criterion)."""
    policy = SplitPolicy(splits) if splits else None
    engines = [make_engine(name, cache, policy=policy) if policy else make_engine(name, cache) for cache in work.caches]
    plans = [e.prepare(work.step) for e in engines]
    calls = list(zip(engines, plans, work.queries))
    for e, p, q in calls * 2:  # warm-up: JIT builds, allocator, caches
        e.run(q, p)
    torch.cuda.synchronize()
    if sweep:
        return {"graph_us": _graph_us(name, calls, reps)}

    events = [events_us(lambda e=e, p=p, q=q: e.run(q, p)) for _ in range(reps) for e, p, q in calls]
    graph_us = _graph_us(name, calls, reps)

    # Host path of one step as a serving loop sees it: prepare + run + synchronize.
    e0, q0 = engines[0], work.queries[0]
    walls, preps = [], []
    for _ in range(max(10, reps // 2)):
        clock = HostClock()
        p = e0.prepare(work.step)
        clock.mark()
        e0.run(q0, p)
        torch.cuda.synchronize()
        walls.append(clock.stop() * 1e6)
        preps.append(clock.phases()[0] * 1e6)
    plan = plans[0]
    return {
        "graph_us": graph_us,
        "events_us": statistics.median(events),
        "wall_us": statistics.median(walls),
        "prepare_us": statistics.median(preps),
        "launches": plan.launches,
        "route": plan.route,
    }


def bench_case(case: Case, engines: list[str], reps: int, roofline: float, candidates: tuple[int, ...]) -> list[dict]:
    work = Workload(case)
    rows = []
    for name in engines:
        sweep = {}
        try:
            if name in PKV_ENGINES:
                for s in candidates:
                    sweep[s] = replay_and_event_us(work, name, s, max(5, reps // 4), sweep=True)["graph_us"]
                best = min(sweep, key=lambda s: (math.isnan(sweep[s]), sweep[s]))
                result = replay_and_event_us(work, name, best, reps)
            else:
                best = 0
                result = replay_and_event_us(work, name, None, reps)
        except (ValueError, RuntimeError) as err:  # e.g. a FlashInfer variant that does not run this shape
            print(f"  {name} {case}: {type(err).__name__}: {str(err)[:300]}", file=sys.stderr)
            rows.append(dict(_case_cols(case), engine=name, error=str(err)[:500], copies=len(work.caches)))
            continue
        us = result["graph_us"] if not math.isnan(result["graph_us"]) else result["events_us"]
        gbps = case.bytes / (us * 1e-6) / 1e9
        rows.append(dict(
            _case_cols(case), engine=name, splits=best, **result, bytes=case.bytes, roofline_gbps=roofline,
            achieved_gbps=gbps, frac_of_roofline=gbps / roofline, copies=len(work.caches),
            split_sweep=json.dumps({str(k): round(v, 2) for k, v in sweep.items()}), error="",
        ))
        print(f"  {name:22s} s={best:3d} graph {result['graph_us']:8.2f} us  events {result['events_us']:8.2f} us  "
              f"{gbps:7.0f} GB/s ({gbps / roofline:5.1%})  wall {result['wall_us']:7.1f} us", flush=True)
    del work
    torch.cuda.empty_cache()
    return rows


def _case_cols(case: Case) -> dict:
    return dict(batch=case.batch, seq_len=max(case.lens), group=case.group, num_qo_heads=case.num_qo_heads,
                num_kv_heads=case.shape.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                holes=case.holes, dtype=case.dtype)


def markdown(frame: pd.DataFrame, meta: dict, probes: dict[str, float], command: str) -> str:
    lines = [
        "# Isolated decode-attention kernels",
        "",
        f"Command: `{command}`  ",
        f"GPU: {meta['gpu']} ({meta['sm_count']} SMs), driver {meta['driver']}, CUDA {meta['cuda']}, "
        f"torch {meta['torch']}, FlashInfer {meta['flashinfer']}, commit {meta['git_commit']}  ",
        f"Read roofline: **{probes['roofline']:.0f} GB/s** (4 GiB read once: pkv read probe {probes['probe']:.0f}, "
        f"torch sum {probes['sum']:.0f}). Shape: Hq=32, d=128, fp16, page 16, 50% holes; "
        "graph µs = device time per call by CUDA-graph replay, events µs = CUDA events around each run() call "
        "(includes host launch gaps), wall = prepare + run + synchronize; GB/s = useful K+V bytes / graph time. "
        "PersistentKV splits = best of the sweep recorded in the Parquet's split_sweep column.",
        "",
        "| case | engine | splits | graph µs | events µs | GB/s | % roofline | wall µs (prepare+run+sync) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for _, r in frame.iterrows():
        case = f"B{r.batch} {r.seq_len // K}K G{r.group}"
        if r.error:
            lines.append(f"| {case} | {r.engine} | | failed: {r.error[:80]} | | | | |")
            continue
        lines.append(f"| {case} | {r.engine} | {int(r.splits) if r.splits else ''} | {r.graph_us:.1f} | "
                     f"{r.events_us:.1f} | "
                     f"{r.achieved_gbps:.0f} | {100 * r.frac_of_roofline:.1f} | {r.wall_us:.0f} |")
    return "\n".join(lines) + "\n"


def run_kernels(args) -> int:
    if not torch.cuda.is_available():
        raise ValueError("pkv bench kernels needs a CUDA device")
    engines = args.engines.split(",")
    cases = CASES if not args.cases else [c for i, c in enumerate(CASES) if str(i) in args.cases.split(",")]
    candidates = tuple(int(s) for s in args.splits.split(","))
    probes = read_roofline()
    roofline = probes["roofline"]
    print(f"read roofline: {roofline:.0f} GB/s (sum {probes['sum']:.0f}, read probe {probes['probe']:.0f})", flush=True)
    rows = []
    for case in cases:
        print(f"{case.name}: {case.bytes / 1e6:.1f} MB", flush=True)
        rows += bench_case(case, engines, args.reps, roofline, candidates)
    frame = pd.DataFrame(rows)
    meta = io.provenance()
    command = "pkv " + " ".join(sys.argv[1:])
    io.write_parquet(frame, args.out, {**meta, "roofline_gbps": f"{roofline:.1f}",
                                       "read_sum_gbps": f"{probes['sum']:.1f}",
                                       "read_probe_gbps": f"{probes['probe']:.1f}", "command": command})
    io.atomic_write_text(args.table, markdown(frame, meta, probes, command))
    print(f"wrote {args.out} and {args.table}")
    return 0


def add_command(bench) -> None:
    p = bench.add_parser("splits", help="host-planned schedules at their best split per case (needs a GPU)",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--engines", default=",".join(PKV_ENGINES + BASELINES), help="engines to time")
    p.add_argument("--cases", default="", help="comma-separated case indices (default: all)")
    p.add_argument("--splits", default=",".join(map(str, SPLIT_CANDIDATES)), help="split counts swept per case")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions per engine and case")
    p.add_argument("--out", default="results/raw/kernels/v3-kernels.parquet", help="Parquet file to write")
    p.add_argument("--table", default="results/tables/kernels-v3.md", help="Markdown table to write")
    p.set_defaults(func=run_kernels)
