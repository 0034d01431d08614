"""Which profile an invocation runs and where its results go.

The committed reference run is `results/`; a paper run on a machine with a GPU goes to
`results/runs/<gpu>-<date>/` (or `results/runs/<run>/` with `--config run=NAME`) and
never writes into `results/`; without a GPU the paper profile plans against the
reference (a fresh clone has nothing to do); `run=reference` targets it on purpose. The
smoke profile always writes `results/smoke/`. Imports nothing heavy.
"""

from __future__ import annotations

import datetime
import re
import shutil
import subprocess
from functools import cache

from pkv.config.errors import ConfigError

PROFILES = ("paper", "smoke")
REFERENCE_ROOT = "results"
SMOKE_ROOT = "results/smoke"
RUNS_ROOT = "results/runs"
SMOKE_BANNER = "CPU smoke — not a performance result"
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def resolve_profile(requested: str, cuda_available: bool) -> str:
    if requested == "auto":
        return "paper" if cuda_available else "smoke"
    if requested not in PROFILES:
        raise ConfigError(f"profile must be auto, paper or smoke, got {requested!r}")
    return requested


@cache
def gpu_name() -> str | None:
    """The first GPU's name from `nvidia-smi` (no torch import), or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def slug(text: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def run_root(profile: str, run: str, gpu: str | None, today: datetime.date | None = None) -> str:
    """The results folder of this invocation (module docstring)."""
    if profile == "smoke":
        return SMOKE_ROOT
    if run == "reference" or (run == "auto" and gpu is None):
        return REFERENCE_ROOT
    if run == "auto":
        today = today or datetime.datetime.now(datetime.timezone.utc).date()
        return f"{RUNS_ROOT}/{slug(gpu)}-{today.isoformat()}"
    if not RUN_NAME.match(run) or run in ("auto", "reference"):
        raise ConfigError(f"config: run {run!r} must be auto, reference or a folder name of letters, digits, "
                          "'.', '_', '-'")
    return f"{RUNS_ROOT}/{run}"
