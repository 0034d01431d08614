"""JIT build of csrc/ (torch.utils.cpp_extension + ninja), once per process.

The build directory is ~/.cache/pkv/<hash>, keyed by the sources and the GPU's compute
capability, so an edit or another GPU rebuilds and an unchanged tree loads in seconds.
The ops land in torch.ops.pkv (decode, merge, graph_decode, read_probe).
"""

from __future__ import annotations

import hashlib
import os
import shlex
from functools import cache
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("binding.cpp", "pkv_decode.cu", "graph_decode.cu", "roofline.cu")
HEADERS = ("pkv_decode.h", "graph_decode.h", "roofline.h", "ptx.cuh", "state.cuh", "attend.cuh", "attend_fp8.cuh")


def arch_flags(major: int, minor: int) -> list[str]:
    """nvcc target for the GPU present; Hopper gets the arch-specific sm_90a."""
    suffix = "a" if (major, minor) == (9, 0) else ""
    cc = f"{major}{minor}{suffix}"
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def extra_flags() -> list[str]:
    """PKV_NVCC_FLAGS (e.g. "-DPKV_FP8_STAGES=6"): build-time knobs for experiments, part of the build key."""
    return shlex.split(os.environ.get("PKV_NVCC_FLAGS", ""))


def source_hash(capability: tuple[int, int]) -> str:
    h = hashlib.sha256(repr((capability, extra_flags())).encode())
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    return h.hexdigest()[:16]


@cache
def ops():
    """Build (or load the cached build of) the extension; returns torch.ops.pkv."""
    if not torch.cuda.is_available():
        raise ValueError("the PersistentKV kernels need a CUDA device")
    from torch.utils.cpp_extension import load

    capability = torch.cuda.get_device_capability()
    key = source_hash(capability)
    build = Path.home() / ".cache" / "pkv" / key
    build.mkdir(parents=True, exist_ok=True)
    load(
        name=f"pkv_ext_{key}",
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo", *arch_flags(*capability), *extra_flags()],
        extra_include_paths=[str(CSRC)],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.pkv
