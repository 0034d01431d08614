"""Test-only: parks one serving measurement between its temp write and its rename.

tests/test_slurm.py puts this folder on PYTHONPATH (with PKV_TEST_HOLD_DIR) for the
first SLURM run, so that it can scancel a measuring job at a known point, the worst
one for a kill: the whole Parquet is written under its temp name and the rename to the
final name has not happened. The first process to reach that point claims the hold
(`claimed` holds its SLURM job id, final path and temp path) and waits for `release`
or the scancel; every other process passes through. Without PKV_TEST_HOLD_DIR this
module does nothing.
"""

import os
import sys
import time

HOLD_DIR = os.environ.get("PKV_TEST_HOLD_DIR")
HOLD_LIMIT_S = 600  # a test that died must not wedge the job for ever

if HOLD_DIR:
    _replace = os.replace

    def _held_replace(src, dst, *args, **kwargs):
        target = os.fspath(dst)
        serving = "measure" in sys.argv and "serve" in sys.argv
        if serving and target.endswith(".parquet") and f"{os.sep}raw{os.sep}serve{os.sep}" in target:
            try:
                fd = os.open(os.path.join(HOLD_DIR, "claimed.partial"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return _replace(src, dst, *args, **kwargs)
            os.write(fd, f"{os.environ.get('SLURM_JOB_ID', '')}\t{target}\t{os.fspath(src)}\n".encode())
            os.close(fd)
            # The test reads `claimed` only once it is whole.
            os.link(os.path.join(HOLD_DIR, "claimed.partial"), os.path.join(HOLD_DIR, "claimed"))
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not os.path.exists(os.path.join(HOLD_DIR, "release")) and time.monotonic() < deadline:
                time.sleep(0.2)
        return _replace(src, dst, *args, **kwargs)

    os.replace = _held_replace
