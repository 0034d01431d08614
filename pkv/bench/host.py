"""`pkv bench host`: the host path of one decode step, per engine and batch size.

For each batch size and engine this times, over a run of consecutive decode steps of one
active set (every row one token longer each step, as in continuous batching), exactly
what pkv.measure.loop times: an untimed pass first (validation on, FlashInfer's per-step
view built, warm-up), then with validation off

- prepare_us: prepare(step), the engine's whole per-step host work;
- launch_us: run(q, plan) until it returns (host time to queue the device work);
- wall_us: prepare + run + synchronize;
- route_us: the router's decision inside prepare() (adaptive only).

Beside each planned FlashInfer engine (table.planned(); the plan-free XQA has no plan() and
its prepare() is the whole host cost): FlashInfer's raw `plan()` called directly on the same
prebuilt arrays (host indptr and last_page_len, device page ids), and `view_us`, the
cost of building those arrays for a step (done once per step off the timed path; a
serving engine pays a gather kernel for it). The bar (pkv.bench.bars): an
adapter's prepare() <= BAR_FACTOR x raw plan() + BAR_US. Medians over the steps, in Parquet with
provenance; its table is the report's (pkv.report.host, target tables/host_path.md).
"""

from __future__ import annotations

import math
import statistics
import sys

import numpy as np
import pandas as pd
import torch

from pkv.bench.bars import BAR_FACTOR, BAR_US
from pkv.config.resolve import config_hash, device_of, load_config, shape_of
from pkv.config.seeds import check_seed, stage_seeds
from pkv.config.typed import Config
from pkv.core import io
from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages, flashinfer_view
from pkv.engines import make_engine, table
from pkv.engines.flashinfer import plan as flashinfer_plan
from pkv.measure.timing import HostClock, sync
from pkv.plan.costmodel import Constants
from pkv.plan.schedule import SplitPolicy

BATCHES = (1, 8, 32, 128)
SMOKE = {"batches": (1, 4), "min_len": 16, "max_len": 200, "steps": 4}


def nearest_point(k: Constants, batch: int) -> str:
    """The calibrated operating point whose batch is nearest `batch` (log scale)."""
    if not k.operating_points:
        raise ValueError("the constants hold no operating point")
    return min(k.operating_points, key=lambda p: (abs(math.log(int(p.rsplit("-b", 1)[1]) / batch)), p))


def make_steps(batch: int, steps: int, min_len: int, max_len: int, seed: int) -> list[StepState]:
    rng = np.random.default_rng(seed + batch)
    lens = rng.integers(min_len, max_len + 1, size=batch).astype(np.int64)
    ids = np.arange(batch, dtype=np.int64)
    return [StepState(t, ids, (lens + t).astype(np.int32)) for t in range(steps)]


def build(name: str, cache: PagedCache, k: Constants | None, point: str | None):
    if table.is_router(name):
        if k is None:
            raise ValueError(f"{name} needs --constants")
        return make_engine(name, cache, constants=k, point=point)
    if table.family(name) == "pkv":
        if k is not None and point is not None:
            policy = SplitPolicy(k.split(point, table.info(name).split_route), k.min_tiles_per_split)
        else:
            policy = None
        options = {} if cache.kv.is_cuda else {"num_sms": k.sm_count if k else 1}
        return make_engine(name, cache, policy, **options)
    return make_engine(name, cache)


