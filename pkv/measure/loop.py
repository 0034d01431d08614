"""The serving measurement loop (paper §3.6, §3.9): one direction, trace to Parquet rows.

For every decode step and every engine, over one PagedCache (same KV bytes and page ids
for all engines): correctness first (an untimed pass against the baseline engine with
the paper's tolerance, plus a sampled FP32 reference check), then the timed pass:

- wall_s: time.perf_counter() around prepare() + run() + synchronize (serving-facing);
- cuda_s: CUDA events around the queued run() work (device diagnostic);
- graph_s: device time of one CUDA-graph replay of run(), L2 flushed first (no host
  overhead at all).

Layers (mlp_proxy): a step of `job.layers` > 1 layers is one prepare() (one metadata
upload) and then, per layer i, run(q, plan, caches[i]) over layer i's own KV cache (same
page table, its own values) and the tail; every timing covers all the layers. The
correctness pass checks layer 0 and the last layer, each against the baseline and the
FP32 reference over that layer's cache; a row's errors are the worse of the two.

On the CPU, cuda_s and graph_s are NaN. Engines are timed in a rotated order per step
so that no engine always runs first. The timings themselves (and the L2 policy) are
pkv.measure.timing's. The column schema is `COLUMNS` (docs/schema.md).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from pkv.config.typed import Tolerance  # the config's tolerance section, used as is
from pkv.core.cache import PagedCache
from pkv.core.harness import StepState, step_seed
from pkv.engines import Engine
from pkv.kernels.reference import attention_reference, tensor_lens
from pkv.measure.timing import L2_FLUSH_BYTES, Timer  # noqa: F401 - both were defined here; kept importable

# Column -> dtype of every measurement row (docs/schema.md explains each).
COLUMNS = {
    "stage": "string", "trace": "string", "family": "string", "max_active": "int32", "seed": "int64",
    "engine": "string", "route": "string", "split": "int32", "group": "int32", "layers": "int32", "kv_dtype": "string",
    "step": "int32", "active": "int32", "total_tokens": "int64", "max_len": "int32",
    "wall_s": "float64", "cuda_s": "float64", "graph_s": "float64", "estimate_s": "float64", "route_s": "float64",
    "max_abs_err": "float64", "mean_abs_err": "float64", "ref_max_abs_err": "float64", "ref_mean_abs_err": "float64",
    "launches": "int32", "decode_launches": "float64", "merge_launches": "float64", "extra_launches": "float64",
    "decode_ctas": "float64", "empty_ctas": "float64", "cta_work_per_sm": "float64",
    "useful_kv_bytes": "float64", "read_kv_bytes": "float64", "merge_bytes": "float64", "task_kv_bytes": "float64",
}
# The columns that are measured times (the rest are keys, counters, routes, errors and model
# estimates): two runs of the same jobs agree on everything but these.
MEASURED_TIMES = ("wall_s", "cuda_s", "graph_s", "route_s")
COUNTER_FIELDS = ("decode_launches", "merge_launches", "extra_launches", "decode_ctas", "empty_ctas",
                  "useful_kv_bytes", "read_kv_bytes", "merge_bytes", "task_kv_bytes")


class CorrectnessError(ValueError):
    """An engine's output left the tolerance; no timing of that trace is trustworthy.
    (A ValueError, so the CLI reports it in one line and exits 2.)"""


@dataclass(frozen=True)
class Job:
    """Labels every row of one measurement carries."""

    stage: str
    trace: str
    family: str
    max_active: int
    seed: int
    group: int
    split: int = 0     # the split an ablation forced; 0 = the engine's own
    layers: int = 1


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    e = (out.float() - ref.float()).abs()
    return float(e.max()), float(e.mean())


def _check(job: Job, step: int, label: str, against: str, err: tuple[float, float], tol: Tolerance) -> None:
    if not (err[0] < tol.max_abs and err[1] < tol.mean_abs):
        raise CorrectnessError(
            f"{job.trace} step {step}: engine {label} vs {against}: max|e| {err[0]:.3g} (limit {tol.max_abs:g}), "
            f"mean|e| {err[1]:.3g} (limit {tol.mean_abs:g})")


def measure(
    job: Job,
    cache: PagedCache,
    steps: list[StepState],
    engines: dict[str, Engine],
    baseline: str,
    tol: Tolerance,
    reference_every: int,
    graph: bool,
    repeats: int = 1,
    tail: Callable[[torch.Tensor], torch.Tensor] | None = None,
    layer_caches: Sequence[PagedCache] | None = None,
) -> pd.DataFrame:
    """Rows of COLUMNS, one per (step, engine); raises CorrectnessError before timing a bad step.

    `layer_caches`: the job.layers caches a step's layers read, layer_caches[0] being `cache` (the one
    the engines were built on) and all over its page table; needed when job.layers > 1."""
    if baseline not in engines:
        raise ValueError(f"baseline engine {baseline!r} is not among {sorted(engines)}")
    caches = [cache] if layer_caches is None else list(layer_caches)
    if len(caches) != job.layers or caches[0] is not cache:
        raise ValueError(f"{job.layers} layer(s) need as many KV caches, the first the engines' own; got {len(caches)}")
    cuda = cache.kv.is_cuda
    timer = Timer(cuda, graph, job.layers, tail, caches)
    checked = sorted({0, len(caches) - 1})   # layer 0 and the last: each must read its own KV
    labels = list(engines)
    rows = []
    for i, state in enumerate(tqdm(steps, desc=f"{job.stage} {job.trace}", unit="step", file=sys.stderr,
                                   mininterval=2.0)):
        q = cache.query(state.active, seed=step_seed(job.seed, state.step))
        # Correctness first (untimed; also warms every engine for this step's shapes): one
        # prepare() per engine, then run() over each checked layer's cache.
        base_plan = engines[baseline].prepare(state)
        bases = [engines[baseline].run(q, base_plan, caches[j]).clone() for j in checked]
        refs = [_reference(q, caches[j], state) if i % reference_every == 0 else None for j in checked]
        errs = {}
        for label in labels:
            plan = base_plan if label == baseline else engines[label].prepare(state)
            worst = None
            for j, base, ref in zip(checked, bases, refs):
                out = base if label == baseline else engines[label].run(q, plan, caches[j])
                name = label if len(caches) == 1 else f"{label} (layer {j})"
                err = _errors(out, base)
                _check(job, state.step, name, baseline, err, tol)
                ref_err = _errors(out, ref) if ref is not None else (math.nan, math.nan)
                if ref is not None:
                    _check(job, state.step, name, "FP32 reference", ref_err, tol)
                e = err + ref_err
                worst = e if worst is None else tuple(max(a, b) for a, b in zip(worst, e))
            errs[label] = worst
        # Timed pass, engine order rotated per step: wall and events of every engine first,
        # then graph replays. Capturing and freeing a graph leaves allocator and driver work
        # behind, which would land in the next engine's wall time.
        order = labels[i % len(labels):] + labels[:i % len(labels)]
        samples = {label: [timer.timed(engines[label], state, q) for _ in range(repeats)] for label in order}
        for label in order:
            plan = samples[label][-1][0]
            rows.append(_row(job, state, label, cache.shape.kv_dtype, plan, errs[label],
                             statistics.median(s[1] for s in samples[label]),
                             statistics.median(s[2] for s in samples[label]),
                             timer.graph_time(label, engines[label], q, plan)))
    return pd.DataFrame(rows, columns=list(COLUMNS)).astype(COLUMNS)


def _reference(q: torch.Tensor, cache: PagedCache, state: StepState) -> torch.Tensor:
    """The FP32 reference attention of this step over `cache` (one layer's KV)."""
    table = cache.block_table[torch.as_tensor(state.request_ids, device=cache.device)]
    return attention_reference(q, cache.values(), table, tensor_lens(state.seq_lens, cache.device))


def _row(job: Job, state: StepState, label: str, kv_dtype: str, plan, errs, wall: float, cuda: float,
         graph: float) -> dict:
    # An adaptive plan's counters are those of the route it chose.
    counters = getattr(plan, "inner", plan).counters
    row = {
        "stage": job.stage, "trace": job.trace, "family": job.family, "max_active": job.max_active, "seed": job.seed,
        "engine": label, "route": plan.route, "split": job.split, "group": job.group, "layers": job.layers,
        "kv_dtype": kv_dtype,
        "step": state.step, "active": state.active, "total_tokens": int(np.sum(state.seq_lens, dtype=np.int64)),
        "max_len": int(np.max(state.seq_lens)), "wall_s": wall, "cuda_s": cuda, "graph_s": graph,
        "estimate_s": getattr(plan, "estimate_s", math.nan), "route_s": getattr(plan, "route_s", math.nan),
        "max_abs_err": errs[0], "mean_abs_err": errs[1], "ref_max_abs_err": errs[2], "ref_mean_abs_err": errs[3],
        "launches": plan.launches,
    }
    for name in COUNTER_FIELDS:
        row[name] = float(getattr(counters, name)) if counters is not None else math.nan
    row["cta_work_per_sm"] = counters.cta_work_per_sm if counters is not None else math.nan
    return row
