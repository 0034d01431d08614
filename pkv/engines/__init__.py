"""Engines behind one interface: `prepare(step) -> plan`, `run(q, plan) -> out`.

`make_engine(name, cache, ...)` builds any engine of the table in pkv.engines.table, for
the cache's device. Importing this package loads no torch: the table is torch-free, and
the engine modules load when an engine is built.
"""

from __future__ import annotations

from pkv.engines.table import ENGINES


def make_engine(name: str, cache, policy=None, **options):
    """Build engine `name` over `cache` (a pkv.core.cache.PagedCache).

    "adaptive" takes `constants` (pkv.plan.costmodel.Constants) and `point` (operating point key).
    On a CPU cache the pkv-* engines are the task-list engine (the CUDA kernels' oracle)
    and pkv-graph its CPU oracle; on a CUDA cache they launch the kernels of pkv.kernels.loader.
    """
    from pkv.engines.registry import build

    return build(name, cache, policy, **options)


def __getattr__(name: str):
    if name in ("Engine", "Plan"):
        from pkv.engines import base

        return getattr(base, name)
    raise AttributeError(f"module 'pkv.engines' has no attribute {name!r}")


__all__ = ["ENGINES", "Engine", "Plan", "make_engine"]
