"""`pkv bench kernels`: device time of PersistentKV's `pkv-graph` against FlashInfer over the serving range.

Cases: homogeneous batch x context grids, ragged mixes, GQA group x head_dim points, FP8 points
(`--suites fp8`: the same lengths from a 16-bit and from e4m3 caches, `kv_dtype`, `fp8_policy`,
`point`) and today's models' windows, sinks and q_len (`--suites features`). For each case and
engine: device µs per call by CUDA-graph replay (one graph runs every KV copy once; copies rotate
so the working set is beyond the L2; every case's KV pools, 16-bit and FP8, are carved from one
buffer allocated once per process, `KvArena`), the fraction of the read roofline on useful K+V
bytes, and the ratio of the faster FlashInfer variant to PersistentKV, all in one process. Parquet
only; the tables and figure come from the report. With `--config` of a smoke run the cases run on
the CPU (pkv.bench.smoke: one case per attention, lengths scaled, the CPU engines, wall time in
`cpu_us`); with a paper run's, as without it (its config hash and profile in the metadata).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

import numpy as np
import torch

from pkv.bench.cases import BENCH_SEED, Case, KvArena, build_caches
from pkv.bench.smoke import CPU_WALL, GRAPH, SMOKE, cpu_engines, cpu_us_per_call, smoke_cases
from pkv.config.stages import STAGES
from pkv.core.units import K
from pkv.engines.table import PKV_KERNEL, flashinfer, parse_spec, persistentkv  # the one table of engine names


def homogeneous(max_tokens: int = 1 << 20) -> list[Case]:
    out = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        for ctx in (1, 2, 4, 8, 16, 32, 64, 128):
            if b * ctx * K <= max_tokens:
                out.append(Case("homogeneous", f"B{b} {ctx}K", (ctx * K,) * b))
    return out


def ragged(seed: int = BENCH_SEED) -> list[Case]:
    rng = np.random.default_rng(seed)
    return [
        Case("ragged", "B8 bimodal 512/24K", tuple(int(x) for x in rng.choice([512, 24 * K], size=8))),
        Case("ragged", "B32 bimodal 1K/16K", tuple(int(x) for x in rng.choice([K, 16 * K], size=32))),
        Case("ragged", "B16 uniform 1-8K", tuple(int(x) for x in rng.integers(1, 8 * K + 1, size=16))),
        Case("ragged", "B64 uniform 1-8K", tuple(int(x) for x in rng.integers(1, 8 * K + 1, size=64))),
        Case("ragged", "1x32K + 31 short", (32 * K,) + tuple(int(x) for x in rng.integers(100, 2 * K, size=31))),
        Case("ragged", "1x128K + 7x1K", (128 * K,) + (K,) * 7),
        # Near-equal long rows whose segments straddle CTA ranges (a serving step of homogeneous
        # B4, where merge = 4's waits could chain through the grid: docs/perf-notes.md).
        Case("ragged", "B4 32K + 1-200", tuple(32 * K + int(x) for x in rng.integers(1, 201, size=4))),
    ]


def shapes() -> list[Case]:
    out = []
    for g in (1, 4, 5, 7, 8):
        for d in (64, 128, 256):
            if d == 256 and g > 8:
                continue
            for b, ctx in ((1, 32 * K), (16, 4 * K)):
                out.append(Case("shapes", f"G{g} d{d} B{b} {ctx // K}K", (ctx,) * b, num_qo_heads=8 * g,
                                     num_kv_heads=8, head_dim=d))
    return out


FP8_KV = (("auto", ""), ("fp8", "tensor"), ("fp8", "page"))   # each point: 16-bit, then both FP8 policies


def fp8(seed: int = BENCH_SEED) -> list[Case]:
    """The FP8 rows: B1 4K-128K, B8 32K, B64 x 2K and ragged mixes, each with a 16-bit and
    both FP8 caches over the same lengths (the ratios pair them through `point`)."""
    pick = {"B1 4K", "B1 8K", "B1 16K", "B1 32K", "B1 64K", "B1 128K", "B8 32K", "B64 2K"}
    points = [c for c in homogeneous() if c.name in pick] + ragged(seed)[:4]
    return [Case("fp8", f"{c.name} {kv if kv == 'auto' else 'fp8-' + policy}", c.lens, kv_dtype=kv,
                      fp8_policy=policy, point=c.name)
            for c in points for kv, policy in FP8_KV]


def features(seed: int = BENCH_SEED) -> list[Case]:
    """Today's models' attention against the fastest FlashInfer path that has each feature: a
    gpt-oss-like shape (Hq 64, Hkv 8, d 64, sinks; window 128 on half the layers: a sliding row
    and a full row per point), a Gemma-3-like shape (d 256, G 2, window 1024) and speculative
    decoding (the llama-8b-like shape, q_len 2, 4 and 8) over B 1-32 and 1K-32K, each with a
    ragged mix."""
    rng = np.random.default_rng(seed)
    mix = tuple(int(x) for x in rng.choice([K, 16 * K], size=32))
    points = [("B1 32K", (32 * K,)), ("B8 8K", (8 * K,) * 8), ("B32 2K", (2 * K,) * 32), ("B32 bimodal 1K/16K", mix)]
    out = []
    for name, lens in points:
        for window, layer in ((127, "sliding"), (-1, "full")):
            out.append(Case("features", f"gpt-oss {layer} {name}", lens, num_qo_heads=64, num_kv_heads=8, head_dim=64,
                            window_left=window, sinks=True, point=f"gpt-oss {name}"))
        out.append(Case("features", f"gemma-3 sliding {name}", lens, num_qo_heads=16, num_kv_heads=8, head_dim=256,
                        window_left=1023, point=f"gemma-3 {name}"))
    spec = [("B1 1K", (K,)), ("B1 32K", (32 * K,)), ("B8 8K", (8 * K,) * 8), ("B32 1K", (K,) * 32),
            ("B32 32K", (32 * K,) * 32), ("B32 bimodal 1K/16K", mix)]
    for q_len in (2, 4, 8):
        for name, lens in spec:
            out.append(Case("features", f"spec q{q_len} {name}", lens, q_len=q_len, point=f"spec q{q_len} {name}"))
    return out


SUITES = {"homogeneous": homogeneous, "ragged": ragged, "shapes": shapes, "fp8": fp8, "features": features}


def suite_shapes(suites=tuple(SUITES)) -> tuple[tuple[int, str, str, int, int, bool, int, bool], ...]:
    """(head_dim, dtype, kv_dtype, group, page_size, sliding, q_len, sinks) of every case of
    `suites`: the shapes and features `pkv build-kernels` compiles FlashInfer's modules at."""
    cases = (c for suite in suites for c in SUITES[suite]())
    return tuple(dict.fromkeys((c.head_dim, c.dtype, c.kv_dtype, c.group, c.page_size, c.window_left >= 0, c.q_len,
                                c.sinks) for c in cases))


