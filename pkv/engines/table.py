"""The one table of engines, and beside it the one table of model-step runners. Every list
of engines elsewhere (the config schema's names, the CLI's choices, the benchmarks'
defaults, the reports' name lists) derives from `ENGINES` when it is used, so a new engine
is one row here plus its module; likewise a new model-step runner is one row of `RUNNERS`
(the schema's model_step.engines, the runner set, the model-step report's order and labels).

Torch-free: the report, the Snakefile's parse step and the schema check read this table
without importing torch. `module` names the module whose `build(name, info, cache,
policy, **options)` makes the engine; it is imported only when an engine is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineInfo:
    family: str        # reference | pkv | pkv-graph | flashinfer | sdpa | adaptive
    kind: str          # what the family's builder needs: a schedule kind, a FlashInfer variant, ...
    description: str
    module: str        # the module whose build() makes it
    cpu: bool = False  # also runs on a CPU cache
    fp8: bool = False  # reads an FP8 (e4m3) cache
    baseline: bool = False     # a FlashInfer decode variant every ratio takes the faster of
    route: bool = False        # a PersistentKV route of the adaptive router (costed by pkv.plan.costmodel;
                               # family "pkv" routes are host-scheduled with a frozen split, pkv-graph is not)
    ablation: bool = False     # measured only in an ablation, not among the engines a user would deploy
    options: tuple[str, ...] = ()   # the option keys its spec may set (name:key=value,...)
    split_route: str = ""      # family "pkv": the route ("workqueue" or "bucket") whose frozen split it runs at
    merge: str = ""            # split schedules: "segmented" (a second kernel merges the splits) or "fused"
                               # (the last split's CTA merges, counted by an atomic)
    buckets: str = ""          # bucket schedules: "exact" (one launch per distinct length) or "masked" (one
                               # coarse bucket sized by the longest row, masked per row)
    tensor_cores: bool = False  # its decode runs on tensor cores
    plan_free: bool = False    # no host plan: the split is decided on the GPU, one CUDA-graph capturable launch
    paper_route: str = ""      # the route kind the paper's claims call its routes ("" where the paper names none)
    feature_note: str = ""     # why it takes fewer of FEATURES than its kernel's API accepts: the refusal says it


FEATURES = ("window_left", "q_len", "sinks")   # the query options (pkv.engines.common.check_queries)
PKV_OPTIONS = ("indexed_qo", "row_local", "early_exit", "cluster_merge", "validate", "num_sms", "splits")
# FlashInfer's planned decode: plan() takes window_left and q_len (q_len_per_req). Its wrappers'
# run() also accepts sinks=, but in FlashInfer 0.7.2 on SM 9.0 (backends fa2/fa3: the CUDA-core
# decode and the tensor-core path) the result is attention without the sinks, with no error: the
# CUDA-core kernel is never given them, and the tensor-core path's prefill module is built with
# no sink option. So these rows take no sinks option, and the registry's refusal gives this reason
# (flashinfer-xqa and pkv-graph apply sinks).
PLANNED_OPTIONS = ("validate", "window_left", "q_len")
PLANNED_DROPS_SINKS = "FlashInfer's planned decode drops attention sinks on this path (fa2/fa3 on SM 9.0)"
GRAPH_OPTIONS = ("max_rows", "ctas_per_sm", "min_tiles", "num_sms", "piece_cost", "counter_stride", "spin_ns", "pdl",
                 "short_tiles", *FEATURES)

ENGINES: dict[str, EngineInfo] = {
    "reference": EngineInfo("reference", "fp32", "Eq. 1 in FP32, one row at a time", "pkv.engines.cpu", cpu=True,
                            fp8=True, paper_route="FlashInfer"),
    "pkv-workqueue": EngineInfo("pkv", "workqueue", "compact workqueue of non-empty (row, kv head, split) tasks",
                                "pkv.engines.persistent", cpu=True, route=True, options=PKV_OPTIONS,
                                split_route="workqueue", merge="segmented", paper_route="PersistentKV workqueue"),
    "pkv-masked": EngineInfo("pkv", "masked", "one coarse masked bucket sized by the longest row",
                             "pkv.engines.persistent", cpu=True, ablation=True, options=PKV_OPTIONS,
                             split_route="bucket", merge="segmented", buckets="masked"),
    "pkv-bucket": EngineInfo("pkv", "bucket", "exact length buckets: one grid launch per distinct length",
                             "pkv.engines.persistent", cpu=True, route=True, options=PKV_OPTIONS,
                             split_route="bucket", merge="segmented", buckets="exact",
                             paper_route="PersistentKV bucket"),
    "pkv-fused": EngineInfo("pkv", "workqueue", "workqueue with the atomic-counter fused merge (ablation)",
                            "pkv.engines.persistent", ablation=True, options=PKV_OPTIONS, split_route="workqueue",
                            merge="fused"),
    "pkv-graph": EngineInfo("pkv-graph", "graph", "single-launch decode, splits decided on the GPU, no host plan, "
                            "CUDA-graph capturable", "pkv.engines.graph", cpu=True, fp8=True, route=True,
                            options=GRAPH_OPTIONS, plan_free=True, paper_route="PersistentKV graph"),
    "flashinfer": EngineInfo("flashinfer", "decode", "FlashInfer paged decode, CUDA cores", "pkv.engines.flashinfer",
                             fp8=True, baseline=True, options=PLANNED_OPTIONS, paper_route="FlashInfer",
                             feature_note=PLANNED_DROPS_SINKS),
    "flashinfer-tc": EngineInfo("flashinfer", "decode-tc", "FlashInfer paged decode, tensor cores",
                                "pkv.engines.flashinfer", fp8=True, baseline=True, options=PLANNED_OPTIONS,
                                tensor_cores=True, paper_route="FlashInfer", feature_note=PLANNED_DROPS_SINKS),
    "flashinfer-persistent": EngineInfo("flashinfer", "persistent", "FlashInfer BatchAttention (persistent kernel)",
                                        "pkv.engines.flashinfer", options=("validate",), paper_route="FlashInfer"),
    "flashinfer-xqa": EngineInfo("flashinfer", "xqa", "FlashInfer's plan-free decode (TensorRT-LLM's XQA kernel), "
                                 "CUDA-graph capturable", "pkv.engines.xqa", fp8=True, baseline=True, plan_free=True,
                                 options=("max_rows", "hopper_fp8", "validate", *FEATURES),
                                 paper_route="FlashInfer"),
    "sdpa-repack": EngineInfo("sdpa", "repack", "gather each row's pages, then torch SDPA", "pkv.engines.sdpa",
                              ablation=True, options=("validate",)),
    "adaptive": EngineInfo("adaptive", "router", "the cost-model router over FlashInfer and the pkv routes",
                           "pkv.engines.adaptive", cpu=True, options=("objective",)),
}

# The rows a stage, a benchmark or a report names by role; everywhere else reads these, not a name.
ROUTER = "adaptive"            # the adaptive router: the serving stages' engine, every router label's default
REFERENCE = "reference"        # the FP32 reference: the correctness baseline, FlashInfer's stand-in on a CPU
WORKQUEUE = "pkv-workqueue"    # the host-scheduled workqueue: the B4 sweep's engine, the ablations' yardstick
PKV_KERNEL = "pkv-graph"       # PersistentKV's own kernel (single launch, split on the GPU): the kernel, FP8 and
                               # warm-up benchmarks' PersistentKV engine


def the(**fields) -> str:
    """The one engine whose row has these field values (the(buckets="masked") ->
    the coarse masked bucket); an error unless exactly one row matches."""
    found = [n for n, e in ENGINES.items() if all(getattr(e, k) == v for k, v in fields.items())]
    if len(found) != 1:
        raise ValueError(f"{len(found)} engines have {fields}, not one: {found}")
    return found[0]


def info(name: str) -> EngineInfo:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {sorted(ENGINES)}")
    return ENGINES[name]


def family(name: str) -> str:
    return info(name).family


def names(*families: str) -> tuple[str, ...]:
    """Engine names of `families`, in table order (every family when none is given)."""
    return tuple(n for n, e in ENGINES.items() if not families or e.family in families)


def pkv_engines() -> dict[str, str]:
    """The host-scheduled PersistentKV engines: name -> schedule kind."""
    return {n: ENGINES[n].kind for n in names("pkv")}


def pkv_kinds() -> dict[str, str]:
    """The scheduled PersistentKV engines with a CPU task-list stand-in: name -> schedule kind."""
    return {n: k for n, k in pkv_engines().items() if ENGINES[n].cpu}


def flashinfer() -> tuple[str, ...]:
    """Every FlashInfer variant we wrap."""
    return names("flashinfer")


def planned() -> tuple[str, ...]:
    """The FlashInfer variants that run a host plan() each step (the plan-free ones have none)."""
    return tuple(n for n in flashinfer() if not ENGINES[n].plan_free)


def baselines() -> tuple[str, ...]:
    """The FlashInfer variants a ratio takes the faster of."""
    return tuple(n for n, e in ENGINES.items() if e.baseline)


def pkv_routes() -> dict[str, str]:
    """The router's PersistentKV routes: name -> kind (the cost model's route key). The
    family "pkv" ones (pkv_engines()) are host-scheduled with a frozen split per operating
    point; pkv-graph ("graph") decides its split on the GPU and is costed by its own fit."""
    return {n: e.kind for n, e in ENGINES.items() if e.route}


def route_key(name: str) -> str:
    """The key the cost model's constants file an engine's times under: a router route's kind
    (pkv_routes: "workqueue", "bucket", "graph"), any other engine's name (the baselines)."""
    e = ENGINES.get(name)
    return e.kind if e is not None and e.route else name


