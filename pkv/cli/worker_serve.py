"""The worker process of pkv/cli/worker.py (whose docstring says what it keeps and why):
`python -m pkv.cli.worker_serve --socket PATH [--standby]`, started by a command or by the
worker before it, never by hand."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
import traceback
from pathlib import Path

from pkv.cli.worker import IDLE_S, SPAWN_TIMEOUT_S, _alive, _locked, _recv_exact, _start

STANDBY_WAIT_S = 1800.0     # a standby waits this long for the GPU job it was started beside


class Worker:
    def __init__(self, path: Path, idle_s: float, standby: bool = False):
        self.path, self.idle_s, self.standby = path, idle_s, standby
        self.env = dict(os.environ)             # the successor's (a job's environment is the job's)
        self.jobs: queue.Queue = queue.Queue()
        self.busy = threading.Lock()            # held from taking a job until its reply is sent
        self.successor = False
        self.preload = threading.Thread(target=_preload, daemon=True)

    def serve(self) -> None:
        # A standby (started when a GPU job began) preloads while that job runs, and serves
        # the moment its worker has gone; a worker started by a command serves at once.
        self.preload.start()
        listener = self._take_over(STANDBY_WAIT_S if self.standby else SPAWN_TIMEOUT_S)
        if listener is None:
            log(f"worker {os.getpid()}: another worker kept {self.path}; exiting")
            return
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        log(f"worker {os.getpid()} on {self.path}" + (" (was the standby)" if self.standby else ""))
        # The worker leaves holding `busy`: a command that reaches it while it exits is told
        # "busy" and runs in its own process, never handed to a worker that is going away.
        try:
            while True:
                try:
                    conn, fds, request = self.jobs.get(timeout=self.idle_s)
                except queue.Empty:
                    if not self.busy.acquire(blocking=False):
                        continue                # a job is being handed over right now
                    log(f"idle {self.idle_s:.0f} s: exiting")
                    return
                keep = self._run(conn, fds, request)
                if keep == "gpu":
                    log("the job allocated GPU memory: exiting, a fresh successor takes the next job")
                    self.successor = True
                    return
                if not keep:
                    log("a job failed with a traceback: exiting (the next command starts a fresh worker)")
                    return
                self.busy.release()
        finally:
            with _locked(self.path):            # before the listener closes: no command reaches a dead one
                self.path.unlink(missing_ok=True)
                self.path.with_suffix(".pid").unlink(missing_ok=True)
                if self.successor and not _alive(self.path.with_suffix(".coming")):
                    _start(self.path, self.env)

    def _take_over(self, wait_s: float) -> socket.socket | None:
        """Bind `path` once no live worker is behind it; None if that takes over wait_s."""
        me, pid, coming = os.getpid(), self.path.with_suffix(".pid"), self.path.with_suffix(".coming")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with _locked(self.path):
                if not (self.path.exists() and _alive(pid)):
                    self.path.unlink(missing_ok=True)   # left by a worker that was killed
                    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    listener.bind(str(self.path))
                    listener.listen(16)
                    pid.write_text(str(me))
                    if coming.exists() and coming.read_text().strip() == str(me):
                        coming.unlink()
                    return listener
            time.sleep(0.05)
        with _locked(self.path):
            if coming.exists() and coming.read_text().strip() == str(me):
                coming.unlink()
        return None

    def _standby(self) -> None:
        """At the start of a timed job on a GPU: the next worker, preloading while this one works."""
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available():
            return
        with _locked(self.path):
            if not _alive(self.path.with_suffix(".coming")):
                _start(self.path, self.env, standby=True)

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

    def _run(self, conn: socket.socket, fds: list[int], request: dict) -> bool | str:
        """Run one command with the client's argv, folder, environment and stdout/stderr;
        True when the worker may take another, "gpu" when the job allocated GPU memory."""
        from pkv.cli.main import TIMED, _command, main

        if _command(request["argv"]) in TIMED:
            # Measured on the H200: a preload still importing beside a timed job added ~5 us
            # to B1 1K's replay. The next worker starts preloading now, in its own process.
            self.preload.join()
            self._standby()
        replying = threading.Event()            # set before the exit code goes out
        threading.Thread(target=_exit_when_gone, args=(conn, replying), daemon=True).start()
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
        left = _leave()
        keep = left if left is not True else keep
        log(f"rc={rc} {time.monotonic() - started:.1f} s: {' '.join(request['argv'])}")
        replying.set()
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


def _leave() -> bool | str:
    """Give back what the job freed; False when CUDA is no longer usable, "gpu" when the job
    allocated GPU memory (the worker's last job, see above)."""
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
            if torch.cuda.max_memory_reserved() > 0:
                return "gpu"
        except RuntimeError as e:
            log(f"CUDA unusable after the job: {e}")
            return False
    return True


def _preload() -> None:
    """What most jobs import, and the CUDA context, made before the first job asks for them."""
    started = time.monotonic()
    try:
        import numpy  # noqa: F401
        import pandas  # noqa: F401
        import pyarrow.parquet  # noqa: F401
        import torch

        if torch.cuda.is_available():
            torch.cuda.init()
            import flashinfer  # noqa: F401
    except Exception as e:                      # a job that needs the module reports it
        log(f"preload stopped: {type(e).__name__}: {e}")
        return
    log(f"preloaded in {time.monotonic() - started:.1f} s")


def _exit_when_gone(conn: socket.socket, replying: threading.Event) -> None:
    """The command that handed us the job has died: end the worker (and the job) now. Once
    the exit code is on its way, the command closing its end is no longer a death."""
    while not replying.is_set():
        try:
            ready, _, _ = select.select([conn], [], [], 0.2)
            if ready and not conn.recv(1, socket.MSG_PEEK) and not replying.is_set():
                log("the command went away during its job: exiting")
                os._exit(3)
        except (OSError, ValueError):           # the reply was sent and the socket closed
            return


_LOG = None     # the worker's own log: a copy of its stdout made before any job's output is put on fd 1


def log(text: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {text}", file=_LOG or sys.__stdout__, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pkv.cli.worker_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, type=Path)
    p.add_argument("--idle-s", type=float, default=float(os.environ.get("PKV_WORKER_IDLE_S", IDLE_S)))
    p.add_argument("--standby", action="store_true", help="serve once the current worker of --socket has gone")
    args = p.parse_args(argv)
    global _LOG
    _LOG = os.fdopen(os.dup(1), "w", buffering=1)
    try:
        Worker(args.socket, args.idle_s, args.standby).serve()
    except OSError as e:                        # another worker took the socket first
        log(f"not serving: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