def quick() -> list[Case]:
    pick = {"B1 4K", "B1 8K", "B1 16K", "B1 32K", "B1 64K", "B1 128K", "B8 32K", "B16 2K", "B64 2K", "B128 1K"}
    return [c for c in homogeneous() if c.name in pick] + ragged()[:3] + [
        c for c in shapes() if c.name in ("G5 d128 B1 32K", "G7 d128 B1 32K", "G4 d256 B1 32K", "G4 d64 B16 4K")]


def graph_replay_us(name: str, options: dict, caches, queries, step, reps: int) -> float:
    """Device time of one engine's run() per call, µs: CUDA-graph replay rotating over the copies."""
    from pkv.engines import make_engine
    from pkv.measure.timing import graph_us_per_call

    engines = [make_engine(name, c, **options) for c in caches]
    calls = [(e, e.prepare(step), q) for e, q in zip(engines, queries)]
    for e, p, q in calls:  # warm-up: JIT load, allocator
        e.run(q, p)
    torch.cuda.synchronize()
    return graph_us_per_call(calls, reps)


def run_case(case: Case, engines: list[str], reps: int, roofline: float, seed: int,
             arena: KvArena | None = None, device: str = "cuda") -> list[dict]:
    """Every engine spec (pkv.engines.table.parse_spec) on `case`; a row per spec, labelled by it.
    On the CPU (smoke): one copy, wall time per call in `cpu_us` (pkv.bench.smoke)."""
    from pkv.core.harness import StepState

    cpu = device == "cpu"
    caches, queries = build_caches(case, seed, device=device, arena=arena, copies=1 if cpu else None)
    step = StepState(0, np.arange(case.batch), np.asarray(case.lens, dtype=np.int32))
    features = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.feature_options.items()}
    rows = []
    for label in engines:
        name, options = parse_spec(label)
        options = {**options, **features}   # an engine without the feature refuses it in one line
        try:
            us, error = (cpu_us_per_call if cpu else graph_replay_us)(name, options, caches, queries, step, reps), ""
        except (ValueError, RuntimeError) as err:  # a variant that does not build or run this shape
            us, error = math.nan, f"{type(err).__name__}: {str(err)[:300]}"
            if not cpu:
                torch.cuda.synchronize()
        gbps = case.bytes / (us * 1e-6) / 1e9 if not (math.isnan(us) or cpu) else math.nan
        rows.append(dict(family=case.family, case=case.name, batch=case.batch, mean_len=float(np.mean(case.lens)),
                         max_len=max(case.lens), group=case.group, head_dim=case.head_dim,
                         num_kv_heads=case.num_kv_heads, page_size=case.page_size, dtype=case.dtype,
                         kv_dtype=case.kv_dtype, fp8_policy=case.fp8_policy, point=case.point or case.name,
                         window_left=case.window_left, q_len=case.q_len, sinks=case.sinks,
                         engine=label, graph_us=math.nan if cpu else us, cpu_us=us if cpu else math.nan,
                         timing=CPU_WALL if cpu else GRAPH, bytes=case.bytes, achieved_gbps=gbps,
                         frac_of_roofline=gbps / roofline, copies=len(caches), error=error,
                         lens=json.dumps(list(case.lens)) if case.batch <= 256 else ""))
        ok = f"{us:9.2f} us {gbps / roofline:6.1%}" if not error else error[:90]
        print(f"  {label:34s} {ok}", flush=True)
    del caches, queries
    if not cpu:
        torch.cuda.empty_cache()
    return rows


