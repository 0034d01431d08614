"""What each pipeline stage measures, as functions of the resolved config and the frozen
constants. Each returns one long-format frame (pkv.measure.loop.COLUMNS) plus the metadata
its Parquet file records beside the provenance.

Each stage takes the frozen config dict (or its typed view) and reads it through
pkv.config.typed.Config, so a wrong key fails when the config is loaded, not mid-job.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from pkv.config.resolve import device_of, point_key, shape_of
from pkv.config.typed import Config
from pkv.core.cache import PagedCache
from pkv.core.harness import StepState, decode_steps
from pkv.core.paging import PageAssignment, assign_pages, compact
from pkv.core.shape import Shape
from pkv.core.trace_files import columns, load_trace
from pkv.core.traces import SyntheticSpec, Trace, Transform, synthetic
from pkv.engines import make_engine, table
from pkv.engines.base import Engine
from pkv.measure.loop import Job, Tolerance, measure
from pkv.plan.costmodel import Constants
from pkv.plan.schedule import SplitPolicy

Result = tuple[pd.DataFrame, dict]


def build_engine(spec: str, cache: PagedCache, k: Constants, point: str, split: int | None = None) -> Engine:
    """Engine `spec` at the frozen operating point `point`; `split` forces a split count."""
    name, options = table.parse_spec(spec)
    if table.is_router(name):
        if split is not None:
            k = dataclasses.replace(k, operating_points={point: {**k.operating_points.get(point, {}), "bucket": split,
                                                                 "workqueue": split}})
        return make_engine(name, cache, constants=k, point=point, **options)   # objective
    if table.family(name) == "pkv":
        policy = SplitPolicy(split or k.split(point, table.info(name).split_route), k.min_tiles_per_split)
        if not cache.kv.is_cuda:
            options["num_sms"] = k.sm_count
        return make_engine(name, cache, policy, **options)
    return make_engine(name, cache, **options)


def build_engines(specs: list[str], cache: PagedCache, k: Constants, point: str,
                  split: int | None = None) -> dict[str, Engine]:
    return {spec: build_engine(spec, cache, k, point, split) for spec in specs}


def synthetic_trace(cfg: Config | dict, family: str, seed: int, **overrides) -> Trace:
    return synthetic(SyntheticSpec(family, seed, **{**Config.of(cfg).traces[family].given(), **overrides}))


def external_trace(cfg: Config | dict, path: str | Path, stage: str = "external") -> Trace:
    """The request file loaded with the config's step length, column mapping (if any) and
    recorded transform: the prompts scaled as the `stage` replay scales them
    (pkv.config.stages.EXTERNAL_REPLAYS)."""
    cfg = Config.of(cfg)
    c = cfg.external
    scale, _ = c.replay(stage)
    if scale is None:
        raise ValueError(f"config: the external trace has no {stage} replay (external.stress_scale)")
    layout = None
    if c.columns is not None:
        try:
            layout = columns(c.columns.prompt, c.columns.decode, c.columns.time, c.time_unit)
        except ValueError as e:
            raise ValueError(f"config: external.{e}") from None
    elif c.time_unit is not None:
        raise ValueError("config: external.time_unit is the unit of external.columns.time; give external.columns")
    return load_trace(path, step_ms=c.step_ms, layout=layout,
                      transform=Transform(scale, max_len=c.max_len, max_requests=c.max_requests))


def build_cache(cfg: Config | dict, trace: Trace, shape: Shape, holes: float, seed: int,
                fp8_policy: str = "tensor") -> PagedCache:
    assignment = assign_pages(trace.total_len, shape.page_size, holes, seed)
    return PagedCache.random(shape, assignment, device_of(Config.of(cfg)), seed, fp8_policy=fp8_policy)


def steps_of(trace: Trace, max_active: int, max_steps: int) -> list[StepState]:
    return list(decode_steps(trace, max_active, max_steps))


def layer_assignment(trace: Trace, shape: Shape, holes: float, seed: int, steps) -> PageAssignment:
    """The page table every layer of a model shares: the trace's, compacted to the pages the
    measured `steps` read (pkv.core.paging.compact)."""
    return compact(assign_pages(trace.total_len, shape.page_size, holes, seed), steps)


def layer_caches(shape: Shape, assignment: PageAssignment, device, seed: int, layers: int,
                 fp8_policy: str = "tensor") -> list[PagedCache]:
    """One KV tensor per layer over one page table, layer i from seed (seed << 8) + i.

    Memory: layers x pages x page_size x 2 (K, V) x H_kv x d x bytes. The paper's mlp_proxy
    (bimodal B8, 32 requests, 64 measured steps, fp16, H_kv 8, d 128, page 16) holds
    29k-34k pages (1.9-2.26 GB) per layer at full reservation, of which the measured steps
    read 14.5k-22.7k over the five held-out seeds: 32 layers take 30-48 GB, not 61-72 GB,
    within an H200's 141 GB with room. The stage records the bytes (metadata kv_memory)."""
    return [PagedCache.random(shape, assignment, device, (seed << 8) + i, fp8_policy=fp8_policy) for i in range(layers)]


