"""One warm process for the pipeline's commands.

Each job of the pipeline is a `python3 -m pkv.cli ...` command, and most of a short one is
start-up: importing torch, pandas and FlashInfer and creating the CUDA context take ~8 s
on the H200, against ~1.5 s for a serving point's measured loop. With PKV_WORKER=on (the
Snakefile sets it, workflow/rules/common.smk) a command hands its argv, working folder,
environment and stdout/stderr to a worker process instead, which runs commands one at a
time in the same interpreter and keeps what they loaded: modules, the CUDA context, our
kernels and FlashInfer's JIT modules. A job's exit code, output and files are those of a
process of its own; only its start-up is gone.

What keeps that true:
- A worker is keyed by everything a warm process would carry over: the interpreter, the
  environment (all of it, as an import or a build may read any variable) and the sizes and
  mtimes of pkv/ and csrc/. Any change starts another worker; the old one idles out.
- Per job: its argv, folder and environment are set, functools caches that read the
  outside world are cleared (the commit), and matplotlib's settings go back to the rc
  file's; afterwards Python and the CUDA allocator give back what the job freed.
- One job at a time. A command that finds the worker busy runs in its own process.
- A command that dies (Snakemake killing the job) ends the worker at once: no job outlives
  its command. A job that fails with a traceback ends the worker after it reports (it may
  have left CUDA in an error state); a bad-input error (exit 2) does not.
- The worker's own commands run with PKV_WORKER=off (the Nsight stage's child runs under
  ncu in a process of its own); an idle worker exits after PKV_WORKER_IDLE_S (30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import json
import os
import queue
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ON = ("1", "on", "true", "yes")
IDLE_S = 30.0
SPAWN_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[2]          # the checkout (pkv/ and csrc/)
VOLATILE_ENV = ("PWD", "OLDPWD", "SHLVL", "_")      # differ between shells, read by nothing


def enabled(env=os.environ) -> bool:
    return env.get("PKV_WORKER", "off").strip().lower() in ON and hasattr(socket, "send_fds")


def fingerprint(env=os.environ) -> str:
    """What a warm process carries from one command to the next: interpreter, environment, sources."""
    h = hashlib.sha256(f"{sys.executable}\0{sys.version}\0{ROOT}\0".encode())
    for key in sorted(set(env) - set(VOLATILE_ENV)):
        h.update(f"{key}={env[key]}\0".encode())
    for base in (ROOT / "pkv", ROOT / "csrc"):
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                st = os.stat(os.path.join(folder, name))
                h.update(f"{folder}/{name}:{st.st_size}:{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def socket_path(env=os.environ) -> Path:
    folder = Path(tempfile.gettempdir()) / f"pkv-worker-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    if folder.stat().st_uid != os.getuid():
        raise OSError(f"worker: {folder} belongs to another user")
    return folder / f"{fingerprint(env)}.sock"


# --- the command's side ------------------------------------------------------------------

def delegate(argv: list[str]) -> int | None:
    """argv's exit code, run by the warm worker; None: run it in this process (worker off,
    busy or not startable)."""
    if not enabled():
        return None
    try:
        path = socket_path()
        conn = _connect(path) or _spawn(path)
    except OSError:
        return None
    if conn is None:
        return None
    with conn:
        payload = json.dumps({"argv": argv, "argv0": sys.argv[0], "cwd": os.getcwd(),
                              "env": dict(os.environ)}).encode()
        try:
            socket.send_fds(conn, [struct.pack("!Q", len(payload))], [1, 2])
            conn.sendall(payload)
            status = _recv_exact(conn, 1)
        except OSError:
            return None
        if status != b"A":                      # busy, or gone before it took the job
            return None
        rc = _recv_exact(conn, 4)
    if rc is None:
        print(f"pkv: error: the warm worker ended while running this command (its log: "
              f"{path.with_suffix('.log')})", file=sys.stderr)
        return 1
    return struct.unpack("!i", rc)[0]


def _connect(path: Path) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(path))
        return conn
    except OSError:
        conn.close()
        return None


def _spawn(path: Path) -> socket.socket | None:
    """Start the worker for `path` (one at a time: a lock file), then connect to it."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        path.unlink(missing_ok=True)            # a socket left by a worker that was killed
        env = {**os.environ, "PKV_WORKER": "off",
               "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
        with open(path.with_suffix(".log"), "a") as log:
            proc = subprocess.Popen([sys.executable, "-m", "pkv.cli.worker", "--socket", str(path)], cwd="/",
                                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, close_fds=True)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            conn = _connect(path)
            if conn is not None:
                return conn
            time.sleep(0.01)
        return None


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


# --- the worker's side -------------------------------------------------------------------

class Worker:
    def __init__(self, path: Path, idle_s: float):
        self.path, self.idle_s = path, idle_s
        self.jobs: queue.Queue = queue.Queue()
        self.busy = threading.Lock()            # held from taking a job until its reply is sent

    def serve(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(16)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        log(f"worker {os.getpid()} on {self.path}")
        try:
            while True:
                try:
                    conn, fds, request = self.jobs.get(timeout=self.idle_s)
                except queue.Empty:
                    log(f"idle {self.idle_s:.0f} s: exiting")
                    return
                keep = self._run(conn, fds, request)
                self.busy.release()
                if not keep:
                    log("a job failed with a traceback: exiting (the next command starts a fresh worker)")
                    return
        finally:
            self.path.unlink(missing_ok=True)   # before the listener closes: no command reaches a dead one

    def _accept(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            conn.settimeout(5.0)                # a command sends its request at once
            fds: list[int] = []
            try:
                head, fds, _, _ = socket.recv_fds(conn, 8, 2)
                request = json.loads(_recv_exact(conn, struct.unpack("!Q", head)[0]) or b"null")
                conn.settimeout(None)
            except (OSError, ValueError, struct.error):
                for fd in fds:
                    os.close(fd)
                conn.close()
                continue
            if request is None or len(fds) != 2 or not self.busy.acquire(blocking=False):
                for fd in fds:
                    os.close(fd)
                with contextlib.suppress(OSError):
                    conn.sendall(b"B")
                conn.close()
                continue
            conn.sendall(b"A")
            self.jobs.put((conn, fds, request))

    def _run(self, conn: socket.socket, fds: list[int], request: dict) -> bool:
        """Run one command with the client's argv, folder, environment and stdout/stderr;
        True when the worker may take another."""
        from pkv.cli.main import main

        watch = threading.Thread(target=_exit_when_gone, args=(conn,), daemon=True)
        watch.start()
        started, keep = time.monotonic(), True
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        try:
            os.dup2(fds[0], 1), os.dup2(fds[1], 2)
            _enter(request)
            try:
                rc = int(main(request["argv"]) or 0)
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if not isinstance(e.code, (int, type(None))):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                rc, keep = 1, False
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            for fd in (*saved, *fds):
                os.close(fd)
        keep = _leave() and keep
        log(f"rc={rc} {time.monotonic() - started:.1f} s: {' '.join(request['argv'])}")
        with contextlib.suppress(OSError):
            conn.sendall(struct.pack("!i", rc))
        conn.close()
        return keep


def _enter(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["PKV_WORKER"] = "off"            # what this job starts runs in its own process
    sys.argv = [request["argv0"], *request["argv"]]
    from pkv.core import io

    io._git_commit.cache_clear()                # a commit made between two jobs


def _leave() -> bool:
    """Give back what the job freed; False when CUDA is no longer usable."""
    if "matplotlib" in sys.modules:
        import matplotlib
        import matplotlib.pyplot as plt

        plt.close("all")
        matplotlib.rc_file_defaults()
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except RuntimeError as e:
            log(f"CUDA unusable after the job: {e}")
            return False
    return True


def _exit_when_gone(conn: socket.socket) -> None:
    """The command that handed us the job has died: end the worker (and the job) now."""
    while True:
        try:
            ready, _, _ = select.select([conn], [], [], 0.2)
            if ready and not conn.recv(1, socket.MSG_PEEK):
                log("the command went away during its job: exiting")
                os._exit(3)
        except (OSError, ValueError):           # the reply was sent and the socket closed
            return


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=sys.__stdout__, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pkv.cli.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, type=Path)
    p.add_argument("--idle-s", type=float, default=float(os.environ.get("PKV_WORKER_IDLE_S", IDLE_S)))
    args = p.parse_args(argv)
    try:
        Worker(args.socket, args.idle_s).serve()
    except OSError as e:                        # another worker took the socket first
        log(f"not serving: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