# A row's measured times and what derives from them (every other column is a key, a size or an error).
MEASURED_TIMES = ("graph_us", "cpu_us", "achieved_gbps", "frac_of_roofline", "best_flashinfer_us", "ratio")


def with_ratios(frame):
    """ratio = faster FlashInfer variant / engine (same case, same run)."""
    fi = frame[frame.engine.isin(flashinfer())].groupby("case").graph_us.min().rename("best_flashinfer_us")
    frame = frame.drop(columns=[c for c in ("best_flashinfer_us", "ratio") if c in frame]).join(fi, on="case")
    frame["ratio"] = frame.best_flashinfer_us / frame.graph_us
    return frame


# Fields of a PKV_TRACE record (csrc/graph_decode.h): clock64 stamps unless named gt_ (%globaltimer, ns).
DECODE_FIELDS = {0: "gt_start", 1: "start", 2: "scan", 3: "cut", 4: "pages", 5: "first_kv", 6: "loop_end",
                 7: "state", 8: "end", 9: "gt_end", 10: "flags", 11: "first_tokens", 12: "smid",
                 13: "lengths_in", 14: "piece_ready", 15: "bt_in"}
TRACE_CTAS, TRACE_FIELDS = 1024, 16   # kTraceCtas, kTraceFields


def trace_phases(rec, clock_ghz: float) -> dict:
    """The phase budget of one traced call (rec: [TRACE_CTAS, TRACE_FIELDS] int64), in µs.

    Per active CTA (medians, and the max for the whole range): lengths loaded and scanned,
    range cut, block-table ids and the wait for the previous kernel (prologue copies issued),
    first KV step landed, the steady loop, drain + CTA state written, the in-grid merge. Across
    the launch: start skew of the CTAs and the span (first start to last end, %globaltimer)."""
    dec = rec
    used = dec[:, 0] > 0
    act = used & ((dec[:, 10] & 1) == 1)
    out = {}
    if not act.any():
        return out
    a = dec[act]
    ticks = (a[:, 8] - a[:, 1]).astype(float)
    out["clock_ghz_measured"] = float(np.median(ticks / np.maximum(a[:, 9] - a[:, 0], 1)))  # clocks per ns
    us = 1e-3 / (clock_ghz if clock_ghz > 0 else out["clock_ghz_measured"])   # µs per clock
    # The finer stamps (13-15: the lengths' and the block table's round trips, the piece's
    # set-up) split scan and bt; a build without them leaves those fields 0.
    for name, (i0, i1) in {"scan": (1, 2), "cut": (2, 3), "bt": (3, 4), "first_kv": (4, 5), "steady": (5, 6),
                           "drain_state": (6, 7), "merge": (7, 8), "lengths_rt": (1, 13),
                           "scan_math": (13, 2), "setup": (3, 14), "bt_rt": (14, 15), "issue": (15, 4)}.items():
        if not ((a[:, i0] > 0) & (a[:, i1] > 0)).all():
            continue
        d = (a[:, i1] - a[:, i0]) * us
        out[name] = float(np.median(d))
        out[name + "_max"] = float(d.max())
    t0 = int(dec[used, 0].min())
    out["start_skew"] = (int(a[:, 0].max()) - t0) * 1e-3
    out["decode_span"] = (int(dec[used, 9].max()) - t0) * 1e-3
    out["active_ctas"] = int(act.sum())
    out["first_tokens"] = float(np.median(a[:, 11]))
    return out


