"""What one model-step job measures (pkv measure model-step / model-step-external): its
settings from the config's `model_step` section, its traces and steps, the batch
buckets, and the per-layer KV caches sized from the pages the measured steps read.

Memory (docs/graph-decode.md, "Memory"): every layer has its own KV tensor, so a shape's
caches hold layers x pages x page_size x 2 (K, V) x H_kv x d x bytes. The pages are those
the job's measured steps read (`pkv.core.paging.compact`), not every page the whole trace would reserve;
`kv_bytes` is that arithmetic, written into the file's metadata per (shape, trace).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pkv.config.resolve import ConfigError, point_key
from pkv.config.typed import Config, ModelStep
from pkv.core.harness import StepState
from pkv.core.shape import Shape
from pkv.core.traces import Trace
from pkv.engines.model import CPU_ENGINES, GPU_ENGINES, MODEL_SHAPES, ModelShape
from pkv.engines.table import runners


@dataclass(frozen=True)
class TraceJob:
    name: str
    family: str
    seed: int
    trace: Trace


@dataclass
class ModelStepPlan:
    """What one run measures, resolved from the config."""

    cfg: Config
    shapes: list[ModelShape]
    buckets: list[int]
    traces: list[TraceJob]
    steps: int
    engines: list[str]
    repeats: int
    kv_dtypes: list[str]
    constants: object = None
    q_lens: tuple[int, ...] = (1,)   # query tokens a row: 1 decodes, > 1 is the speculative step
    # The traces whose pages size a shape to the device (`fitted`): every file of a stage
    # then runs the same layers, however its own trace's pages fall. Default: `traces`.
    sizing: list[TraceJob] | None = None


def settings(cfg: Config) -> ModelStep:
    """The config's model_step section (required: config.yaml names every key, its `smoke:`
    section what the smoke profile runs instead)."""
    return cfg.model_step


def build_plan(cfg: Config, traces: list[TraceJob], constants=None,
               sizing: list[TraceJob] | None = None) -> ModelStepPlan:
    s = settings(cfg)
    allowed = CPU_ENGINES if cfg.profile == "smoke" else GPU_ENGINES
    wrong = [e for e in s.engines if e not in allowed]
    if wrong:
        raise ConfigError(f"model_step.engines: the {cfg.profile} profile runs engines from {', '.join(allowed)}; "
                          f"got {', '.join(wrong)}")
    if s.kv_dtypes[0] != "auto":
        raise ConfigError("model_step.kv_dtypes: the 16-bit cache ('auto') comes first (FP8's accuracy is "
                          "measured against it)")
    if s.q_lens[0] != 1:
        raise ConfigError("model_step.q_lens: decode (1) comes first (the speculative steps follow it)")
    return ModelStepPlan(cfg, [MODEL_SHAPES[n] for n in s.shapes], sorted(s.buckets), traces, s.steps,
                         list(s.engines), s.repeats, list(s.kv_dtypes),
                         constants if any(e in runners("routed") for e in s.engines) else None, tuple(s.q_lens),
                         sizing)


# ---------------------------------------------------------------- buckets and steps


def bucket_of(active: int, buckets) -> int:
    """The smallest bucket holding `active` rows."""
    fits = [b for b in sorted(buckets) if b >= active]
    if active < 1 or not fits:
        raise ValueError(f"a step of {active} rows fits none of the batch buckets {sorted(buckets)}")
    return fits[0]


def spread_steps(trace: Trace, max_active: int, count: int) -> list[StepState]:
    """`count` steps evenly spaced over the whole served trace (ramp-up, steady state and
    drain; the first and the last step included), from pkv.core.harness continuous batching."""
    from pkv.measure.stages import steps_of

    steps = steps_of(trace, max_active, None)
    if count >= len(steps):
        return steps
    return [steps[i] for i in np.unique(np.linspace(0, len(steps) - 1, count).round().astype(int))]


def first_steps(step_sets, buckets) -> dict[int, StepState]:
    """The first step that lands in each bucket (the one its graph is captured with)."""
    first = {}
    for steps in step_sets:
        for st in steps:
            first.setdefault(bucket_of(st.active, buckets), st)
    return first


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


# ---------------------------------------------------------------- per-layer KV sizing


def kv_bytes(shape: Shape, pages: int, layers: int) -> int:
    """Bytes of `layers` per-layer caches of `pages` pages (K and V; FP8: one byte an element)."""
    return layers * pages * shape.page_size * 2 * shape.num_kv_heads * shape.head_dim * shape.kv_itemsize


# Device memory a shape's weights and caches leave to the rest of the step: the runners'
# workspaces (FlashInfer's 128 MiB float buffer per wrapper and bucket), the graphs' pools,
# activations and the allocator's rounding.
RESERVE_BYTES = 4 << 30


def fitted(ms: ModelShape, shape: Shape, pages: int, free: int | None) -> ModelShape:
    """`ms`, or the same model simulated by the most layers whose weights and per-layer KV
    (`pages` pages each, 16-bit) fit `free` bytes of device memory. Per-layer KV grows with
    the layers: an 8B-like model's 32 layers of bimodal B8 KV take 67 GiB beside 13 GiB of
    weights, more than an H100's 79 GiB. Counted beside the layers: RESERVE_BYTES and the
    FP32 draw of the layer being made (two 16-bit layers; FP8's in-place quantization needs
    half of one). The simulated shape's `of_layers` is the model's own count, so the
    table's source line names it. `free` None (the CPU): `ms`."""
    if free is None:
        return ms
    layer_kv = kv_bytes(shape, pages, 1)
    per_layer = layer_kv + ms.layer_weight_bytes(shape.itemsize)
    room = free - RESERVE_BYTES - 2 * layer_kv
    layers = max(room // per_layer, 0)
    if layers >= ms.layers:
        return ms
    if layers < 1:
        need = (per_layer + 2 * layer_kv + RESERVE_BYTES) / 2**30
        raise MemoryError(f"model shape {ms.name}: one layer of {pages} KV pages needs {need:.1f} GiB of device "
                          f"memory, {free / 2**30:.1f} GiB is free")
    return replace(ms, layers=int(layers), of_layers=ms.of_layers or ms.layers)
