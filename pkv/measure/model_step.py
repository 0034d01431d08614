"""Model-level decode step (issue 12): N decoder layers around the decode attention.

Each step runs RMSNorm, one fused QKV matmul, decode attention over the paged cache, the
output projection (added to the residual), RMSNorm and a gated SiLU MLP (one fused
gate/up matmul, the down matmul added to the residual) in every layer, then a final
RMSNorm. Weights are random (fixed seed), in the cache's dtype.

Memory shortcut: every layer attends over the SAME PagedCache (one K/V tensor). A real
model has one cache per layer; sharing it keeps the bytes each layer's attention reads
identical (same lengths, same pages, same shape) while holding one layer's K/V instead
of N. Not modelled, and the same for every engine: writing the new token's K/V into the
cache, rotary embedding, embedding lookup, LM head and sampling.

Each trace is served by pkv.core.harness continuous batching at max_active = each bucket;
`steps` decode steps evenly spaced over the whole served trace are measured
(`spread_steps`). A step of B rows runs in the smallest batch bucket >= B (`bucket_of`),
as serving engines pad to their graph capture sizes. Engines, all over the same weights and cache:

- `pkv-graph`: the whole N-layer step captured once per bucket in one CUDA graph;
  every step does one `prepare(step, rows=bucket)` (one small H2D copy of lengths and
  request ids, shared by all layers), then replays. Padded rows have length 0.
- `flashinfer-graph`: FlashInfer's CUDAGraphBatchDecodeWithPagedKVCacheWrapper (tensor
  cores, HND, buffers sized for the bucket), `plan()` on the host every step, then the
  captured step replayed: what vLLM and SGLang do. Padded rows attend over one token of
  page 0 (SGLang's fill value), since FlashInfer's plan takes no empty rows.
- `flashinfer-eager`: BatchDecodeWithPagedKVCacheWrapper (tensor cores) planned per
  step, the B rows' layers launched eagerly. It is the correctness baseline.
- `adaptive`: the repo's cost-model router (frozen constants), layers eager.
- On a CPU (smoke): `pkv-graph` runs its CPU oracle (pkv.kernels.reference) on the padded
  bucket, `reference` the FP32 attention on the B rows; no graphs.

Per step and engine (serial pass, engines in a rotated order, L2 flushed first):
wall_s = perf_counter around prepare + launch + synchronize; prepare_s = the host
prepare alone; device_s = CUDA events around the launch (the graph replay, or the
eager layers, idle gaps included). Then the pipelined pass: the trace's steps in a row
with no synchronization between steps (the host prepares step t+1 while the GPU runs
step t), timed as a whole, `repeats` times (the median is kept): tokens / wall_s is
the pipelined throughput. Every step's final hidden state of every engine is compared
with the baseline's on the same input (relative Frobenius error; `failed` past
TOLERANCE[dtype]).

    python -m pkv.measure.model_step --out results/raw/model_step/model_step.parquet
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.io import file_hash, provenance, write_parquet
from pkv.measure.timing import StepClock
from pkv.config.resolve import config_hash, effective, load_config, point_key, resolve_profile
from pkv.measure.stages import build_cache, external_trace, steps_of, synthetic_trace
from pkv.core.shape import Shape
from pkv.core.traces import Trace
from pkv.engines.model import (CPU_ENGINES, GPU_ENGINES, MODEL_SHAPES, DecoderModel, ModelShape, Runner,  # noqa: F401
                              build_runners, step_input)

REPO = Path(__file__).resolve().parents[2]
EXTERNAL = "azure"            # the --families name of the configured request file (cfg["external"])
# Relative Frobenius error of the final hidden state against the baseline engine.
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4}
BASELINES = ("flashinfer-eager", "reference")    # the first present is the correctness baseline


DEFAULTS = {
    "paper": {"shapes": "llama-1b,llama-8b", "buckets": "1,8,32", "families": f"bimodal,{EXTERNAL},zipf",
              "steps": 16, "engines": ",".join(GPU_ENGINES), "repeats": 2},
    "smoke": {"shapes": "smoke", "buckets": "1,4", "families": f"bimodal,{EXTERNAL}", "steps": 4,
              "engines": ",".join(CPU_ENGINES), "repeats": 1},
}

COLUMNS = {
    "stage": "string", "model": "string", "layers": "int32", "hidden": "int32", "head_dim": "int32",
    "num_qo_heads": "int32", "num_kv_heads": "int32", "mlp": "int32", "dtype": "string",
    "trace": "string", "family": "string", "seed": "int64", "max_active": "int32", "bucket": "int32",
    "engine": "string", "route": "string", "launch": "string", "kind": "string",
    "step": "int32", "active": "int32", "total_tokens": "int64", "max_len": "int32", "steps": "int32", "tokens": "int64",
    "wall_s": "float64", "prepare_s": "float64", "device_s": "float64",
    "rel_err": "float64", "max_rel_err": "float64", "failed": "bool",
}


# ---------------------------------------------------------------- buckets and padding


def bucket_of(active: int, buckets) -> int:
    """The smallest bucket holding `active` rows."""
    fits = [b for b in sorted(buckets) if b >= active]
    if active < 1 or not fits:
        raise ValueError(f"a step of {active} rows fits none of the batch buckets {sorted(buckets)}")
    return fits[0]


def spread_steps(trace: Trace, max_active: int, count: int) -> list[StepState]:
    """`count` steps evenly spaced over the whole served trace (ramp-up, steady state and
    drain; the first and the last step included), from pkv.core.harness continuous batching."""
    steps = steps_of(trace, max_active, None)
    if count >= len(steps):
        return steps
    return [steps[i] for i in np.unique(np.linspace(0, len(steps) - 1, count).round().astype(int))]


def adaptive_point(constants, family: str, max_active: int, fallback: str) -> str:
    """The frozen operating point of (family, max_active), else the family's calibrated
    point of nearest max_active, else `fallback` (the external trace's point)."""
    exact = point_key(family, max_active)
    if exact in constants.operating_points:
        return exact
    prefix = f"{family}-b"
    mine = [p for p in constants.operating_points if p.startswith(prefix) and p[len(prefix):].isdigit()]
    if mine:
        return min(mine, key=lambda p: (abs(int(p[len(prefix):]) - max_active), p))
    return fallback


# ---------------------------------------------------------------- measurement


@dataclass(frozen=True)
class TraceJob:
    name: str
    family: str
    seed: int
    trace: Trace


@dataclass
class Plan:
    """What one run measures (resolved from the CLI and the config)."""

    cfg: dict
    shapes: list[ModelShape]
    buckets: list[int]
    traces: list[TraceJob]
    steps: int
    engines: list[str]
    repeats: int
    budget_s: float
    constants: object = None


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |diff| / max |ref|) of the real rows."""
    a, b = out.float(), ref.float()
    d = a - b
    return float(d.norm() / b.norm().clamp_min(1e-30)), float(d.abs().max() / b.abs().max().clamp_min(1e-30))


def measure_job(plan: Plan, model: DecoderModel, cache: PagedCache, job: TraceJob, max_active: int,
                steps: list[StepState], runners: dict[str, Runner], xs: dict[int, torch.Tensor],
                clock: StepClock) -> list[dict]:
    """Rows of COLUMNS: one per (step, engine), then one pipelined row per engine."""
    ms, s = model.shape, cache.shape
    labels = list(runners)
    baseline = next((b for b in BASELINES if b in runners), None)   # None: nothing to check against
    tol = TOLERANCE[s.dtype]
    buckets = [bucket_of(st.active, plan.buckets) for st in steps]
    base = {"stage": "model_step", "model": ms.name, "layers": ms.layers, "hidden": ms.hidden,
            "head_dim": ms.head_dim, "num_qo_heads": ms.num_qo_heads, "num_kv_heads": ms.num_kv_heads,
            "mlp": ms.mlp, "dtype": s.dtype, "trace": job.name, "family": job.family, "seed": job.seed,
            "max_active": max_active}
    rows = []
    for i, (step, bucket) in enumerate(zip(steps, buckets)):
        x = step_input(step, ms.hidden, job.seed, s.torch_dtype, cache.device)
        xs[bucket][:step.active].copy_(x)
        xs[bucket][step.active:].zero_()
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        outs, timed = {}, {}
        for label in order:
            out, wall, prep, dev = clock.serial(runners[label], step, bucket)
            outs[label] = out[:step.active].clone()
            timed[label] = (wall, prep, dev, runners[label].route)
        for label in labels:
            rel, mx = errors(outs[label], outs[baseline]) if baseline else (math.nan, math.nan)
            wall, prep, dev, route = timed[label]
            rows.append({**base, "bucket": bucket, "engine": label, "route": route,
                         "launch": runners[label].launch_kind, "kind": "step", "step": step.step,
                         "active": step.active, "total_tokens": int(np.sum(step.seq_lens, dtype=np.int64)),
                         "max_len": int(np.max(step.seq_lens)), "steps": 1, "tokens": step.active,
                         "wall_s": wall, "prepare_s": prep, "device_s": dev, "rel_err": rel, "max_rel_err": mx,
                         "failed": bool(baseline) and not (rel <= tol)})
    tokens = int(sum(st.active for st in steps))
    for label in labels[len(steps) % len(labels):] + labels[:len(steps) % len(labels)]:
        walls = [clock.pipelined(runners[label], steps, buckets) for _ in range(plan.repeats)]
        rows.append({**base, "bucket": bucket_of(max_active, plan.buckets), "engine": label, "route": runners[label].route,
                     "launch": runners[label].launch_kind, "kind": "pipelined", "step": -1,
                     "active": round(tokens / len(steps)), "total_tokens": int(sum(int(np.sum(st.seq_lens)) for st in steps)),
                     "max_len": int(max(int(np.max(st.seq_lens)) for st in steps)), "steps": len(steps),
                     "tokens": tokens, "wall_s": statistics.median(walls), "prepare_s": math.nan,
                     "device_s": math.nan, "rel_err": math.nan, "max_rel_err": math.nan, "failed": False})
    return rows


def _first_steps(step_sets, buckets) -> dict[int, StepState]:
    """The first step that lands in each bucket (the one its graph is captured with)."""
    first = {}
    for steps in step_sets:
        for st in steps:
            first.setdefault(bucket_of(st.active, buckets), st)
    return first


def _warm(runners: dict[str, Runner], first: dict[int, StepState], dropped: dict[str, str], log) -> None:
    """Capture (graph runners) or warm up every runner on each bucket; a runner whose
    capture fails is dropped (named in `dropped` and the file's metadata), the rest go on."""
    for name in list(runners):
        try:
            for bucket, step in sorted(first.items()):
                runners[name].capture(bucket, step)
        except Exception as e:  # noqa: BLE001 - a failed capture (or JIT) drops this engine only
            traceback.print_exc(file=sys.stderr)
            dropped.setdefault(name, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            log(f"model_step: engine {name} dropped, its capture or warm-up failed: {dropped[name]}")
            runners.pop(name).close()
            if torch.cuda.is_available():
                torch.cuda.synchronize()


def run(plan: Plan, log=print, dropped: dict[str, str] | None = None) -> tuple[pd.DataFrame, list[str]]:
    """Every (trace, shape, max_active) job within the time budget; returns (rows, skipped jobs).

    Per (trace, shape): one cache, one set of runners, one graph per bucket and graph
    engine, reused for every max_active; the adaptive runner is rebuilt per max_active
    (its frozen operating point depends on it). An engine whose capture fails, or a
    (shape, trace) whose measurement fails, is named in `dropped` with its error (the
    traceback goes to stderr) and the rest goes on: what was measured is kept.
    """
    cfg = plan.cfg
    cuda = cfg["profile"] != "smoke"
    dtype = cfg["shape"]["dtype"]
    clock = StepClock(cuda)
    start = time.monotonic()
    models = {ms.name: DecoderModel(ms, Shape(dtype=dtype).torch_dtype, "cuda" if cuda else "cpu",
                                    cfg["seeds"]["ablation"]) for ms in plan.shapes}
    dropped = {} if dropped is None else dropped
    rows, skipped = [], []
    for job in plan.traces:
        for ms in plan.shapes:
            if time.monotonic() - start > plan.budget_s:
                skipped += [f"{ms.name}/{job.name}/B{b}" for b in plan.buckets]
                continue
            try:
                _serve_trace(plan, models[ms.name], job, clock, start, rows, skipped, dropped, log)
            except Exception as e:  # noqa: BLE001 - keep the other jobs' rows; the error goes in the metadata
                traceback.print_exc(file=sys.stderr)
                dropped[f"{ms.name}/{job.name}"] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                log(f"model_step {ms.name} {job.name}: failed, kept what was measured: {dropped[f'{ms.name}/{job.name}']}")
            if cuda:
                torch.cuda.empty_cache()
    frame = pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)
    return frame, skipped


def _serve_trace(plan: Plan, model: DecoderModel, job: TraceJob, clock: StepClock, start: float, rows: list,
                 skipped: list, dropped: dict, log) -> None:
    """One (trace, shape): every max_active in plan.buckets, rows appended as each job ends."""
    cfg, ms = plan.cfg, model.shape
    shape = ms.attention(cfg["shape"]["page_size"], cfg["shape"]["dtype"])
    cache = build_cache(cfg, job.trace, shape, cfg["measure"]["holes"], job.seed)
    xs = {b: torch.zeros(b, ms.hidden, dtype=shape.torch_dtype, device=cache.device) for b in plan.buckets}
    step_sets = {b: spread_steps(job.trace, b, plan.steps) for b in plan.buckets}
    first = _first_steps(step_sets.values(), plan.buckets)
    op = cfg["external"]["operating_point"]
    fallback = point_key(op["family"], op["max_active"])
    shared = build_runners([e for e in plan.engines if e != "adaptive"], model, cache, xs, sorted(first))
    try:
        _warm(shared, first, dropped, log)
        for b in plan.buckets:
            if time.monotonic() - start > plan.budget_s:
                skipped.append(f"{ms.name}/{job.name}/B{b}")
                continue
            runners = dict(shared)
            if "adaptive" in plan.engines:
                point = adaptive_point(plan.constants, job.family, b, fallback)
                adaptive = build_runners(["adaptive"], model, cache, xs, sorted(first), constants=plan.constants,
                                         point=point)
                _warm(adaptive, _first_steps([step_sets[b]], plan.buckets), dropped, log)
                runners.update(adaptive)
            runners = {e: runners[e] for e in plan.engines if e in runners}
            t0 = time.monotonic()
            rows += measure_job(plan, model, cache, job, b, step_sets[b], runners, xs, clock)
            log(f"model_step {ms.name} {job.name} B{b}: {len(step_sets[b])} steps x {len(runners)} engines "
                f"in {time.monotonic() - t0:.1f} s (total {time.monotonic() - start:.0f} s)")
    finally:
        for r in shared.values():
            r.close()


# ---------------------------------------------------------------- command line


def _csv(text: str) -> list[str]:
    return [t.strip() for t in str(text).split(",") if t.strip()]


def resolve_config(config: str | None, smoke: bool) -> dict:
    """The frozen config.json if given, else the repo's config.yaml with its profile resolved."""
    if config:
        cfg = load_config(config)
        if smoke and cfg["profile"] != "smoke":
            raise ValueError(f"--smoke with {config}, whose profile is {cfg['profile']}")
        return cfg
    import yaml

    raw = yaml.safe_load((REPO / "config.yaml").read_text())
    return effective(raw, resolve_profile("smoke" if smoke else raw.get("profile", "auto"), torch.cuda.is_available()))


def trace_jobs(cfg: dict, families: list[str], seeds: list[int]) -> list[TraceJob]:
    jobs = []
    for family in families:
        if family == EXTERNAL:
            path = Path(cfg["external"]["path"])
            path = path if path.is_file() else REPO / path
            trace = external_trace(cfg, path)
            jobs.append(TraceJob(f"{EXTERNAL}-{trace.name}", "external", cfg["seeds"]["ablation"], trace))
            continue
        for seed in seeds:
            trace = synthetic_trace(cfg, family, seed)
            jobs.append(TraceJob(trace.name, family, seed, trace))
    return jobs


def build_plan(args) -> Plan:
    cfg = resolve_config(args.config, args.smoke)
    profile = cfg["profile"]
    if profile != "smoke" and not torch.cuda.is_available():
        raise ValueError("the paper profile of the model step needs a CUDA device; pass --smoke on a CPU")
    d = DEFAULTS[profile]
    shapes = [MODEL_SHAPES[n] if n in MODEL_SHAPES else None for n in _csv(args.shapes or d["shapes"])]
    if None in shapes:
        raise ValueError(f"unknown model shape in {args.shapes!r}; choose from {', '.join(MODEL_SHAPES)}")
    buckets = sorted({int(b) for b in _csv(args.buckets or d["buckets"])})
    if not buckets or buckets[0] < 1:
        raise ValueError(f"batch buckets must be positive integers, got {args.buckets!r}")
    engines = _csv(args.engines or d["engines"])
    allowed = CPU_ENGINES if profile == "smoke" else GPU_ENGINES
    if not engines or any(e not in allowed for e in engines):
        raise ValueError(f"the {profile} profile runs engines from {', '.join(allowed)}; got {engines}")
    seeds = [int(s) for s in _csv(args.seeds)] if args.seeds else cfg["seeds"]["heldout"][:1]
    families = _csv(args.families or d["families"])
    steps = args.steps or d["steps"]
    constants = None
    if "adaptive" in engines:
        from pkv.plan.costmodel import Constants

        constants = Constants.load(args.constants)
    return Plan(cfg, shapes, buckets, trace_jobs(cfg, families, seeds), steps, engines,
                args.repeats or d["repeats"], args.budget_s, constants)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pkv.measure.model_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="Parquet file to write")
    p.add_argument("--config", help="frozen config.json (default: the repo's config.yaml, profile resolved)")
    p.add_argument("--constants", default=str(REPO / "results" / "calibration" / "constants.json"),
                   help="frozen constants for the adaptive engine")
    p.add_argument("--shapes", help=f"model shapes, comma-separated ({', '.join(MODEL_SHAPES)})")
    p.add_argument("--buckets", help="padded batch buckets (also the max_active values served)")
    p.add_argument("--families", help=f"trace families, and '{EXTERNAL}' for the configured request file")
    p.add_argument("--seeds", help="held-out seeds of the synthetic traces (default: the first)")
    p.add_argument("--steps", type=int, help="decode steps per (trace, max_active), evenly spaced over the trace")
    p.add_argument("--engines", help=f"engines (GPU: {', '.join(GPU_ENGINES)}; CPU: {', '.join(CPU_ENGINES)})")
    p.add_argument("--repeats", type=int, help="pipelined passes per engine (median kept)")
    p.add_argument("--budget-s", type=float, default=170.0,
                   help="start no new job past this many seconds; skipped jobs are named in the file's metadata")
    p.add_argument("--smoke", action="store_true", help="CPU smoke: tiny shapes, pkv-graph's CPU oracle and reference")
    return p