def host_path_medians(engine, steps: list[StepState], q: torch.Tensor, cuda: bool) -> dict:
    """Host-path medians of one engine over `steps`: prepare(), the launch, the wall time of
    both and the router's decision, each step validated first outside the timed region."""
    prep, launch, wall, route = [], [], [], []
    plan = None
    for step in steps:
        engine.validate = True                 # the untimed pass of pkv.measure.loop
        engine.run(q, engine.prepare(step))
        engine.validate = False
        sync("cuda" if cuda else "cpu")
        clock = HostClock()
        plan = engine.prepare(step)
        clock.mark()
        engine.run(q, plan)
        clock.mark()
        sync("cuda" if cuda else "cpu")
        wall.append(clock.stop())
        prep_s, launch_s, _ = clock.phases()
        prep.append(prep_s)
        launch.append(launch_s)
        route.append(getattr(plan, "route_s", math.nan))
    engine.validate = True
    exact = []
    if getattr(engine, "router", None) is not None:   # the same decisions, uncached: what a cache miss costs
        uncached = engine.router.uncached()
        for step in steps:
            clock = HostClock()
            uncached.decide(step.request_ids, step.seq_lens)
            exact.append(clock.stop())
    us = lambda xs: 1e6 * statistics.median(xs)  # noqa: E731
    return {"route": plan.route, "prepare_us": us(prep), "prepare_p90_us": 1e6 * float(np.percentile(prep, 90)),
            "launch_us": us(launch), "wall_us": us(wall),
            "route_us": us(route) if not math.isnan(route[0]) else math.nan,
            "route_max_us": 1e6 * max(route) if not math.isnan(route[0]) else math.nan,
            "route_exact_us": us(exact) if exact else math.nan}


# The columns that hold a measured time (or a bar made from one): two runs of the same
# config agree on every other column, never on these.
MEASURED_TIMES = ("prepare_us", "prepare_p90_us", "launch_us", "wall_us", "route_us", "route_max_us",
                  "route_exact_us", "raw_plan_us", "view_us", "bar_us")


def raw_plan(engine, steps: list[StepState], cuda: bool) -> dict:
    """FlashInfer's own plan() on the prebuilt arrays of each step, called on the wrapper
    directly; and the cost of building those arrays (the adapter does it off the timed path)."""
    s = engine.cache.shape
    plans, views = [], []
    for step in steps:
        clock = HostClock()
        v = flashinfer_view(engine.cache.assignment, step.request_ids, step.seq_lens)
        arrays = (torch.from_numpy(v.indptr), torch.from_numpy(v.indices).to(engine.cache.device),
                  torch.from_numpy(v.last_page_len), torch.from_numpy(np.asarray(step.seq_lens, dtype=np.int32)))
        sync("cuda" if cuda else "cpu")
        views.append(clock.stop())
        indptr, indices, last, lens = arrays
        qo_indptr = torch.arange(step.active + 1, dtype=torch.int32)
        sync("cuda" if cuda else "cpu")
        clock = HostClock()
        flashinfer_plan(engine.wrapper, s, indptr, indices, last, seq_lens=lens,
                        qo_indptr=qo_indptr if table.info(engine.name).kind == "persistent" else None)
        plans.append(clock.stop())
        sync("cuda" if cuda else "cpu")
    return {"raw_plan_us": 1e6 * statistics.median(plans), "view_us": 1e6 * statistics.median(views)}


