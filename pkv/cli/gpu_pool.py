"""A GPU command's own GPU on a multi-GPU host, taken as it starts and given back when its
process ends, however it ends.

The Snakefile hands every job the host's pool (pkv/config/gpus.py: PKV_GPUS, the GPUs'
UUIDs, and PKV_GPU_LOCKS, a folder of one lock file per GPU). `python3 -m pkv.cli` calls
take() before anything else: a GPU command (pkv.cli.main.GPU_COMMANDS) takes an exclusive
flock on the first free GPU's lock file, waiting while all are taken, and runs with
CUDA_VISIBLE_DEVICES set to that GPU alone. The lock is the process's open file: the kernel
releases it when the process exits or is killed, so a job that dies frees its GPU with no
cleanup, and two jobs never hold one GPU. The lock file names its holder's pid.

The warm worker (pkv/cli/worker.py) keeps its role: it is keyed by the command's whole
environment, CUDA_VISIBLE_DEVICES included, so each GPU gets a worker of its own, whose
next child preloads FlashInfer and its CUDA context on that GPU; the command waits for its
job holding the lock, and a job's child ends when its command dies. A non-GPU command (a
table, a figure) takes no GPU. PKV_GPUS is removed from what the job's own processes
inherit: a child (the Nsight capture's, under ncu) runs on its parent's GPU and takes none.

Set PKV_PIN_CORES=on as well and a GPU job also runs on its slot's share of the CPU cores:
slot i of n GPUs gets the i-th of n equal, contiguous runs of physical cores (with their
hyperthreads) of the cores this process may use (named in PKV_PINNED_CPUS), so that
host-time numbers (serial wall, the host path) are not slowed by a neighbour's threads.
The kernel build (build-kernels) runs before the fan-out, alone, and keeps every core.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path
from typing import IO

from pkv.cli.main import GPU_COMMANDS, _command

ON = ("1", "on", "true", "yes")
POLL_S = 0.2
UNPINNED = frozenset({"build-kernels"})   # runs alone, before the fan-out: ninja may use every core

_held: list[IO] = []    # the lock taken, open (and so held) for the rest of this process


def take(argv: list[str], environ=os.environ, poll_s: float = POLL_S) -> str | None:
    """The GPU (UUID) this command now holds, with CUDA_VISIBLE_DEVICES set to it; None
    (and nothing changed) without a pool or for a command that uses no GPU."""
    gpus = [g for g in environ.get("PKV_GPUS", "").split(",") if g]
    command = _command(argv)
    if not gpus or command not in GPU_COMMANDS:
        return None
    named = environ.get("PKV_GPU_LOCKS", "")
    folder = Path(named)
    if not named or not folder.is_dir():
        raise OSError(f"PKV_GPU_LOCKS={named!r}: not a folder (the GPU pool's locks; PKV_GPUS names the pool)")
    waited = False
    while True:
        for slot, gpu in enumerate(gpus):
            lock = _try_lock(folder / f"{gpu}.lock")
            if lock is None:
                continue
            _held.append(lock)
            del environ["PKV_GPUS"]
            environ["CUDA_VISIBLE_DEVICES"] = gpu
            if environ.get("PKV_PIN_CORES", "off").strip().lower() in ON and command not in UNPINNED:
                cpus = slot_cpus(slot, len(gpus))
                os.sched_setaffinity(0, cpus)
                # In the environment too: the warm worker is keyed by it, and a worker inherits
                # the affinity of the command that started it (a pinned job never reaches an unpinned one).
                environ["PKV_PINNED_CPUS"] = ",".join(map(str, sorted(cpus)))
            return gpu
        if not waited:
            print(f"pkv: all {len(gpus)} GPUs of the pool are taken (locks in {folder}); waiting for one",
                  file=sys.stderr, flush=True)
            waited = True
        time.sleep(poll_s)


def _try_lock(path: Path) -> IO | None:
    """The open, exclusively flocked lock file at `path` (naming this pid), or None if another process holds it."""
    # Kept open: the open file is the lock. Not inherited by a child (Python's default), so
    # a process the job leaves behind holds no GPU.
    f = open(path, "a+")  # noqa: SIM115
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    f.truncate(0)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def holder(path: Path) -> int | None:
    """The pid a GPU's lock file names while it is held; None when the GPU is free."""
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        return None


def physical_cores(cpus: list[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> list[list[int]]:
    """`cpus` grouped by physical core (hyperthreads together), ordered by their first cpu."""
    cores: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        try:
            key = (sysfs / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip()
        except OSError:
            key = str(cpu)
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def slot_cpus(slot: int, slots: int, cpus: list[int] | None = None, sysfs: Path = Path("/sys/devices/system/cpu")
              ) -> set[int]:
    """Slot `slot` of `slots`: its equal, contiguous share of the physical cores of `cpus`
    (this process's allowed cpus by default), hyperthreads included; with fewer cores than
    slots, slots share a core."""
    cores = physical_cores(sorted(os.sched_getaffinity(0)) if cpus is None else cpus, sysfs)
    share = max(1, len(cores) // slots)
    start = (slot * share) % len(cores)
    return {cpu for core in cores[start:start + share] for cpu in core}