def tolerance(cfg: Config | dict) -> Tolerance:
    t = Config.of(cfg).tolerance
    return Tolerance(t.max_abs, t.mean_abs)


def _meta(trace: Trace, **extra) -> dict:
    return {"trace_meta": json.dumps(trace.meta, sort_keys=True, default=str), "trace_sha256": trace.checksum(),
            **extra}


def _run(cfg: Config, job: Job, trace: Trace, shape: Shape, specs: list[str], k: Constants, point: str, *,
         split: int | None = None, holes: float | None = None, max_steps: int | None = None, repeats: int = 1,
         reference_every: int | None = None, tail=None, fp8_policy: str = "tensor",
         graph: bool | None = None, memory: dict | None = None) -> pd.DataFrame:
    """One job's rows. `job.layers` > 1: each layer its own KV cache over one page table
    (layer_caches), the engines built on layer 0's; `memory` (if given) gets the
    job's KV bytes under str(job.layers)."""
    m = cfg.measure
    holes = m.holes if holes is None else holes
    steps = steps_of(trace, job.max_active, max_steps or m.max_steps)
    if job.layers > 1:
        caches = layer_caches(shape, layer_assignment(trace, shape, holes, job.seed, steps), device_of(cfg),
                              job.seed, job.layers, fp8_policy)
    else:
        caches = [build_cache(cfg, trace, shape, holes, job.seed, fp8_policy)]
    cache = caches[0]
    if memory is not None:
        memory[str(job.layers)] = {"layers": len(caches), "pages": cache.assignment.num_pages,
                                   "kv_bytes": sum(c.kv.nbytes for c in caches)}
    engines = build_engines(specs, cache, k, point, split)
    tail_fn = tail(cache) if tail else None
    return measure(job, cache, steps, engines, cfg.baselines[0], tolerance(cfg),
                   reference_every or m.reference_every, m.graph if graph is None else graph, repeats, tail_fn,
                   caches)


def _with_baselines(cfg: Config, specs) -> list[str]:
    return list(dict.fromkeys([*cfg.baselines, *specs]))


def _shape(cfg: Config, num_kv_heads: int | None = None) -> Shape:
    return shape_of({"shape": cfg.to_dict()["shape"]}, num_kv_heads)


# ---------------------------------------------------------------- stages


def serve(cfg: Config | dict, k: Constants, family: str, max_active: int, seed: int, engine_set: str) -> Result:
    """Table 2: one held-out trace, every engine of the set."""
    cfg = Config.of(cfg)
    trace = synthetic_trace(cfg, family, seed)
    shape = _shape(cfg)
    job = Job("serve", trace.name, family, max_active, seed, shape.group)
    specs = _with_baselines(cfg, cfg.engine_sets[engine_set])
    return _run(cfg, job, trace, shape, specs, k, point_key(family, max_active)), _meta(trace, engine_set=engine_set)


def isolated(cfg: Config | dict, k: Constants, context: int) -> Result:
    """Table 1: one request of `context` tokens, 50% holes; PKV over the whole split grid."""
    cfg = Config.of(cfg)
    c = cfg.isolated
    seed = cfg.seeds.ablation
    # decode_len 1: the single step attends over exactly `context` tokens.
    trace = Trace(f"isolated-{context}", np.zeros(1, np.int64), np.array([context - 1]), np.ones(1, np.int64),
                  {"source": "isolated", "context": context})
    shape = _shape(cfg)
    frames = []
    split_engines = [s for s in c.engines if table.family(table.parse_spec(s)[0]) == "pkv"]
    fixed = [s for s in _with_baselines(cfg, c.engines) if s not in split_engines]
    job = Job("isolated", trace.name, "isolated", 1, seed, shape.group)
    frames.append(_run(cfg, job, trace, shape, fixed, k, "", holes=c.holes, repeats=c.repeats, reference_every=1))
    for split in cfg.calibration.split_grid:
        pkv = _with_baselines(cfg, split_engines)
        j = dataclasses.replace(job, split=split)
        f = _run(cfg, j, trace, shape, pkv, k, "", split=split, holes=c.holes, repeats=c.repeats, reference_every=1)
        frames.append(f[~f["engine"].isin(cfg.baselines)])
    return pd.concat(frames, ignore_index=True), _meta(trace)


