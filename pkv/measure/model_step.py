"""Model-level decode step: N decoder layers around the decode attention,
a pipeline stage (`pkv measure model-step --seed S`, `pkv measure model-step-external
--trace T`; rows of pkv.config.stages) on the validated config.

Each step runs RMSNorm, one fused QKV matmul, decode attention, the output projection
(added to the residual), RMSNorm and a gated SiLU MLP in every layer, then a final
RMSNorm. Weights are random (fixed seed), in the cache's dtype.

Per-layer KV: every layer attends over its OWN KV tensor (same page table and lengths,
its own random values), sized from the pages the measured steps read
(pkv.core.paging.compact; the bytes are in the file's metadata, `kv_memory`). Not
modelled, the same for every engine: writing the new token's K/V, rotary embedding,
embedding lookup, LM head and sampling. A shape with `of_layers` (llama-70b) simulates
its model with fewer layers, as does any shape whose layers and caches do not all fit the
device (model_plan.fitted); metadata `simulated_layers` names both.

Each trace is served by pkv.core.harness continuous batching at max_active = each bucket;
`steps` decode steps evenly spaced over the served trace are measured; a step of B rows
runs in the smallest bucket >= B, padded, as serving engines pad to their capture sizes.
Engines (pkv.engines.model): `pkv-graph` (the public DecodeWrapper: one update() a step,
the whole step one CUDA graph per bucket), `flashinfer-graph` (plan() every step, replay),
`flashinfer-eager`, `adaptive` (the router, layers eager); on a CPU (smoke) `pkv-graph` runs
its CPU oracle through the same API and `reference` is FP32. Each pass's correctness baseline
is the first that ran of flashinfer-eager, reference and flashinfer-xqa-graph
(pkv.engines.table.check_base); a pass where none ran is unchecked: its rows' rel_err is NaN
and the file's metadata `unchecked` names them.

Windowed and sink models (ModelShape.window, global_every, sinks) and the speculative step
(model_step.q_lens: each q_len > 1 a pass whose rows carry q_len query tokens): every runner
passes each layer's window and sinks and the pass's q_len; one that cannot is refused when
built and named in `dropped` (docs/graph-decode.md, "The model-level benchmark").

KV dtypes (model_step.kv_dtypes): the 16-bit cache first, then (`fp8`) the same values in
e4m3 with tensor scales, per layer. An FP8 row's rel_err is against the 16-bit
baseline's output on the same input: the accuracy FP8 costs.

Timing (pkv.measure.timing.StepClock), per step and engine (serial pass, engines in a
rotated order, L2 flushed first): wall_s = prepare + launch + synchronize; prepare_s =
the host prepare alone; device_s = CUDA events around the launch. Then the pipelined
pass: the steps back to back with no synchronization, `repeats` times (median kept).
"""

from __future__ import annotations

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

from pkv.config.resolve import device_of, point_key
from pkv.config.typed import Config
from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import PageAssignment
from pkv.core.shape import Shape
from pkv.engines import table
from pkv.engines.model import DecoderModel, Runner, step_input
from pkv.measure.model_plan import (
    ModelStepPlan,
    TraceJob,
    adaptive_point,
    bucket_of,
    build_plan,
    first_steps,
    fitted,
    kv_bytes,
    settings,
    spread_steps,
)
from pkv.measure.model_runners import build_runners
from pkv.measure.stages import external_trace, layer_assignment, layer_caches, synthetic_trace
from pkv.measure.timing import StepClock

# Relative Frobenius error of the final hidden state against the baseline engine.
TOLERANCE = {"float16": 1e-2, "bfloat16": 4e-2, "float32": 1e-4}
FP8_TOLERANCE = 0.1           # an FP8 row against the 16-bit baseline: catches a wrong kernel, not rounding

COLUMNS = {
    "stage": "string", "model": "string", "layers": "int32", "hidden": "int32", "head_dim": "int32",
    "num_qo_heads": "int32", "num_kv_heads": "int32", "mlp": "int32", "window": "int32", "global_every": "int32",
    "sinks": "bool", "q_len": "int32", "dtype": "string", "kv_dtype": "string",
    "kv_layers": "int32", "trace": "string", "family": "string", "seed": "int64", "max_active": "int32",
    "bucket": "int32", "engine": "string", "route": "string", "launch": "string", "kind": "string",
    "step": "int32", "active": "int32", "total_tokens": "int64", "max_len": "int32", "steps": "int32",
    "tokens": "int64",
    "wall_s": "float64", "prepare_s": "float64", "device_s": "float64",
    "rel_err": "float64", "max_rel_err": "float64", "failed": "bool",
}

