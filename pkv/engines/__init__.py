"""Engines behind one interface. `make_engine(name, cache, ...)` builds any engine of the
table in pkv.engines.registry, for the cache's device."""

from __future__ import annotations

from pkv.core.cache import PagedCache
from pkv.engines.base import Engine, Plan
from pkv.engines.registry import ENGINES, PKV_KINDS, build
from pkv.plan.schedule import SplitPolicy


def make_engine(name: str, cache: PagedCache, policy: SplitPolicy | None = None, **options) -> Engine:
    """Build engine `name` over `cache`.

    "adaptive" takes `constants` (pkv.plan.costmodel.Constants) and `point` (operating point key).
    On a CPU cache the pkv-* engines are the task-list engine (the CUDA kernels' oracle)
    and pkv-graph its CPU oracle; on a CUDA cache they launch the kernels of pkv.kernels.loader.
    """
    return build(name, cache, policy, **options)


__all__ = ["ENGINES", "Engine", "Plan", "make_engine", "PKV_KINDS"]
