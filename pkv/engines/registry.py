"""Building an engine from its row of the engine table (pkv.engines.table).

The checks every engine shares live here (an FP8 cache needs an FP8 reader, a CPU cache
an engine with a CPU implementation, spec options the row allows); the row's module
builds the engine itself (`build(name, info, cache, policy, **options)`), imported only
now: the GPU engines need the CUDA toolchain and FlashInfer.
"""

from __future__ import annotations

import importlib

from pkv.engines.table import FEATURES, cpu_engines, feature_takers, fp8_readers, info, is_router


def build(name: str, cache, policy=None, **options):
    """Build engine `name` over `cache` (see pkv.engines.make_engine)."""
    e = info(name)
    if cache.shape.fp8 and not e.fp8:
        raise ValueError(f"engine {name!r} does not read an FP8 KV cache; those that do: {list(fp8_readers())}")
    features = [f for f in FEATURES if f in options and f not in e.options]
    if features:
        why = f"{e.feature_note}; " if e.feature_note else ""
        raise ValueError(f"engine {name!r} takes no option(s) {features}: {why}" + "; ".join(
            f"the engines that take {f}: {list(feature_takers(f))}" for f in features))
    if not cache.kv.is_cuda and not e.cpu:
        raise ValueError(f"engine {name!r} needs a CUDA device; on the CPU use one of "
                         f"{sorted(n for n in cpu_engines() if not is_router(n))}")
    engine = importlib.import_module(e.module).build(name, e, cache, policy, **options)
    engine.name = name          # an engine is named by its row, the one place a name is defined
    return engine


def no_policy(name: str, policy) -> None:
    """For the engines that take no SplitPolicy (the kernels, or the router, decide the split)."""
    if policy is not None:
        raise ValueError(f"engine {name!r} decides its own splits; it takes no SplitPolicy")


def check_options(name: str, options: dict, allowed) -> None:
    unknown = set(options) - set(allowed)
    if unknown:
        raise ValueError(f"engine {name!r} takes no option(s) {sorted(unknown)}; "
                         f"its options: {sorted(allowed) or 'none'}")
