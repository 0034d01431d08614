"""Every kernel source under csrc/ compiles for sm_90a with plain nvcc (no GPU, no torch), without
spills; the JIT build (pkv.kernels.loader) and the wheel cover every file there; and csrc/'s
comments say what the code does today (no version tags, commit hashes or issue numbers)."""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from pkv.engines.graph import FP8_HEAD_DIMS, HEAD_DIMS
from pkv.kernels.loader import HEADERS, SOURCES

REPO = Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
KERNELS = sorted(CSRC.glob("*.cu"))
SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
NVCC = shutil.which("nvcc")

# In a comment: a version tag ("v5", "v5.12", "Router v4.4"), a commit hash (7-40 hex digits
# with a digit and a letter), an issue number ("#22", "issue 46").
HISTORY = re.compile(r"\bv\d+(?:\.\d+)*\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b|#\d+\b|\bissue \d+",
                     re.IGNORECASE)
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def history_in(text: str) -> list[str]:
    """The comments' history marks in C++/CUDA source text, each with its line number."""
    return [f"line {text.count(chr(10), 0, c.start()) + 1}: {m.group(0)!r} in {c.group(0).strip()[:80]!r}"
            for c in COMMENT.finditer(text) for m in HISTORY.finditer(c.group(0))]


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


@pytest.mark.parametrize("path", sorted(p for p in CSRC.iterdir() if p.suffix in SUFFIXES), ids=lambda p: p.name)
def test_comments_carry_no_history(path):
    assert not history_in(path.read_text()), history_in(path.read_text())


@pytest.mark.parametrize("text,marks", [
    ("// v5.12: the set-up units\nint x;", 1), ("int x;  // Router v4.4", 1), ("/* measured at 0a3a33c */", 1),
    ("// issue 46 and #22", 2), ('asm("ld.global.nc.v4.u32 %0;");  // four words', 0),
    ("constexpr float k = 0.693147180559945309f;  // ln 2, float4 loads", 0)])
def test_the_history_check_finds_tags_hashes_and_issues_in_comments_only(text, marks):
    assert len(history_in(text)) == marks


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