def split_sensitivity(cfg: Config | dict, k: Constants, family: str, max_active: int) -> Result:
    """Table 7: the cost-model policy at the frozen split and its neighbours, ablation seed."""
    cfg = Config.of(cfg)
    seed, point = cfg.seeds.ablation, point_key(family, max_active)
    trace = synthetic_trace(cfg, family, seed)
    shape = _shape(cfg)
    kind = "bucket" if max_active == 1 else "workqueue"
    frozen = k.split(point, kind)
    frames = []
    for split in sorted({max(1, frozen + off) for off in cfg.ablations.split_sensitivity.offsets}):
        job = Job("split_sensitivity", trace.name, family, max_active, seed, shape.group, split)
        frames.append(_run(cfg, job, trace, shape, _with_baselines(cfg, [table.ROUTER]), k, point, split=split))
    return pd.concat(frames, ignore_index=True), _meta(trace, frozen_split=frozen)


def b4_sweep(cfg: Config | dict, k: Constants, seed: int) -> Result:
    """PersistentKV workqueue forced on B4 over a split grid (the boundary case)."""
    cfg = Config.of(cfg)
    c = cfg.ablations.b4_sweep
    trace = synthetic_trace(cfg, c.family, seed)
    shape = _shape(cfg)
    frames = []
    for split in c.splits:
        job = Job("b4_sweep", trace.name, c.family, c.max_active, seed, shape.group, split)
        frames.append(_run(cfg, job, trace, shape, _with_baselines(cfg, [table.WORKQUEUE]), k,
                           point_key(c.family, c.max_active), split=split))
    return pd.concat(frames, ignore_index=True), _meta(trace)