MEASURED_TIMES = ("wall_s", "prepare_s", "device_s")   # the timed columns (every other one is a key, count or error)

METHOD = ("serial: perf_counter around prepare + launch + synchronize, L2 flushed first, engines rotated per step; "
          "prepare_s: host prepare alone; device_s: CUDA events around the launch (graph replay or eager layers); "
          "pipelined: all steps back to back without synchronization, median of repeats; "
          "rel_err: relative Frobenius error of the final hidden state against the baseline engine on the 16-bit "
          "cache (FP8 rows too: their accuracy)")
KV_NOTE = "per-layer KV: each layer its own KV tensor (same page table and lengths, its own values)"


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error, max |diff| / max |ref|) of the real rows."""
    a, b = out.float(), ref.float()
    d = a - b
    return float(d.norm() / b.norm().clamp_min(1e-30)), float(d.abs().max() / b.abs().max().clamp_min(1e-30))


def measure_job(plan: ModelStepPlan, model: DecoderModel, caches: list[PagedCache], job: TraceJob, max_active: int,
                steps: list[StepState], runners: dict[str, Runner], xs: dict[int, torch.Tensor], clock: StepClock,
                refs: dict, q_len: int = 1) -> list[dict]:
    """Rows of COLUMNS: one per (step, engine), then one pipelined row per engine; a step's rows
    carry q_len query tokens each (xs[b]: b x q_len). `refs` holds the 16-bit baseline's outputs
    by (max_active, step, q_len): written on the 16-bit cache, read on FP8."""
    ms, s = model.shape, caches[0].shape
    labels = list(runners)
    fp8 = s.fp8
    baseline = table.check_base(runners)   # None: the pass is unchecked (rel_err NaN), named by the stage
    tol = FP8_TOLERANCE if fp8 else TOLERANCE[s.dtype]
    buckets = [bucket_of(st.active, plan.buckets) for st in steps]
    base = {"stage": "model_step", "model": ms.name, "layers": ms.layers, "hidden": ms.hidden,
            "head_dim": ms.head_dim, "num_qo_heads": ms.num_qo_heads, "num_kv_heads": ms.num_kv_heads,
            "mlp": ms.mlp, "window": ms.window, "global_every": ms.global_every, "sinks": ms.sinks,
            "q_len": q_len, "dtype": s.dtype, "kv_dtype": s.kv_dtype, "kv_layers": len(caches), "trace": job.name,
            "family": job.family, "seed": job.seed, "max_active": max_active}
    rows = []
    for i, (step, bucket) in enumerate(zip(steps, buckets)):
        n = step.active * q_len
        xs[bucket][:n].copy_(step_input(step, ms.hidden, job.seed, s.torch_dtype, caches[0].device, q_len))
        xs[bucket][n:].zero_()
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        outs, timed = {}, {}
        for label in order:
            out, wall, prep, dev = clock.serial(runners[label], step, bucket)
            outs[label] = out[:n].clone()
            timed[label] = (wall, prep, dev, runners[label].route)
        if not fp8 and baseline:
            refs[(max_active, step.step, q_len)] = outs[baseline]
        ref = refs.get((max_active, step.step, q_len))
        for label in labels:
            rel, mx = errors(outs[label], ref) if ref is not None else (math.nan, math.nan)
            wall, prep, dev, route = timed[label]
            rows.append({**base, "bucket": bucket, "engine": label, "route": route,
                         "launch": runners[label].launch_kind, "kind": "step", "step": step.step,
                         "active": step.active, "total_tokens": int(np.sum(step.seq_lens, dtype=np.int64)),
                         "max_len": int(np.max(step.seq_lens)), "steps": 1, "tokens": step.active,
                         "wall_s": wall, "prepare_s": prep, "device_s": dev, "rel_err": rel, "max_rel_err": mx,
                         "failed": ref is not None and not (rel <= tol)})
    tokens = int(sum(st.active for st in steps))
    for label in labels[len(steps) % len(labels):] + labels[:len(steps) % len(labels)]:
        walls = [clock.pipelined(runners[label], steps, buckets) for _ in range(plan.repeats)]
        rows.append({**base, "bucket": bucket_of(max_active, plan.buckets), "engine": label,
                     "route": runners[label].route,
                     "launch": runners[label].launch_kind, "kind": "pipelined", "step": -1,
                     "active": round(tokens / len(steps)),
                     "total_tokens": int(sum(int(np.sum(st.seq_lens)) for st in steps)),
                     "max_len": int(max(int(np.max(st.seq_lens)) for st in steps)), "steps": len(steps),
                     "tokens": tokens, "wall_s": statistics.median(walls), "prepare_s": math.nan,
                     "device_s": math.nan, "rel_err": math.nan, "max_rel_err": math.nan, "failed": False})
    return rows


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def _warm(runners: dict[str, Runner], first: dict[int, StepState], dropped: dict[str, str], log, tag: str) -> None:
    """Capture (graph runners) or warm up every runner on each bucket; a runner whose
    capture fails is dropped (named in `dropped` and the file's metadata), the rest go on."""
    for name in list(runners):
        try:
            for bucket, step in sorted(first.items()):
                runners[name].capture(bucket, step)
        except Exception as e:  # noqa: BLE001 - a failed capture (or JIT) drops this engine only
            traceback.print_exc(file=sys.stderr)
            dropped.setdefault(f"{name}{tag}", _error(e))
            log(f"model_step: engine {name}{tag} dropped, its capture or warm-up failed: {dropped[f'{name}{tag}']}")
            runners.pop(name).close()
            if torch.cuda.is_available():
                torch.cuda.synchronize()


def run(plan: ModelStepPlan, log=print, dropped: dict[str, str] | None = None, memory: dict | None = None,
        simulated: dict[str, str] | None = None) -> pd.DataFrame:
    """Every (shape, trace, kv_dtype, max_active) job. One shape's weights at a time, with as
    many of its layers as fit the device beside its caches (model_plan.fitted; the count run
    goes in `simulated` where it is fewer than the model's); per (shape, trace) one set of
    per-layer caches, runners and graphs, reused for every max_active. An engine whose capture
    fails, or a (shape, trace) whose measurement fails, is named in `dropped` with its error
    (traceback on stderr), and the rest goes on."""
    cfg = plan.cfg
    device = device_of(cfg)
    clock = StepClock(device == "cuda")
    start = time.monotonic()
    dropped = {} if dropped is None else dropped
    memory = {} if memory is None else memory
    simulated = {} if simulated is None else simulated
    rows = []
    for ms in plan.shapes:
        shape = ms.attention(cfg.shape.page_size, cfg.shape.dtype)
        layouts = {}
        for job in plan.traces:
            try:
                layouts[job.name] = _layout(plan, shape, job)
            except Exception as e:  # noqa: BLE001 - as a failed measurement (below)
                _job_failed(ms.name, job.name, e, dropped, log)
        if not layouts:
            continue
        try:
            ms = fitted(ms, shape, _sizing_pages(plan, shape, layouts), _free_bytes(device))
        except MemoryError as e:
            dropped[ms.name] = _error(e)
            log(f"model_step {ms.name}: not run: {_error(e)}")
            continue
        if ms.of_layers:
            simulated[ms.name] = f"{ms.layers} of {ms.of_layers} layers"
        model = DecoderModel(ms, shape.torch_dtype, device, cfg.seeds.ablation)
        for job in (j for j in plan.traces if j.name in layouts):
            try:
                _serve_trace(plan, model, job, layouts[job.name], clock, start, rows, dropped, memory, log)
            except Exception as e:  # noqa: BLE001 - keep the other jobs' rows; the error goes in the metadata
                _job_failed(ms.name, job.name, e, dropped, log)
            if device == "cuda":
                torch.cuda.empty_cache()
        del model
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)