def bench(cfg: dict, k: Constants | None, engines: list[str], batches: tuple[int, ...], steps: int, min_len: int,
          max_len: int, seed: int) -> pd.DataFrame:
    device = device_of(cfg)
    cuda = device == "cuda"
    shape = shape_of(cfg)
    holes = Config.of(cfg).measure.holes
    rows = []
    for batch in batches:
        trace_steps = make_steps(batch, steps, min_len, max_len, seed)
        reserve = trace_steps[-1].seq_lens.astype(np.int64)
        cache = PagedCache.random(shape, assign_pages(reserve, shape.page_size, holes, seed), device, seed)
        q = cache.query(batch, seed)
        point = nearest_point(k, batch) if k is not None else None
        tokens = float(np.mean([s.seq_lens.sum(dtype=np.int64) for s in trace_steps]))
        for name in engines:
            base = dict(batch=batch, engine=name, point=point or "", steps=steps, mean_total_tokens=tokens,
                        max_len=int(reserve.max()), device=device)
            try:
                engine = build(name, cache, k, point)
                row = {**base, **host_path_medians(engine, trace_steps, q, cuda), "error": ""}
                if name in table.planned():
                    row.update(raw_plan(engine, trace_steps, cuda))
                    row["bar_us"] = BAR_FACTOR * row["raw_plan_us"] + BAR_US
                    row["meets_bar"] = bool(row["prepare_us"] <= row["bar_us"])
            except (ValueError, RuntimeError, ImportError) as err:   # an engine absent or not built here
                print(f"  B{batch} {name}: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
                rows.append({**base, "error": f"{type(err).__name__}: {str(err)[:300]}"})
                continue
            rows.append(row)
            print(f"  B{batch:<4d} {name:22s} prepare {row['prepare_us']:8.1f} us  launch {row['launch_us']:7.1f} us  "
                  f"wall {row['wall_us']:8.1f} us" + (f"  raw plan {row['raw_plan_us']:7.1f} us" if "raw_plan_us" in row
                                                      else ""), file=sys.stderr, flush=True)
        del cache
        if cuda:
            torch.cuda.empty_cache()
    frame = pd.DataFrame(rows)
    for col in ("route", *MEASURED_TIMES, "meets_bar"):
        if col not in frame:
            frame[col] = math.nan
    frame["meets_bar"] = frame["meets_bar"].astype("boolean")
    frame["error"] = frame["error"].fillna("").astype(str) if "error" in frame else ""
    frame["route"] = frame["route"].astype("string")
    return frame


def run_host(args) -> int:
    cfg = load_config(args.config)
    typed = Config.from_dict(cfg, args.config)   # a wrong key fails here, not mid-benchmark
    # The held-out discipline as for every measuring command: the config's first held-out
    # seed unless --seed names another of them.
    args.seed = stage_seeds(cfg, "host")[0] if args.seed is None else check_seed(cfg, "host", args.seed)
    smoke = typed.profile == "smoke"
    if device_of(cfg) == "cuda" and not torch.cuda.is_available():
        raise ValueError("pkv bench host: the paper profile needs a CUDA device")
    k = Constants.load(args.constants) if args.constants else None
    batches = SMOKE["batches"] if smoke else tuple(int(b) for b in args.batches.split(","))
    steps = SMOKE["steps"] if smoke else args.steps
    min_len, max_len = (SMOKE["min_len"], SMOKE["max_len"]) if smoke else (args.min_len, args.max_len)
    args.batches, args.steps, args.min_len, args.max_len = ",".join(map(str, batches)), steps, min_len, max_len
    engines = list(args.engines)
    if device_of(cfg) == "cpu":   # only the engines with a CPU implementation
        engines = [e for e in engines if table.ENGINES[e].cpu]
    frame = bench(cfg, k, engines, batches, steps, min_len, max_len, args.seed)
    command = "pkv bench host " + " ".join(f"--{key.replace('_', '-')} {value}" for key, value in vars(args).items()
                                           if key not in ("func", "command", "bench") and value != "")
    meta = {**io.provenance(config_hash(cfg), io.file_hash(args.constants) if args.constants else "none"),
            "command": command, "profile": typed.profile}
    io.write_parquet(frame, args.out, meta)   # its table: `pkv report --target results/tables/host_path.md`
    print(f"wrote {args.out}")
    return 0


def add_command(bench_sub) -> None:
    p = bench_sub.add_parser("host", help="host µs per step (prepare, launch) per engine and batch, "
                                          "beside FlashInfer's raw plan()")
    p.add_argument("--config", required=True, help="the frozen config.json (shape, profile, holes)")
    p.add_argument("--constants", default="", help="constants.json (splits, adaptive); empty: defaults, no adaptive")
    p.add_argument("--engines", nargs="+", default=list(table.deployable()), choices=list(table.ENGINES),
                   metavar="ENGINE", help="engines to time (choices: the engine table)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--steps", type=int, default=64, help="consecutive decode steps timed per engine and batch")
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=16384)
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the active sets' lengths: one of the config's held-out seeds (default: the first)")
    p.add_argument("--out", default="results/raw/host/host_path.parquet")
    p.set_defaults(func=run_host)
