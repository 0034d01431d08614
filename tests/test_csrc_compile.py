"""Every kernel source under csrc/ compiles for sm_90a with plain nvcc (no GPU, no torch), without
spills; the JIT build (pkv.kernels.loader) and the wheel cover every file there (csrc/'s comments
carrying no history: tests/test_no_history.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest
import tomllib

from pkv.engines.graph import FP8_HEAD_DIMS, HEAD_DIMS
from pkv.kernels.loader import HEADERS, SOURCES

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
KERNELS = sorted(CSRC.glob("*.cu"))
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
NVCC = shutil.which("nvcc")

def test_kernel_sources_exist_and_are_torch_free():
    assert KERNELS, "no .cu files under csrc/"
    for path in KERNELS + sorted(CSRC.glob("*.h")) + sorted(CSRC.glob("*.cuh")):
        text = path.read_text()
        assert "torch/" not in text and "ATen/" not in text and "c10/" not in text, path.name


def test_the_build_and_the_wheel_cover_every_kernel_file():
    """The loader's build key hashes SOURCES + HEADERS, so a file missing there would not
    rebuild on an edit; the wheel ships csrc/ through pyproject's package-data globs."""
    files = {p.name for p in CSRC.iterdir() if p.suffix in SUFFIXES}
    assert set(SOURCES) | set(HEADERS) == files
    assert {p.name for p in KERNELS} <= set(SOURCES)
    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["pkv"]
    for name in files:
        assert any(fnmatch(f"_csrc/{name}", g) for g in globs), name


def ptxas(source: Path, out: Path, *flags: str) -> str:
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", *flags,
           f"-I{CSRC}", str(source), "-o", str(out / (source.stem + ".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stderr


def graph_decode_instantiations() -> int:
    """graph_decode.cu's launchers: two query dtypes; rows per CTA 1 and 2 (G > 8) up to
    head_dim 128, 1 at 256; a 16-bit and, at FP8_HEAD_DIMS, an FP8 cache."""
    return 2 * sum((2 if d <= 128 else 1) * (2 if d in FP8_HEAD_DIMS else 1) for d in HEAD_DIMS)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_compiles_for_sm90a(source, tmp_path):
    log = ptxas(source, tmp_path)
    # Spilling to local memory would wreck a bandwidth-bound kernel: refuse it here.
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill", log)]
    assert spills and not any(spills), log[-4000:]
    if source.name == "graph_decode.cu":
        entries = re.findall(r"Compiling entry function '(\w+)'", log)
        assert len([e for e in entries if "graph_decode_kernel" in e]) == graph_decode_instantiations(), entries


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
def test_the_trace_build_compiles(tmp_path):
    """PKV_NVCC_FLAGS=-DPKV_TRACE=1 (`pkv bench kernels --trace`): every instantiation compiles with
    the stamps in (spills allowed: a diagnosis build)."""
    log = ptxas(CSRC / "graph_decode.cu", tmp_path, "-DPKV_TRACE=1")
    entries = re.findall(r"Compiling entry function '(\w+)'", log)
    assert len([e for e in entries if "graph_decode_kernel" in e]) == graph_decode_instantiations(), entries