def _job_failed(shape: str, job: str, e: Exception, dropped: dict, log) -> None:
    traceback.print_exc(file=sys.stderr)
    dropped[f"{shape}/{job}"] = _error(e)
    log(f"model_step {shape} {job}: failed, kept what was measured: {_error(e)}")


def _sizing_pages(plan: ModelStepPlan, shape: Shape, layouts: dict[str, Layout]) -> int:
    """The most pages any of the plan's sizing traces reads (its own traces' where it names none)."""
    pages = [lay.assignment.num_pages for lay in layouts.values()]
    pages += [_layout(plan, shape, job).assignment.num_pages for job in plan.sizing or () if job.name not in layouts]
    return max(pages)


def _free_bytes(device: str) -> int | None:
    """Device memory free for the next shape (its predecessor's blocks released first), in
    whole GiB so that every process of a stage on one card sizes alike; None on the CPU."""
    if device != "cuda":
        return None
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] >> 30 << 30


@dataclass(frozen=True)
class Layout:
    """One (shape, trace)'s measured steps per bucket, each bucket's capture step and the
    page table every layer shares (the pages those steps read)."""

    step_sets: dict[int, list[StepState]]
    first: dict[int, StepState]
    assignment: PageAssignment


def _layout(plan: ModelStepPlan, shape: Shape, job: TraceJob) -> Layout:
    step_sets = {b: spread_steps(job.trace, b, plan.steps) for b in plan.buckets}
    assignment = layer_assignment(job.trace, shape, plan.cfg.measure.holes, job.seed,
                                  [st for steps in step_sets.values() for st in steps])
    return Layout(step_sets, first_steps(step_sets.values(), plan.buckets), assignment)


