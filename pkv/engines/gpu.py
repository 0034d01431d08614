"""The GPU engines' factory. Each family has its own module: pkv.engines.persistent (the
PersistentKV kernels), pkv.engines.flashinfer, pkv.engines.sdpa; their names are in
pkv.engines.registry. Kept so that `make_gpu_engine` and older imports keep working."""

from __future__ import annotations

from pkv.cache import PagedCache
from pkv.engines.base import Engine
from pkv.engines.common import num_sms, to_device_int32
from pkv.engines.registry import build
from pkv.schedule import SplitPolicy

__all__ = ["make_gpu_engine", "num_sms", "to_device_int32"]


def make_gpu_engine(name: str, cache: PagedCache, policy: SplitPolicy | None = None, **options) -> Engine:
    if not cache.kv.is_cuda:
        raise ValueError(f"engine {name!r} needs the KV cache on a CUDA device")
    return build(name, cache, policy, **options)