def fp8_readers() -> tuple[str, ...]:
    return tuple(n for n, e in ENGINES.items() if e.fp8)


def deployable() -> tuple[str, ...]:
    """Every engine a serving engineer could choose (not the reference, not ablation-only)."""
    return tuple(n for n, e in ENGINES.items() if e.family != "reference" and not e.ablation)


def cpu_engines() -> tuple[str, ...]:
    return tuple(n for n, e in ENGINES.items() if e.cpu)


def fp8_kernels() -> tuple[str, ...]:
    """The FP8 readers with a CUDA kernel (the FP8 kernel benchmark's engines): all but the reference."""
    return tuple(n for n in fp8_readers() if ENGINES[n].family != "reference")


def feature_kernels() -> tuple[str, ...]:
    """The engines that take any of FEATURES (the kernel sweep's features suite): pkv-graph and the
    FlashInfer paths the sweep measures it against. A row without one of a case's features refuses
    it in one line (pkv.engines.registry), and the sweep records that row's error, not a time."""
    return tuple(n for n, e in ENGINES.items() if set(FEATURES) & set(e.options))


def feature_takers(feature: str) -> tuple[str, ...]:
    """The engines whose options hold `feature` (one of FEATURES), in table order."""
    return tuple(n for n, e in ENGINES.items() if feature in e.options)