def _serve_trace(plan: ModelStepPlan, model: DecoderModel, job: TraceJob, layout: Layout, clock: StepClock,
                 start: float, rows: list, dropped: dict, memory: dict, log) -> None:
    """One (shape, trace): each kv_dtype (16-bit first) x each q_len (1 first) x every max_active in plan.buckets."""
    cfg, ms = plan.cfg, model.shape
    shape = ms.attention(cfg.shape.page_size, cfg.shape.dtype)
    assignment = layout.assignment
    memory[f"{ms.name}/{job.name}"] = {"pages": assignment.num_pages, "layers": ms.layers,
                                       "bytes_16bit": kv_bytes(shape, assignment.num_pages, ms.layers)}
    caches = layer_caches(shape, assignment, device_of(cfg), job.seed, ms.layers)
    op = cfg.external.operating_point
    fallback = point_key(op.family, op.max_active)
    refs: dict = {}
    for kv_dtype in plan.kv_dtypes:
        engines = list(plan.engines)
        if kv_dtype == "fp8":
            for i, c in enumerate(caches):   # in place: one 16-bit layer more at the peak, not N
                caches[i] = c.quantized("tensor")
            engines = [e for e in engines if e in table.runners("fp8")]
            for e in sorted(set(plan.engines) - set(engines)):
                dropped.setdefault(f"{e}/fp8", "reads no FP8 KV cache (its routes read 16-bit KV): not in the FP8 rows")
        for q_len in plan.q_lens:     # 1: decode; > 1: the speculative step, q_len query tokens a row
            tag = pass_tag(kv_dtype, q_len)
            _serve_pass(plan, model, job, layout, caches, engines, q_len, tag, fallback, clock, start, refs, rows,
                        dropped, log)


def pass_tag(kv_dtype: str, q_len: int) -> str:
    """What a pass adds to the names of its runners in the file's metadata: "", "/fp8", "/q4", "/fp8/q4"."""
    return ("" if kv_dtype == "auto" else f"/{kv_dtype}") + ("" if q_len == 1 else f"/q{q_len}")


