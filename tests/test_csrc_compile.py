"""Every kernel source under csrc/ compiles for sm_90a with plain nvcc (no GPU, no torch)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
KERNELS = sorted(CSRC.glob("*.cu"))
NVCC = shutil.which("nvcc")


def test_kernel_sources_exist_and_are_torch_free():
    assert KERNELS, "no .cu files under csrc/"
    for path in KERNELS + sorted(CSRC.glob("*.h")):
        text = path.read_text()
        assert "torch/" not in text and "ATen/" not in text and "c10/" not in text, path.name


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", KERNELS, ids=lambda p: p.name)
def test_compiles_for_sm90a(source, tmp_path):
    cmd = [NVCC, "-c", "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
           f"-I{CSRC}", str(source), "-o", str(tmp_path / (source.stem + ".o"))]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    # Spilling to local memory would wreck a bandwidth-bound kernel: refuse it here.
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill", result.stderr)]
    assert spills and not any(spills), result.stderr[-4000:]