METHOD = ("serial: perf_counter around prepare + launch + synchronize, L2 flushed first, engines rotated per step; "
          "prepare_s: host prepare alone; device_s: CUDA events around the launch (graph replay or eager layers); "
          "pipelined: all steps back to back without synchronization, median of repeats; "
          "rel_err: relative Frobenius error of the final hidden state against the baseline engine")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = build_plan(args)
        if plan.cfg["profile"] == "smoke":
            print("*** CPU smoke — not a performance result: tiny shapes, CPU engines ***", file=sys.stderr)
        engine_errors: dict[str, str] = {}
        frame, skipped = run(plan, log=lambda m: print(m, file=sys.stderr), dropped=engine_errors)
    except (ValueError, OSError) as e:
        print(f"pkv.measure.model_step: error: {e}", file=sys.stderr)
        return 2
    steps = frame[frame["kind"] == "step"]
    fails = steps.groupby("engine")["failed"].sum()
    command = " ".join(["python3 -m pkv.measure.model_step", *(argv if argv is not None else sys.argv[1:])])
    meta = {**provenance(config_hash(plan.cfg), file_hash(args.constants if plan.constants else None)),
            "stage": "model_step", "profile": plan.cfg["profile"], "command": command,
            "method": METHOD, "tolerance": json.dumps(TOLERANCE), "buckets": json.dumps(plan.buckets),
            "engines": json.dumps(plan.engines), "steps_per_job": str(plan.steps), "repeats": str(plan.repeats),
            "skipped": json.dumps(skipped), "engine_errors": json.dumps(engine_errors),
            "memory_note": "one KV cache shared by every layer (same bytes read per layer as a real model)"}
    write_parquet(frame, args.out, meta)
    print(f"wrote {len(frame)} rows to {args.out}; correctness failures per engine: "
          f"{', '.join(f'{e}={int(n)}' for e, n in fails.items()) or 'none checked'}"
          + (f"; skipped past the {plan.budget_s:.0f} s budget: {', '.join(skipped)}" if skipped else "")
          + (f"; engines dropped: {engine_errors}" if engine_errors else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
