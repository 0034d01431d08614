"""The one table of engine names. Every list of engines elsewhere derives from `ENGINES`.

`family` says which module builds the engine (and which lists it joins: the PersistentKV
kernel engines, the FlashInfer baselines, ...); `kind` is what that family needs to know
(the schedule of a pkv engine, the variant of a FlashInfer wrapper); `cpu` says whether
the engine runs on a CPU cache (the reference, the task-list engine standing in for the
scheduled pkv kernels, pkv-graph's oracle). Builders import their module late: the GPU engines need the
CUDA toolchain, FlashInfer and (for pkv-graph) a module another change adds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pkv.core.cache import PagedCache
from pkv.plan.schedule import SplitPolicy


@dataclass(frozen=True)
class EngineInfo:
    family: str        # reference | pkv | pkv-graph | flashinfer | sdpa | adaptive
    kind: str
    description: str
    cpu: bool = False  # also runs on a CPU cache
    fp8: bool = False  # reads an FP8 (e4m3) cache


ENGINES: dict[str, EngineInfo] = {
    "reference": EngineInfo("reference", "fp32", "Eq. 1 in FP32, one row at a time", cpu=True, fp8=True),
    "pkv-workqueue": EngineInfo("pkv", "workqueue", "compact workqueue of non-empty (row, kv head, split) tasks",
                                cpu=True),
    "pkv-masked": EngineInfo("pkv", "masked", "one coarse masked bucket sized by the longest row", cpu=True),
    "pkv-bucket": EngineInfo("pkv", "bucket", "exact length buckets: one grid launch per distinct length", cpu=True),
    "pkv-fused": EngineInfo("pkv", "workqueue", "workqueue with the atomic-counter fused merge (ablation)"),
    "pkv-graph": EngineInfo("pkv-graph", "graph", "single-launch decode, splits decided on the GPU, no host plan, "
                            "CUDA-graph capturable", cpu=True, fp8=True),
    "flashinfer": EngineInfo("flashinfer", "decode", "FlashInfer paged decode, CUDA cores", fp8=True),
    "flashinfer-tc": EngineInfo("flashinfer", "decode-tc", "FlashInfer paged decode, tensor cores", fp8=True),
    "flashinfer-persistent": EngineInfo("flashinfer", "persistent", "FlashInfer BatchAttention (persistent kernel)"),
    "sdpa-repack": EngineInfo("sdpa", "repack", "gather each row's pages, then torch SDPA"),
    "adaptive": EngineInfo("adaptive", "router", "the cost-model router over FlashInfer and the pkv routes", cpu=True),
}

PKV_OPTIONS = ("indexed_qo", "row_local", "early_exit", "cluster_merge", "validate")


def names(*families: str) -> tuple[str, ...]:
    """Engine names of `families`, in table order (every family when none is given)."""
    return tuple(n for n, e in ENGINES.items() if not families or e.family in families)


def family(name: str) -> str:
    return info(name).family


def info(name: str) -> EngineInfo:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {sorted(ENGINES)}")
    return ENGINES[name]


# The scheduled PersistentKV engines (name -> schedule kind) and those with a CPU task-list
# stand-in; the FlashInfer baselines; everything measured beside them.
PKV_ENGINES = {n: ENGINES[n].kind for n in names("pkv")}
PKV_KINDS = {n: k for n, k in PKV_ENGINES.items() if ENGINES[n].cpu}
FLASHINFER = names("flashinfer")
FP8_READERS = tuple(n for n, e in ENGINES.items() if e.fp8)   # the engines that read an FP8 cache


def build(name: str, cache: PagedCache, policy: SplitPolicy | None = None, **options):
    """Build engine `name` over `cache` (see pkv.engines.make_engine)."""
    e = info(name)
    cuda = cache.kv.is_cuda
    if cache.shape.fp8 and not e.fp8:
        raise ValueError(f"engine {name!r} does not read an FP8 KV cache; those that do: {list(FP8_READERS)}")
    if e.family == "reference":
        from pkv.engines.cpu import ReferenceEngine

        return ReferenceEngine(cache, **options)
    if e.family == "adaptive":
        from pkv.engines.adaptive import AdaptiveEngine

        return AdaptiveEngine(cache, **options)
    if not cuda and not e.cpu:
        raise ValueError(f"engine {name!r} needs a CUDA device; on the CPU use one of "
                         f"{sorted(n for n, i in ENGINES.items() if i.cpu and i.family != 'adaptive')}")
    if e.family == "pkv":
        if not cuda:
            from pkv.engines.cpu import TaskListEngine

            return TaskListEngine(cache, e.kind, policy or SplitPolicy(8), **options)
        unknown = set(options) - set(PKV_OPTIONS)
        if unknown:
            raise ValueError(f"unknown options for {name}: {sorted(unknown)}")
        from pkv.engines.persistent import PkvEngine

        return PkvEngine(cache, name, policy, **options)
    if e.family == "pkv-graph":
        if policy is not None:
            raise ValueError("pkv-graph decides its splits on the GPU; it takes no SplitPolicy")
        from pkv.engines.graph import GraphEngine  # the v4 kernel, or its CPU oracle; no SplitPolicy

        return GraphEngine(cache, **options)
    unknown = set(options) - {"validate"}
    if unknown:
        raise ValueError(f"engine {name!r} takes no options, got {sorted(unknown)}")
    if e.family == "flashinfer":
        from pkv.engines.flashinfer import FlashInferEngine

        return FlashInferEngine(cache, name, **options)
    if e.family == "sdpa":
        from pkv.engines.sdpa import SdpaRepackEngine

        return SdpaRepackEngine(cache, **options)
    raise AssertionError(f"no builder for family {e.family!r}")