def run_trace(args, cases, engines, command: str) -> int:
    """`--trace`: the PKV_TRACE build, one traced call per repetition (one CUDA graph runs
    every KV copy once, as the sweep times it; the last call is the one traced), its phase
    budget printed and every record written."""
    import os

    import pandas as pd

    from pkv.core import io
    from pkv.core.harness import StepState
    from pkv.engines import make_engine
    from pkv.measure.timing import graph_us_per_call

    flags = os.environ.get("PKV_NVCC_FLAGS", "")
    if "-DPKV_TRACE=1" not in flags.split():
        os.environ["PKV_NVCC_FLAGS"] = (flags + " -DPKV_TRACE=1").strip()
    from pkv.kernels.loader import ops

    pkv_ops = ops()
    clock_ghz = args.trace_clock_ghz
    buf = torch.zeros(TRACE_CTAS * TRACE_FIELDS, dtype=torch.int64)
    records, summary = [], []
    arena = KvArena.for_cases(cases)
    for case in cases:
        caches, queries = build_caches(case, args.seed, arena=arena)
        step = StepState(0, np.arange(case.batch), np.asarray(case.lens, dtype=np.int32))
        for label in engines:
            name, options = parse_spec(label)
            if name != PKV_KERNEL:
                continue
            es = [make_engine(name, c, **options) for c in caches]
            calls = [(e, e.prepare(step), q) for e, q in zip(es, queries)]
            for e, pl, q in calls:
                e.run(q, pl)
            torch.cuda.synchronize()
            graph_us = graph_us_per_call(calls, args.reps)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for e, pl, q in calls:
                    e.run(q, pl)
            graph.replay()
            pkv_ops.graph_trace(buf)   # synchronizes; clears what the warm-up and the replays left
            phases = []
            for rep in range(args.reps):
                graph.replay()
                pkv_ops.graph_trace(buf)
                rec = buf.view(TRACE_CTAS, TRACE_FIELDS).numpy().copy()
                phases.append(trace_phases(rec, clock_ghz))
                if rep == 0:
                    for cta in np.flatnonzero(rec[:, 0] > 0):
                        records.append(dict(case=case.name, engine=label, cta=int(cta),
                                            **{f: int(rec[cta, i]) for i, f in DECODE_FIELDS.items()}))
            keys = sorted({k for ph in phases for k in ph})
            row = dict(case=case.name, engine=label, graph_us_trace_build=graph_us,
                       **{k: float(np.median([ph[k] for ph in phases if k in ph])) for k in keys})
            summary.append(row)
            print(f"{case.name:10s} {label:28s} " + " ".join(
                f"{k}={row[k]:.2f}" for k in ("graph_us_trace_build", "decode_span", "start_skew", "scan",
                                               "lengths_rt", "scan_math", "cut", "bt", "setup", "bt_rt", "issue",
                                               "first_kv", "steady", "drain_state", "merge", "clock_ghz_measured")
                if k in row),
                  flush=True)
            del es, calls, graph
        del caches, queries
        torch.cuda.empty_cache()
    meta = {**io.provenance(), "command": command, "clock_ghz": f"{clock_ghz}", "complete": "true"}
    io.write_parquet(pd.DataFrame(records), args.out, meta)
    io.write_parquet(pd.DataFrame(summary), str(args.out).replace(".parquet", "") + "-phases.parquet", meta)
    print(pd.DataFrame(summary).to_string(index=False, float_format=lambda x: f"{x:.2f}"))
    return 0


def add_arguments(ap) -> None:
    ap.add_argument("--suites", default=",".join(STAGES["kernels"].suites), help="comma-separated: " + ",".join(SUITES))
    ap.add_argument("--quick", action="store_true", help="a dozen representative cases instead of the suites")
    ap.add_argument("--cases", default="", help="comma-separated case names to keep (default: every case)")
    ap.add_argument("--page-size", type=int, default=0, help="run every case at this page size (default: the case's)")
    ap.add_argument("--engines", nargs="+", default=[PKV_KERNEL, *flashinfer()],
                    help="engine specs (name or name:key=value,...), e.g. pkv-graph:min_tiles=4")
    ap.add_argument("--reps", type=int, default=20, help="graph replays timed per engine and case (median kept)")
    ap.add_argument("--seed", type=int, default=BENCH_SEED, help="seed of the KV bytes, queries and ragged lengths")
    ap.add_argument("--out", default="results/raw/kernels/sweep.parquet", help="Parquet file to write")
    ap.add_argument("--config", default="", help="a run's frozen config.json: its hash in the metadata; a smoke "
                    "run's puts the cases on the CPU (lengths scaled, CPU engines, wall time: pkv.bench.smoke)")
    ap.add_argument("--trace", action="store_true",
                    help="diagnosis: build with PKV_TRACE=1 and print each pkv-graph call's phase budget "
                         "(lengths scan, block-table ids, first KV bytes, steady loop, drain, merge; "
                         "docs/perf-notes.md) instead of the sweep; --out gets every CTA's stamps and "
                         "<out>-phases.parquet the budgets")
    ap.add_argument("--trace-clock-ghz", type=float, default=0.0,
                    help="SM clock that converts --trace's clock64 stamps to µs; 0: measured, clock64 ticks "
                         "over %%globaltimer ns of the traced CTAs")