def persistentkv(spec: str) -> bool:
    """Whether an engine label ("pkv-workqueue", "pkv-masked:row_local=false") is one of this
    project's kernels (family pkv or pkv-graph); a label of no engine (vllm) is not."""
    e = ENGINES.get(spec.partition(":")[0])
    return e is not None and e.family in ("pkv", "pkv-graph")


def is_router(spec: str) -> bool:
    """Whether an engine label ("adaptive", "adaptive:objective=overlapped") is the router's
    family; a label of no engine (a model-step runner, an old name) is not."""
    e = ENGINES.get(spec.partition(":")[0])
    return e is not None and e.family == "adaptive"


# ---------------------------------------------------------------- the model-step runners
# A runner is one practice of running decode attention inside N decoder layers (pkv measure
# model-step, pkv.engines.model). Its names are not engine specs: FlashInfer's two
# practices are runners of no engine row. Table order is the report's row and colour order.


@dataclass(frozen=True)
class RunnerInfo:
    label: str                # the model-step figure's legend
    runner: str               # "module:Class"; Class.build(model, caches, xs, buckets, constants, point) makes it
    gpu: bool = False         # in the paper profile's set (a CUDA device)
    cpu: bool = False         # in the smoke profile's set (a CPU cache)
    fp8: bool = False         # reads an FP8 cache (the FP8 pass runs only these, and names the others)
    ratio_base: bool = False  # the report's ratios are over the first present of these
    check_base: bool = False  # the correctness baseline: the first present of these (check_base())
    routed: bool = False      # the router: built per bucket, from the frozen constants at its operating point
    package: str = ""         # a package it needs beyond torch, checked before any runner is built


