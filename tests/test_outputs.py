"""Outputs are only ever regular files of the run's own folder: a device, a FIFO, a
directory, a link or a path outside the run's folder as --out is refused in one line before
any work, and the special file is left as it was (the atomic rename never replaces it)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pkv.config.resolve import config_hash, effective
from pkv.core import io
from worktree import REPO

SMOKE = effective(yaml.safe_load((REPO / "config.yaml").read_text()), "smoke")


def pkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pkv", *args], capture_output=True, text=True, timeout=300)


def refused(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    return done.stderr.strip()


@pytest.fixture
def run(tmp_path) -> Path:
    """A run's folder: its frozen smoke config and constants that belong to it."""
    d = tmp_path / "run"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SMOKE))
    (d / "constants.json").write_text(json.dumps({"config_hash": config_hash(SMOKE)}))
    return d


def measure(d: Path, out: str) -> subprocess.CompletedProcess:
    return pkv("measure", "isolated", "--config", str(d / "config.json"), "--constants", str(d / "constants.json"),
               "--context", "64", "--out", out)


def test_the_atomic_writer_never_replaces_a_socket(tmp_path):
    """A special file stands for /dev/full or /dev/null (a test must not risk the real ones)."""
    import socket

    path = tmp_path / "s"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(path))
        before = os.lstat(path)
        assert f"{path}: is a special file" in io_refusal(lambda: io.atomic_write_bytes(path, b"x"))
        after = os.lstat(path)
    assert stat.S_ISSOCK(after.st_mode) and after.st_ino == before.st_ino


def io_refusal(write) -> str:
    with pytest.raises(OSError) as e:
        write()
    return str(e.value)


def test_measure_refuses_a_special_file_or_a_path_outside_the_run(run):
    fifo = run.parent / "pipe"
    os.mkfifo(fifo)
    assert f"--out {fifo}: outside the run's folder" in refused(measure(run, str(fifo)))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    line = refused(measure(run, str(run.parent / "elsewhere.parquet")))
    assert "elsewhere.parquet: outside the run's folder (the folder of --config)" in line
    assert not (run.parent / "elsewhere.parquet").exists()


def test_a_fifo_or_a_directory_inside_the_run_is_refused(run):
    fifo = run / "pipe.parquet"
    os.mkfifo(fifo)
    assert f"{fifo}: is a special file" in refused(measure(run, str(fifo)))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    (run / "dir.parquet").mkdir()
    assert "dir.parquet: is a directory" in refused(measure(run, str(run / "dir.parquet")))


def test_freeze_config_never_turns_a_fifo_into_a_file(tmp_path):
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    line = refused(pkv("freeze-config", "--json", json.dumps(SMOKE), "--out", str(fifo)))
    assert line == f"pkv: error: {fifo}: is a special file (device, FIFO or socket); an output must be a regular " \
                   "file or a new name"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_is_refused_not_replaced(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("kept")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    assert "is a symbolic link" in io_refusal(lambda: io.atomic_write_text(link, "new"))
    assert link.is_symlink() and target.read_text() == "kept"


def test_compare_writes_only_inside_its_run(tmp_path):
    line = refused(pkv("compare", str(tmp_path / "run"), "--reference", str(REPO / "results"),
                       "--out", str(tmp_path / "c.md")))
    assert "c.md: outside RUN_DIR" in line and not (tmp_path / "c.md").exists()


def test_the_help_says_where_outputs_go():
    assert "inside the folder of --config" in " ".join(pkv("measure", "isolated", "--help").stdout.split())
