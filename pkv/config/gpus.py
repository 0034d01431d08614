"""The GPUs of one host that a multi-GPU run shares out, one job per GPU.

`snakemake --cores N --resources gpu=N all` runs up to N measuring jobs at once on one
host. Snakemake counts the `gpu` resource but does not say which GPU a job gets, so the
Snakefile (workflow/rules/common.smk) calls pool() at parse time: it lists this host's
GPUs with nvidia-smi (those CUDA_VISIBLE_DEVICES leaves visible, when it is set), refuses
a host whose GPUs are of more than one model (one results folder holds one GPU model's
numbers) and hands every job the pool in two environment variables:

- PKV_GPUS: the pool's GPU UUIDs, comma-separated, in nvidia-smi's order;
- PKV_GPU_LOCKS: a folder of one lock file per GPU, per host and user (under /tmp).

Each GPU command then takes one free GPU of the pool as it starts (pkv/cli/gpu_pool.py).
With gpu=1 (profiles/default), without a `gpu` resource, in the CPU smoke profile or on a
cluster (profiles/slurm sets no global `gpu`) pool() returns None and nothing is set.

`python3 -m pkv.config.gpus` prints the two variables for this host as shell `export`
lines (docs/multigpu.md uses them to run the same job on every GPU at once).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pkv.config.errors import ConfigError

QUERY = ("--query-gpu=index,uuid,name", "--format=csv,noheader")


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str


@dataclass(frozen=True)
class Pool:
    gpus: tuple[Gpu, ...]
    slots: int              # jobs at once: the smaller of --resources gpu=N and the GPUs in the pool
    lock_dir: Path

    @property
    def model(self) -> str:
        return self.gpus[0].name

    @property
    def label(self) -> str:
        """The GPU part of an automatic run folder's name: "NVIDIA H200x8" -> results/runs/nvidia-h200x8-<date>/."""
        return f"{self.model}x{self.slots}"

    @property
    def env(self) -> dict[str, str]:
        return {"PKV_GPUS": ",".join(g.uuid for g in self.gpus), "PKV_GPU_LOCKS": str(self.lock_dir)}


def parse_smi(text: str) -> list[Gpu]:
    """`nvidia-smi --query-gpu=index,uuid,name --format=csv,noheader` output as Gpu rows."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",", 2)]
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1] or not parts[2]:
            raise ConfigError(f"nvidia-smi {' '.join(QUERY)}: line {n} is not 'index, uuid, name': {line.strip()!r}")
        gpus.append(Gpu(int(parts[0]), parts[1], parts[2]))
    return gpus


def query() -> list[Gpu]:
    """This host's GPUs by nvidia-smi (no torch import); none without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run([smi, *QUERY], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"nvidia-smi {' '.join(QUERY)}: {e}") from None
    if done.returncode != 0:
        why = (done.stderr or done.stdout).strip().splitlines()
        raise ConfigError(f"nvidia-smi {' '.join(QUERY)} failed: {why[0] if why else f'exit {done.returncode}'}")
    return parse_smi(done.stdout)


def visible(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES names (an index or a UUID, or a unique UUID prefix, each),
    in its order; all of them when it is unset. A name that matches no GPU is refused (CUDA
    would silently stop its list there)."""
    if cuda_visible_devices is None:
        return list(gpus)
    chosen = []
    for token in filter(None, (t.strip() for t in cuda_visible_devices.split(","))):
        match = [g for g in gpus if token == str(g.index) or (token.startswith("GPU-") and g.uuid.startswith(token))]
        if len(match) != 1:
            raise ConfigError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices}: {token!r} names "
                              f"{'no' if not match else 'more than one'} GPU of this host (nvidia-smi -L lists them)")
        if match[0] not in chosen:
            chosen.append(match[0])
    return chosen


def one_model(gpus: list[Gpu]) -> None:
    """Refuse GPUs of more than one model: the run's numbers would mix them."""
    models = list(dict.fromkeys(g.name for g in gpus))
    if len(models) > 1:
        listing = "; ".join(f"{m}: GPU {', '.join(str(g.index) for g in gpus if g.name == m)}" for m in models)
        raise ConfigError(f"this host's GPUs are of {len(models)} models ({listing}); one run measures one model: "
                          "choose its GPUs with CUDA_VISIBLE_DEVICES=<indices> (docs/multigpu.md)")


def requested(resources) -> int | None:
    """The run's global `gpu` resource (--resources gpu=N, or a profile's), if any."""
    value = resources.get("gpu") if resources else None
    value = getattr(value, "value", value)
    return None if value is None else int(value)


def default_lock_dir() -> Path:
    """This user's GPU locks on this host (made if missing; refused if another user owns it)."""
    folder = Path(tempfile.gettempdir()) / f"pkv-gpus-{os.getuid()}"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise ConfigError(f"{folder}: belongs to another user (the GPU pool's locks are per user)")
    return folder


def pool(resources, profile: str, runs_jobs: bool, environ=os.environ, gpus: list[Gpu] | None = None,
         lock_dir: Path | None = None) -> Pool | None:
    """The GPUs this run's jobs share, or None when jobs run one at a time on the GPU they see
    (module docstring). `runs_jobs`: a dry run on a host without GPUs plans without a pool."""
    wanted = requested(resources)
    if profile != "paper" or wanted is None or wanted <= 1:
        return None
    listed = query() if gpus is None else gpus
    if not listed and not runs_jobs:
        return None
    found = visible(listed, environ.get("CUDA_VISIBLE_DEVICES"))
    if not found:
        raise ConfigError(f"--resources gpu={wanted}: this host shows no GPU (nvidia-smi"
                          f"{', CUDA_VISIBLE_DEVICES' if 'CUDA_VISIBLE_DEVICES' in environ else ''})")
    one_model(found)
    if wanted > len(found):
        print(f"*** --resources gpu={wanted}, but this host has {len(found)} GPU(s) of {found[0].name}: "
              f"at most {len(found)} GPU jobs run at once (the others wait for a free GPU)", file=sys.stderr)
    if lock_dir is not None:
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    return Pool(tuple(found), min(wanted, len(found)), lock_dir or default_lock_dir())


def main() -> int:
    try:
        gpus = visible(query(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        if not gpus:
            raise ConfigError("this host shows no GPU (nvidia-smi)")
        one_model(gpus)
        folder = default_lock_dir()
    except ConfigError as e:
        print(f"pkv.config.gpus: error: {e}", file=sys.stderr)
        return 2
    for key, value in Pool(tuple(gpus), len(gpus), folder).env.items():
        print(f"export {key}={value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
