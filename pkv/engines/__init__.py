"""Engine registry. `make_engine(name, cache, ...)` picks the implementation for the cache's device."""

from __future__ import annotations

from pkv.cache import PagedCache
from pkv.engines.base import Engine, Plan
from pkv.engines.cpu import ReferenceEngine, TaskListEngine
from pkv.schedule import SplitPolicy

PKV_KINDS = {"pkv-bucket": "bucket", "pkv-masked": "masked", "pkv-workqueue": "workqueue"}


def make_engine(name: str, cache: PagedCache, policy: SplitPolicy | None = None, **options) -> Engine:
    """Build engine `name` over `cache`.

    "adaptive" takes `constants` (pkv.costmodel.Constants) and `point` (operating point key).
    On a CPU cache the pkv-* engines are the task-list engine (the CUDA kernels' oracle);
    on a CUDA cache they launch the kernels of pkv.kernels.
    """
    if name == "reference":
        return ReferenceEngine(cache)
    if name == "pkv-graph":
        from pkv.engines.graph import GraphEngine  # CPU oracle or the v4 kernel, by the cache's device

        return GraphEngine(cache, **options)
    if name == "adaptive":
        from pkv.engines.adaptive import AdaptiveEngine  # imports this registry for its candidates

        return AdaptiveEngine(cache, **options)
    if name in PKV_KINDS and not cache.kv.is_cuda:
        return TaskListEngine(cache, PKV_KINDS[name], policy or SplitPolicy(8), **options)
    if cache.kv.is_cuda:
        from pkv.engines.gpu import make_gpu_engine  # needs the CUDA toolchain; import late

        return make_gpu_engine(name, cache, policy=policy, **options)
    raise ValueError(f"engine {name!r} needs a CUDA device; on the CPU use 'reference' or one of {sorted(PKV_KINDS)}")


__all__ = ["Engine", "Plan", "make_engine", "PKV_KINDS"]