RUNNERS: dict[str, RunnerInfo] = {
    "pkv-graph": RunnerInfo("pkv-graph (no host plan)", "pkv.measure.model_runners:PkvGraphRunner", gpu=True,
                            cpu=True, fp8=True),
    "flashinfer-graph": RunnerInfo("FlashInfer graph path (plan() + replay)",
                                   "pkv.engines.model_flashinfer:FlashInferGraphRunner", gpu=True, fp8=True,
                                   ratio_base=True, package="flashinfer"),
    "flashinfer-eager": RunnerInfo("FlashInfer eager", "pkv.engines.model_flashinfer:FlashInferEagerRunner",
                                   gpu=True, fp8=True, check_base=True, package="flashinfer"),
    # not fp8: its host-planned routes read 16-bit KV only
    "adaptive": RunnerInfo("adaptive route", "pkv.measure.model_runners:AdaptiveRunner", gpu=True, routed=True),
    "reference": RunnerInfo("FP32 reference (CPU)", "pkv.engines.model:ReferenceRunner", cpu=True, fp8=True,
                            ratio_base=True, check_base=True),
    # last, so the runners before it keep their colours and markers in the model-step figure
    "flashinfer-xqa-graph": RunnerInfo("FlashInfer XQA graph path (no plan, replay)",
                                       "pkv.engines.model_flashinfer:XqaGraphRunner", gpu=True, fp8=True,
                                       ratio_base=True, check_base=True, package="flashinfer"),
}


def runners(flag: str = "") -> tuple[str, ...]:
    """Model-step runner names in table order: those whose field `flag` is set ("gpu",
    "cpu", "fp8", "ratio_base", ...), or every one."""
    return tuple(n for n, r in RUNNERS.items() if not flag or getattr(r, flag))


# The correctness baseline of a pass, in table order: FlashInfer eager (FlashInfer's own planned
# decode, run eagerly), then the FP32 reference (exact to FP32; on a GPU a loop over rows in
# torch, so a config names it where it must), then the XQA graph path. XQA is the baseline only
# where neither ran, as in a sink model's step, which eager refuses because the planned decode
# drops sinks (PLANNED_DROPS_SINKS). XQA is fit for it there: it applies every feature a step
# asks for (windows, sinks, q_len), it is an implementation of its own (TensorRT-LLM's, not
# pkv-graph's), and its 16-bit roundings (the softmax weights and their row sum in 16 bits, the
# output rounded on its way out: pkv.engines.xqa) are a 16-bit kernel's, inside the step's
# tolerance on the unit-range caches the step draws (tests/gpu/test_features_gpu.py checks its
# sinks, windows and q_len against the FP32 reference). Where none of the three ran, the pass is
# unchecked: its rows carry no rel_err and the report says "unchecked".


def check_base(present) -> str | None:
    """The correctness baseline of a model-step pass: the first check_base runner among `present`
    (the runners that ran it), or None: the pass is unchecked."""
    return next((n for n in runners("check_base") if n in present), None)


# One engine-spec syntax everywhere (config lists, --engines, Parquet labels):
# "name" or "name:key=value,key=value", a value true, false, an integer, or for an enum
# option (ENUM_OPTIONS) one of its words.
ENUM_OPTIONS = {"objective": ("serial", "overlapped")}   # adaptive: what the router minimizes per step
_WORDS = tuple(sorted({w for words in ENUM_OPTIONS.values() for w in words}))
_NUMBER = r"(true|false|-?[0-9]+)"
_VALUE = rf"(true|false|-?[0-9]+|{'|'.join(_WORDS)})"


def spec_pattern() -> str:
    """The regular expression of a valid spec (the config schema's engine pattern)."""
    alternatives = "|".join(re.escape(n) for n in sorted(ENGINES, key=len, reverse=True))
    return rf"^({alternatives})(:[a-z_]+={_VALUE}(,[a-z_]+={_VALUE})*)?$"


def parse_spec(spec: str) -> tuple[str, dict]:
    """"pkv-masked:row_local=false,early_exit=false" -> ("pkv-masked", {"row_local": False, ...});
    "adaptive:objective=overlapped" -> ("adaptive", {"objective": "overlapped"})."""
    name, _, opts = spec.partition(":")
    e = info(name)
    options: dict = {}
    for item in filter(None, opts.split(",")):
        key, sep, value = item.partition("=")
        if key not in e.options:
            raise ValueError(f"engine {name!r} takes no option {key!r}; its options: {list(e.options) or 'none'}")
        if key in ENUM_OPTIONS:
            if value not in ENUM_OPTIONS[key]:
                raise ValueError(f"engine option {item!r} in {spec!r}: {key} is one of {', '.join(ENUM_OPTIONS[key])}")
            options[key] = value
            continue
        if not sep or not re.fullmatch(_NUMBER, value):
            raise ValueError(f"engine option {item!r} in {spec!r} must be key=true, key=false or key=<integer>")
        options[key] = {"true": True, "false": False}.get(value, None)
        if options[key] is None:
            options[key] = int(value)
    return name, options