def gqa_sweep(cfg: Config | dict, k: Constants, group: int) -> Result:
    """Table 8: G = H_qo / H_kv on a smaller trace; the router gates uncalibrated G."""
    cfg = Config.of(cfg)
    c = cfg.ablations.gqa_sweep
    qo = cfg.shape.num_qo_heads
    if qo % group:
        raise ValueError(f"group {group} does not divide num_qo_heads {qo}")
    seed = cfg.seeds.ablation
    trace = synthetic_trace(cfg, c.family, seed, num_requests=c.num_requests)
    shape = _shape(cfg, num_kv_heads=qo // group)
    job = Job("gqa_sweep", trace.name, c.family, c.max_active, seed, group)
    frame = _run(cfg, job, trace, shape, _with_baselines(cfg, c.engines), k,
                 point_key(c.family, c.max_active), max_steps=c.max_steps)
    return frame, _meta(trace, group=group, num_kv_heads=shape.num_kv_heads)


def kv_fp8(cfg: Config | dict, k: Constants, seed: int) -> Result:
    """FP8 KV ablation: one held-out trace served from a 16-bit cache, then from the same
    values quantized to e4m3 (`policy` scales), by every engine of the ablation; rows say
    which in `kv_dtype`."""
    cfg = Config.of(cfg)
    c = cfg.ablations.kv_fp8
    specs = _with_baselines(cfg, c.engines)
    refused = [s for s in specs if table.parse_spec(s)[0] not in table.fp8_readers()]
    if refused:
        raise ValueError(f"ablations.kv_fp8.engines (with baselines): {refused} do not read an FP8 KV cache; "
                         f"those that do: {list(table.fp8_readers())}")
    trace = synthetic_trace(cfg, c.family, seed)
    frames = []
    for kv in ("auto", "fp8"):
        shape = dataclasses.replace(_shape(cfg), kv_dtype=kv)
        job = Job("kv_fp8", trace.name, c.family, c.max_active, seed, shape.group)
        frames.append(_run(cfg, job, trace, shape, specs, k, point_key(c.family, c.max_active),
                           max_steps=c.max_steps, fp8_policy=c.policy))
    return pd.concat(frames, ignore_index=True), _meta(trace, fp8_policy=c.policy)


def ablation(cfg: Config | dict, k: Constants, name: str, seed: int) -> Result:
    """Raggedness (bucket vs masked vs workqueue) or the implementation switches."""
    cfg = Config.of(cfg)
    c = {"raggedness": cfg.ablations.raggedness, "implementation": cfg.ablations.implementation}[name]
    trace = synthetic_trace(cfg, c.family, seed)
    shape = _shape(cfg)
    job = Job(name, trace.name, c.family, c.max_active, seed, shape.group)
    return (_run(cfg, job, trace, shape, _with_baselines(cfg, c.engines), k, point_key(c.family, c.max_active)),
            _meta(trace))


def gated_mlp(shape: Shape, width: int, seed: int):
    """A Llama-style gated MLP tail over the attention output (hidden = H_qo * d)."""

    def make(cache: PagedCache):
        hidden = shape.num_qo_heads * shape.head_dim
        gen = torch.Generator(device=cache.device).manual_seed(seed)
        w = [torch.randn(a, b, generator=gen, device=cache.device).div_(a ** 0.5).to(shape.torch_dtype)
             for a, b in ((hidden, width), (hidden, width), (width, hidden))]

        def tail(out: torch.Tensor) -> torch.Tensor:
            x = out.reshape(out.shape[0], hidden)
            return (torch.nn.functional.silu(x @ w[0]) * (x @ w[1])) @ w[2]

        return tail

    return make


def mlp_proxy(cfg: Config | dict, k: Constants, seed: int) -> Result:
    """Table 3: attention + gated MLP tail, the section's engines (default adaptive) and the
    baselines. `layers` > 1: each layer reads its own KV cache (same page table, its own
    values, sized to the pages the measured steps read: layer_caches); one prepare()
    a step serves every layer."""
    cfg = Config.of(cfg)
    c = cfg.mlp_proxy
    trace = synthetic_trace(cfg, c.family, seed)
    shape = _shape(cfg)
    specs = _with_baselines(cfg, c.engines)
    frames, memory = [], {}
    for layers in c.layers:
        job = Job("mlp_proxy", trace.name, c.family, c.max_active, seed, shape.group, layers=layers)
        frames.append(_run(cfg, job, trace, shape, specs, k, point_key(c.family, c.max_active),
                           tail=gated_mlp(shape, c.width, seed), memory=memory))
    return pd.concat(frames, ignore_index=True), _meta(trace, mlp_width=c.width, engines=json.dumps(specs),
                                                       kv_memory=json.dumps(memory, sort_keys=True))


def external(cfg: Config | dict, k: Constants, trace: Path) -> Result:
    """The request file `trace` (config external.path) through the file-based trace path,
    with its transform recorded: the headline replay."""
    return _external_replay(cfg, k, trace, "external")


def external_stress(cfg: Config | dict, k: Constants, trace: Path) -> Result:
    """The same request file with its prompts multiplied by external.stress_scale: a stress test."""
    return _external_replay(cfg, k, trace, "external_stress")


def _external_replay(cfg: Config | dict, k: Constants, trace: Path, stage: str) -> Result:
    cfg = Config.of(cfg)
    c = cfg.external
    trace = external_trace(cfg, trace, stage)
    shape = _shape(cfg)
    seed = cfg.seeds.ablation
    job = Job(stage, trace.name, "external", c.max_active, seed, shape.group)
    op = c.operating_point
    frame = _run(cfg, job, trace, shape, _with_baselines(cfg, c.engines), k, point_key(op.family, op.max_active))
    # The trace's identity travels with its file: the report titles the table from it.
    name, _ = c.identity()
    _, title = c.replay(stage)
    return frame, _meta(trace, step_ms=c.step_ms, trace_name=name, trace_title=title,
                        trace_format=trace.meta["schema"])


def nsight_trace(cfg: Config | dict, k: Constants) -> Result:
    """The short B8 trace profiled under ncu: same loop, no graph replay."""
    cfg = Config.of(cfg)
    c = cfg.nsight_capture
    seed = cfg.seeds.ablation
    trace = synthetic_trace(cfg, c.family, seed)
    shape = _shape(cfg)
    job = Job("nsight", trace.name, c.family, c.max_active, seed, shape.group)
    frame = _run(cfg, job, trace, shape, _with_baselines(cfg, c.engines), k,
                 point_key(c.family, c.max_active), max_steps=c.max_steps, graph=False)
    return frame, _meta(trace)