def _serve_pass(plan, model, job, layout, caches, engines, q_len, tag, fallback, clock, start, refs, rows, dropped,
                log) -> None:
    """One (kv_dtype, q_len) pass over every max_active: runners built (a refusal named in
    `dropped`, as a failed capture is), warmed, measured and closed."""
    ms, step_sets, first = model.shape, layout.step_sets, layout.first
    xs = {b: torch.zeros(b * q_len, ms.hidden, dtype=caches[0].shape.torch_dtype, device=caches[0].device)
          for b in plan.buckets}
    routed = [e for e in engines if e in table.runners("routed")]   # built per bucket, at its operating point
    shared = build_runners([e for e in engines if e not in routed], model, caches, xs, sorted(first), q_len=q_len,
                           refused=dropped, tag=tag)
    try:
        _warm(shared, first, dropped, log, tag)
        for b in plan.buckets:
            made = dict(shared)
            if routed:
                point = adaptive_point(plan.constants, job.family, b, fallback)
                per_bucket = build_runners(routed, model, caches, xs, sorted(first), constants=plan.constants,
                                           point=point, q_len=q_len, refused=dropped, tag=tag)
                _warm(per_bucket, first_steps([step_sets[b]], plan.buckets), dropped, log, tag)
                made.update(per_bucket)
            made = {e: made[e] for e in engines if e in made}
            if not made:
                continue
            t0 = time.monotonic()
            rows += measure_job(plan, model, caches, job, b, step_sets[b], made, xs, clock, refs, q_len)
            log(f"model_step {ms.name} {job.name}{tag} B{b}: {len(step_sets[b])} steps x {len(made)} "
                f"engines in {time.monotonic() - t0:.1f} s (total {time.monotonic() - start:.0f} s)")
    finally:
        for r in shared.values():
            r.close()


# ---------------------------------------------------------------- the stage commands


def model_step(cfg: Config | dict, k, seed: int):
    """`pkv measure model-step --seed S`: the model_step section's synthetic families on one held-out seed."""
    cfg = Config.of(cfg)
    # Sized over every held-out seed's traces: the five files of a run hold the same layers.
    sizing = [TraceJob(t.name, family, s, t) for s in cfg.seeds.heldout for family in settings(cfg).families
              for t in (synthetic_trace(cfg, family, s),)]
    return _stage(cfg, k, [j for j in sizing if j.seed == seed], f"pkv measure model-step --seed {seed}", sizing)


def model_step_external(cfg: Config | dict, k, trace: Path):
    """`pkv measure model-step-external --trace T`: the configured request file."""
    cfg = Config.of(cfg)
    t = external_trace(cfg, trace)
    name, title = cfg.external.identity()
    frame, meta = _stage(cfg, k, [TraceJob(f"{name}-{t.name}", "external", cfg.seeds.ablation, t)],
                         f"pkv measure model-step-external --trace {Path(trace).name}")
    return frame, {**meta, "trace_name": name, "trace_title": title}


def _stage(cfg: Config, k, jobs: list[TraceJob], command: str, sizing: list[TraceJob] | None = None):
    plan = build_plan(cfg, jobs, k, sizing)
    dropped: dict[str, str] = {}
    memory: dict = {}
    simulated: dict[str, str] = {}
    frame = run(plan, log=lambda m: print(m, file=sys.stderr), dropped=dropped, memory=memory, simulated=simulated)
    if frame.empty:
        raise RuntimeError(f"model_step: nothing was measured ({json.dumps(dropped)})")
    steps = frame[frame["kind"] == "step"]
    fails = steps.groupby(["engine", "kv_dtype"])["failed"].sum()
    # A pass without a correctness baseline (table.check_base) is named, not counted as passed.
    unchecked = sorted({f"{r.model}/{r.engine}{pass_tag(r.kv_dtype, r.q_len)}"
                        for r in steps[steps["rel_err"].isna() & ~steps["failed"]].itertuples()})
    print(f"model_step: {len(frame)} rows; correctness failures: "
          f"{', '.join(f'{e}/{d}={int(n)}' for (e, d), n in fails.items())}"
          + (f"; unchecked, no correctness baseline ran: {unchecked}" if unchecked else "")
          + (f"; dropped: {dropped}" if dropped else ""), file=sys.stderr)
    meta = {"command": command, "method": METHOD, "tolerance": json.dumps({**TOLERANCE, "fp8": FP8_TOLERANCE}),
            "buckets": json.dumps(plan.buckets), "engines": json.dumps(plan.engines),
            "shapes": json.dumps([s.name for s in plan.shapes]), "kv_dtypes": json.dumps(plan.kv_dtypes),
            "steps_per_job": str(plan.steps), "repeats": str(plan.repeats), "skipped": "[]",
            "engine_errors": json.dumps(dropped), "unchecked": json.dumps(unchecked), "memory_note": KV_NOTE,
            "kv_memory": json.dumps(memory),
            "simulated_layers": json.dumps(simulated),
            "trace_sha256": json.dumps({j.name: j.trace.checksum() for j in jobs})}
    return frame, meta
