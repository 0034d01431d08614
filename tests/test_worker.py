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


def test_each_command_runs_in_a_child_of_its_own(env, tmp_path):
    """Nothing one command does reaches the next: each runs in a fresh child of the zygote
    (its own pid), while the zygote stays the same process."""
    on = {**env, "PKV_WORKER": "on"}
    args = ["trace", "show", "--family", "bimodal", "--seed", "20260623"]
    first, second = run(args, on), run(args, on)
    assert first.returncode == second.returncode == 0 and first.stdout == second.stdout
    lines = worker_log(tmp_path).splitlines()
    zygotes = {line.split("]")[0] for line in lines if " worker " in line}
    jobs = [line.split("]")[0] for line in lines if "rc=0" in line]
    assert len(zygotes) == 1 and len(jobs) == 2 and len(set(jobs)) == 2 and not zygotes & set(jobs), lines


def test_a_traceback_is_the_commands_exit_1(tmp_path):
    """A command that fails with a traceback: the traceback on its stderr, exit code 1 to it."""
    code = ("import os, socket, struct, sys\n"
            "import pkv.cli.main\n"
            "from pkv.cli import worker_serve as w\n"
            "m = sys.modules['pkv.cli.main']\n"
            "def boom(argv):\n"
            "    raise RuntimeError('boom')\n"
            "m.main = boom\n"
            "a, b = socket.socketpair()\n"
            "out, err, rc = sys.argv[1:]\n"
            "fds = [os.open(f, os.O_WRONLY | os.O_CREAT) for f in (out, err)]\n"
            "w._run(a, fds, {'argv': ['x'], 'argv0': 'pkv', 'cwd': os.getcwd(), 'env': dict(os.environ)})\n"
            "open(rc, 'w').write(str(struct.unpack('!i', b.recv(4))[0]))\n")
    out, err, rc = (tmp_path / n for n in ("out", "err", "rc"))
    done = subprocess.run([sys.executable, "-c", code, str(out), str(err), str(rc)], cwd=ROOT, timeout=60)
    assert done.returncode == 0 and rc.read_text() == "1"
    assert "RuntimeError: boom" in err.read_text()


def test_the_zygote_preloads_without_cuda(monkeypatch):
    """The zygote imports every pkv module (none may import FlashInfer or initialize CUDA:
    its children could not use CUDA then) and refuses to serve when one did."""
    assert worker_serve._preload_shared() == ""
    import pkv.cli.main  # noqa: F401
    assert "pkv.measure.loop" in sys.modules and "flashinfer" not in sys.modules
    monkeypatch.setitem(sys.modules, "flashinfer", object())
    assert worker_serve._preload_shared() == "a preloaded module initialized CUDA"


def test_gpu_commands_take_the_child_preloaded_ahead(env, tmp_path):
    """On a GPU machine the child for the next GPU command is forked ahead and preloads
    (FlashInfer, CUDA) beside what runs; other commands get a plain fork at once. Here the
    GPU is faked and the preload writes a marker instead."""
    on = {**env, "PKV_WORKER": "on", "PKV_WORKER_IDLE_S": "4"}
    marks = tmp_path / "preloaded"
    code = ("import os, sys\n"
            "from pkv.cli import worker\n"
            "path = worker.socket_path()\n"           # before torch's import sets variables of its own
            "import torch\n"
            "from pkv.cli import worker_serve as w\n"
            "torch.cuda.device_count = lambda: 1\n"
            "w._preload_gpu = lambda: open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
            "w._LOG = os.fdopen(os.dup(1), 'w', buffering=1)\n"
            "w.Zygote(path, 4.0).serve()\n")
    zygote = subprocess.Popen([sys.executable, "-c", code, str(marks)], cwd=ROOT, env=on,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sock = tmp_path / f"pkv-worker-{os.getuid()}" / f"{worker.fingerprint(on)}.sock"
        deadline = time.monotonic() + 30
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        first = run(["trace", "show", "--family", "bimodal", "--seed", "20260623"], on)
        second = run(["bench", "kernels", "--help"], on)
        assert first.returncode == second.returncode == 0 and "--cases" in second.stdout
    finally:
        out, _ = zygote.communicate(timeout=60)
    jobs = {line.split("rc=0")[1].split(": ", 1)[1]: line.split("]")[0].split("[")[1]
            for line in out.splitlines() if "rc=0" in line}
    preloaded = marks.read_text().split()
    assert jobs["bench kernels --help"] in preloaded, (out, preloaded)
    assert jobs["trace show --family bimodal --seed 20260623"] not in preloaded, (out, preloaded)