def add_command(bench) -> None:
    p = bench.add_parser("kernels", help="pkv-graph against FlashInfer's decode variants, device time (needs a GPU)",
                         description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=lambda args: run(args, "pkv bench kernels " + " ".join(sys.argv[3:])))


def run(args, command: str) -> int:
    import pandas as pd

    from pkv.config.resolve import config_hash, device_of, load_config
    from pkv.core import io

    cfg = load_config(args.config) if args.config else None
    device = device_of(cfg) if cfg else "cuda"
    if (device == "cpu" and args.trace) or (device == "cuda" and not torch.cuda.is_available()):
        raise ValueError("pkv bench kernels needs a CUDA device (--trace too; a smoke run's --config: the CPU engines)")
    engines = list(args.engines)
    for spec in engines:
        parse_spec(spec)   # a bad spec stops before the GPU work
    unknown = [s for s in args.suites.split(",") if s not in SUITES]
    if unknown:
        raise ValueError(f"unknown suite(s) {unknown}; choose from {sorted(SUITES)}")
    cases = quick() if args.quick else [c for s in args.suites.split(",") for c in SUITES[s]()]
    if args.cases:
        keep = args.cases.split(",")
        missing = sorted(set(keep) - {c.name for c in cases})
        if missing:
            raise ValueError(f"--cases: no case named {missing} in the chosen suites")
        cases = [c for c in cases if c.name in keep]
    if args.page_size:
        cases = [dataclasses.replace(c, page_size=args.page_size) for c in cases]
    if args.trace:
        return run_trace(args, cases, engines, command)
    run_meta = {"config_hash": config_hash(cfg), "profile": cfg["profile"]} if cfg else {}
    if device == "cpu":   # the smoke profile: not a performance result (pkv.bench.smoke)
        cases, engines, reps = smoke_cases(cases), cpu_engines(engines), min(args.reps, SMOKE["reps"])
        if not engines:
            raise ValueError(f"pkv bench kernels: none of {args.engines} runs on a CPU (the smoke profile's device)")
        probes, arena = {"roofline": math.nan, "probe": math.nan}, None
        run_meta |= {"length_scale": f"{SMOKE['scale']:g}"}
    else:
        from pkv.bench.roofline import read_roofline

        probes, reps = read_roofline(), args.reps
        arena = KvArena.for_cases(cases)   # every case's KV pools, allocated once (KvArena says why)
    roofline = probes["roofline"]
    print(f"read roofline {roofline:.0f} GB/s; {len(cases)} cases on {device}", flush=True)
    # kv_pools tells the report how the KV copies were allocated (runs before the arena had none;
    # "arena": 16-bit pools only, before the FP8 ones were carved from it too).
    meta = {**io.provenance(), **run_meta, "roofline_gbps": f"{roofline:.1f}",
            "read_probe_gbps": f"{probes['probe']:.1f}", "command": command,
            "kv_pools": "arena-fp8" if arena else "one copy per case"}
    rows, t0 = [], time.time()
    for case in cases:
        print(f"{case.name}: {case.bytes / 1e6:.1f} MB", flush=True)
        rows += run_case(case, engines, reps, roofline, args.seed, arena, device)
        # Rewritten after every case: a run stopped part way keeps what it measured.
        frame = with_ratios(pd.DataFrame(rows))
        io.write_parquet(frame, args.out, {**meta, "complete": "false"})
    io.write_parquet(frame, args.out, {**meta, "complete": "true"})
    print(f"wrote {args.out} ({len(frame)} rows, {time.time() - t0:.0f} s)")
    show = frame[frame.engine.map(persistentkv)][["case", "engine", "graph_us", "cpu_us", "frac_of_roofline", "ratio"]]
    print(show.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pkv.bench.kernels", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run(args, "python -m pkv.bench.kernels " + " ".join(argv if argv is not None else sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
