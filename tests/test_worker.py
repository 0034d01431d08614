"""The warm worker (pkv/cli/worker.py): a command it runs gives the same output, exit code
and files as a process of its own; it is keyed by interpreter, environment and sources;
it never outlives the command whose job it runs, nor its idle time."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pkv.cli import worker, worker_serve

ROOT = Path(__file__).resolve().parents[1]


def run(args, env, **kw):
    return subprocess.run([sys.executable, "-m", "pkv.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, **kw)


@pytest.fixture
def env(tmp_path):
    """An environment whose worker is this test's own (its TMPDIR) and idles out fast."""
    e = {**os.environ, "TMPDIR": str(tmp_path), "PKV_WORKER_IDLE_S": "3"}
    e.pop("PKV_WORKER", None)
    return e


def worker_log(tmp_path) -> str:
    logs = list(tmp_path.glob("pkv-worker-*/*.log"))
    return "".join(p.read_text() for p in logs)


def test_off_unless_asked(env, tmp_path):
    assert not worker.enabled(env)
    assert worker.enabled({**env, "PKV_WORKER": "on"}) == hasattr(socket, "send_fds")
    done = run(["trace", "show", "--family", "bimodal", "--seed", "20260623"], env)
    assert done.returncode == 0 and not list(tmp_path.glob("pkv-worker-*/*.sock"))


def test_same_output_exit_codes_and_one_process(env, tmp_path):
    cases = [["trace", "show", "--family", "bimodal", "--seed", "20260623"],     # ok
             ["trace", "show", "--file", str(tmp_path / "no-such.csv")],          # bad input: exit 2, one line
             ["trace", "show", "--bogus"]]                                         # argparse: exit 2, usage
    alone = [run(a, env) for a in cases]
    warm = [run(a, {**env, "PKV_WORKER": "on"}) for a in cases]
    for a, w in zip(alone, warm):
        assert (w.returncode, w.stdout, w.stderr) == (a.returncode, a.stdout, a.stderr)
    assert [a.returncode for a in alone] == [0, 2, 2] and "no such file" in alone[1].stderr
    log = worker_log(tmp_path)
    assert log.count(" worker ") == 1 and log.count("rc=") == 3, log   # one worker ran all three


def test_keyed_by_environment_and_sources(env, tmp_path, monkeypatch):
    base = worker.fingerprint(env)
    assert worker.fingerprint({**env, "CUDA_VISIBLE_DEVICES": "1"}) != base
    assert worker.fingerprint({**env, "PWD": "/elsewhere"}) == base          # differs per shell, read by nothing
    src = ROOT / "pkv" / "cli" / "worker.py"
    st = src.stat()
    try:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))      # an edited source file
        assert worker.fingerprint(env) != base
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_idle_worker_exits(env, tmp_path):
    assert run(["trace", "--help"], {**env, "PKV_WORKER": "on"}).returncode == 0
    deadline = time.monotonic() + 20
    while list(tmp_path.glob("pkv-worker-*/*.sock")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not list(tmp_path.glob("pkv-worker-*/*.sock")) and "idle 3 s: exiting" in worker_log(tmp_path)


def test_busy_worker_means_run_here(env, tmp_path, monkeypatch):
    """A worker that answers "busy" (one job at a time) leaves the command to its own process."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("PKV_WORKER", "on")
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    path = worker.socket_path()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def busy():
        conn, _ = listener.accept()
        _, fds, _, _ = socket.recv_fds(conn, 8, 2)
        for fd in fds:
            os.close(fd)
        conn.sendall(b"B")
        conn.close()

    t = threading.Thread(target=busy)
    t.start()
    try:
        assert worker.delegate(["trace", "--help"]) is None
    finally:
        t.join(10)
        listener.close()


def test_a_command_that_dies_ends_its_job(tmp_path):
    """The watch on a job's connection ends the worker when the command goes away."""
    code = ("import socket, threading, time\n"
            "from pkv.cli.worker_serve import _exit_when_gone\n"
            "a, b = socket.socketpair()\n"
            "threading.Thread(target=_exit_when_gone, args=(a, threading.Event()), daemon=True).start()\n"
            "b.close()\n"
            "time.sleep(30)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and time.monotonic() - started < 20


def test_pipeline_turns_it_on():
    text = (ROOT / "workflow/rules/common.smk").read_text()
    assert 'os.environ.setdefault("PKV_WORKER", "on")' in text


def test_a_job_that_allocated_gpu_memory_is_the_workers_last(monkeypatch):
    """A GPU job leaves the worker ("gpu": a fresh successor takes the next job); a job that
    only had the preloaded context (nothing allocated) does not."""
    class Cuda:
        reserved = 0

        def is_initialized(self):
            return True

        def synchronize(self):
            pass

        def max_memory_reserved(self):
            return self.reserved

    class Torch:
        cuda = Cuda()

    monkeypatch.setitem(sys.modules, "torch", Torch())
    assert worker_serve._leave() is True
    Torch.cuda.reserved = 2 << 20
    assert worker_serve._leave() == "gpu"


def test_a_standby_takes_over_when_its_worker_goes(env, tmp_path):
    """The worker started beside a GPU job waits, preloaded, and serves the next command the
    moment the current worker has gone (here: it idles out), not before."""
    on = {**env, "PKV_WORKER": "on", "PKV_WORKER_IDLE_S": "6"}
    assert run(["trace", "--help"], on).returncode == 0
    path = tmp_path / f"pkv-worker-{os.getuid()}" / f"{worker.fingerprint(on)}.sock"
    standby = subprocess.Popen([sys.executable, "-m", "pkv.cli.worker_serve", "--socket", str(path), "--standby",
                                "--idle-s", "3"], cwd=ROOT, env={**on, "PKV_WORKER": "off"},
                               stdout=open(path.with_suffix(".log"), "a"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 40
        while "(was the standby)" not in worker_log(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run(["trace", "--help"], on).returncode == 0
        log = worker_log(tmp_path)
        assert "(was the standby)" in log and log.count(" worker ") == 2 and log.count("rc=0") == 2, log
        # It took over only once the first worker had gone.
        assert log.index("idle 6 s: exiting") < log.index("(was the standby)"), log
    finally:
        standby.wait(30)
