"""JIT build of csrc/ (torch.utils.cpp_extension + ninja), once per process.

The sources are found inside the installed package (pkv/_csrc: copied into a wheel, a
link to csrc/ in the checkout) or at the checkout's csrc/ (`csrc_dir`). The build
directory is ~/.cache/pkv/<hash>, keyed by the sources, the GPU's compute capability and
the torch and CUDA versions, so an edit, another GPU or another torch rebuilds and an
unchanged tree loads in seconds; a build says so on stderr, with its duration.
The ops land in torch.ops.pkv (decode, merge, graph_decode, graph_decode_paged, read_probe).
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import time
from functools import cache
from pathlib import Path

import torch

_PACKAGE = Path(__file__).resolve().parents[1]
SOURCES = ("binding.cpp", "pkv_decode.cu", "graph_decode.cu", "roofline.cu")
HEADERS = ("pkv_decode.h", "graph_decode.h", "roofline.h", "ptx.cuh", "state.cuh", "attend.cuh", "attend_fp8.cuh",
           "graph_trace.cuh", "graph_cut.cuh", "graph_merge.cuh", "graph_decode_kernel.cuh")


def csrc_dir() -> Path:
    """The kernel sources: the installed package's pkv/_csrc, else the checkout's csrc/."""
    for d in (_PACKAGE / "_csrc", _PACKAGE.parent / "csrc"):
        if all((d / name).is_file() for name in SOURCES + HEADERS):
            return d
    raise FileNotFoundError(f"the CUDA sources ({', '.join(SOURCES)}) are in neither {_PACKAGE / '_csrc'} nor "
                            f"{_PACKAGE.parent / 'csrc'}: reinstall pkv (its wheel ships them as pkv/_csrc)")


def arch_flags(major: int, minor: int) -> list[str]:
    """nvcc target for the GPU present; Hopper gets the arch-specific sm_90a."""
    suffix = "a" if (major, minor) == (9, 0) else ""
    cc = f"{major}{minor}{suffix}"
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}"]


def extra_flags() -> list[str]:
    """PKV_NVCC_FLAGS (e.g. "-DPKV_FP8_STAGES=6"): build-time knobs for experiments, part of the build key."""
    return shlex.split(os.environ.get("PKV_NVCC_FLAGS", ""))


def toolkit_version() -> str:
    """The version of the CUDA toolkit nvcc builds with (CUDA_HOME's version.json; "" if none is
    found): another nvcc under the same torch makes other code, so it is part of the key."""
    from torch.utils.cpp_extension import CUDA_HOME

    try:
        return json.loads((Path(CUDA_HOME) / "version.json").read_text())["cuda"]["version"]
    except (TypeError, OSError, ValueError, KeyError):
        return ""


def source_hash(capability: tuple[int, int]) -> str:
    """The build key: sources, GPU, build knobs, the torch version and its CUDA (the extension's
    ABI), and the toolkit nvcc comes from."""
    h = hashlib.sha256(repr((capability, extra_flags(), torch.__version__, torch.version.cuda,
                             toolkit_version())).encode())
    csrc = csrc_dir()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((csrc / name).read_bytes())
    return h.hexdigest()[:16]


@cache
def ops():
    """Build (or load the cached build of) the extension; returns torch.ops.pkv."""
    if not torch.cuda.is_available():
        raise ValueError("the PersistentKV kernels need a CUDA device")
    from torch.utils.cpp_extension import load

    capability = torch.cuda.get_device_capability()
    key = source_hash(capability)
    csrc = csrc_dir()
    build = Path.home() / ".cache" / "pkv" / key
    build.mkdir(parents=True, exist_ok=True)
    name = f"pkv_ext_{key}"
    so = build / f"{name}.so"
    if so.is_file():
        # The key covers everything the build depends on, so an existing library is this
        # tree's: load it without cpp_extension's ninja up-to-date check (every process of
        # a pipeline pays that otherwise). One that does not load (a build killed while
        # linking) is rebuilt below.
        try:
            torch.ops.load_library(str(so))
            return torch.ops.pkv
        except (OSError, RuntimeError) as e:
            print(f"pkv: {so} does not load ({e}); rebuilding", file=sys.stderr, flush=True)
            so.unlink(missing_ok=True)   # else ninja would call it up to date
    fresh = not so.is_file()
    if fresh:   # a silent minute looks like a hang
        print(f"pkv: building the CUDA kernels for sm_{capability[0]}{capability[1]} in {build} "
              f"(first use of this tree, torch and GPU; about 1-2 minutes)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    load(
        name=name,
        sources=[str(csrc / s) for s in SOURCES],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo", *arch_flags(*capability), *extra_flags()],
        extra_include_paths=[str(csrc)],
        build_directory=str(build),
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        print(f"pkv: built the CUDA kernels in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return torch.ops.pkv
