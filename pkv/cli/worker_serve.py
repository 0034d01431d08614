"""The worker process of pkv/cli/worker.py (whose docstring says what it keeps and why):
`python -m pkv.cli.worker_serve --socket PATH`, started by a command, never by hand.

A zygote: it imports what the jobs share (torch, pandas, pyarrow, matplotlib, seaborn and
pkv) without initializing CUDA, and forks one child per command. The child that will run
the next command is forked ahead of it: on a GPU machine it imports FlashInfer (whose
import initializes CUDA, so the zygote cannot) and creates its CUDA context while the
command before it runs, tells the zygote it is ready, waits for its command, runs it and
exits. Every command therefore runs in a process of its own, with a CUDA context nothing
else has allocated in, and pays none of the imports."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import pkgutil
import select
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import warnings
from pathlib import Path

from pkv.cli.main import GPU_COMMANDS, _command
from pkv.cli.worker import IDLE_S, SPAWN_TIMEOUT_S, _alive, _locked, _recv_exact

READY, DONE = b"R", b"D"    # a child's preload is done; its command is (the exit code on its way)


class Child:
    """A forked process for one command: the socket its command comes on, and its pidfd."""

    def __init__(self, pid: int, sock: socket.socket):
        self.pid, self.sock, self.fd = pid, sock, os.pidfd_open(pid)
        self.ready = self.closed = False

    def reap(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.sock.close()
        os.close(self.fd)
        return status


class Zygote:
    def __init__(self, path: Path, idle_s: float):
        self.path, self.idle_s = path, idle_s
        self.next: Child | None = None      # forked ahead, takes the next command
        self.running: Child | None = None   # runs a command now (one at a time)
        self.exiting: list[Child] = []      # done with their command, not yet reaped

    def serve(self) -> None:
        listener = self._bind()
        if listener is None:
            log(f"worker {os.getpid()}: another worker serves {self.path}; exiting")
            return
        try:
            started = time.monotonic()
            why = _preload_shared()
            if why:                          # commands reaching the socket meanwhile are told "busy"
                log(f"not serving: {why}")
                return
            log(f"worker {os.getpid()} on {self.path}: preloaded in {time.monotonic() - started:.1f} s")
            self._loop(listener)
        finally:
            with _locked(self.path):         # before the listener closes: no command reaches a dead one
                if _mine(self.path.with_suffix(".pid")):
                    self.path.unlink(missing_ok=True)
                    self.path.with_suffix(".pid").unlink(missing_ok=True)
            listener.close()
            if self.next is not None:        # never handed a command
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.next.pid, signal.SIGKILL)
                self.next.reap()

    def _bind(self) -> socket.socket | None:
        """Listen on `path` once no live worker is behind it (one that is exiting lets go soon)."""
        pid, coming = self.path.with_suffix(".pid"), self.path.with_suffix(".coming")
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                with _locked(self.path):
                    if not (self.path.exists() and _alive(pid)):
                        self.path.unlink(missing_ok=True)   # left by a worker that was killed
                        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        listener.bind(str(self.path))
                        listener.listen(16)
                        pid.write_text(str(os.getpid()))
                        return listener
                time.sleep(0.05)
            return None
        finally:
            with _locked(self.path):
                if _mine(coming):
                    coming.unlink()

    def _loop(self, listener: socket.socket) -> None:
        import torch

        self.gpu = torch.cuda.device_count() > 0  # by NVML: the zygote initializes no CUDA
        idle_since = time.monotonic()
        while True:
            children = [c for c in (self.next, self.running, *self.exiting) if c is not None]
            watched = [listener, *(c.fd for c in children), *(c.sock for c in children if not c.closed)]
            wait = None if self.running else max(0.0, idle_since + self.idle_s - time.monotonic())
            ready, _, _ = select.select(watched, [], [], wait)
            if not ready and self.running is None:
                log(f"idle {self.idle_s:.0f} s: exiting")
                return
            for c in children:                       # a child's news: ready, done, or gone
                if c.sock in ready:
                    news = c.sock.recv(1)
                    c.ready |= news == READY
                    c.closed = not news
                    if c is self.running and news in (DONE, b""):
                        # The next command may come before this child has exited (a CUDA
                        # context takes a moment to tear down): it is served, not told "busy".
                        self.exiting.append(c)
                        self.running, idle_since = None, time.monotonic()
            for c in [c for c in (self.running, *self.exiting) if c is not None and c.fd in ready]:
                status = c.reap()
                if status:
                    log(f"a command's process ended with wait status {status}")
                if c is self.running:
                    self.running, idle_since = None, time.monotonic()
                else:
                    self.exiting.remove(c)
            if self.next is not None and self.next.fd in ready:
                log(f"the child forked for the next command ended before one came (wait status {self.next.reap()}); "
                    "exiting (commands run alone)")
                self.next = None
                return
            if self.gpu and self.next is None and (self.running is None or self.running.ready):
                self.next = self._fork(listener, gpu=True)  # preloads beside the running command, not its preload
            if listener in ready:
                self._accept(listener)

    def _accept(self, listener: socket.socket) -> None:
        conn, _ = listener.accept()
        conn.settimeout(5.0)                 # a command sends its request at once
        fds: list[int] = []
        try:
            head, fds, _, _ = socket.recv_fds(conn, 8, 2)
            payload = _recv_exact(conn, struct.unpack("!Q", head)[0])
            conn.settimeout(None)
            command = _command(json.loads(payload or b"null")["argv"])
        except (OSError, ValueError, TypeError, KeyError, struct.error):
            payload = command = None
        try:
            gpu = self.gpu and command in GPU_COMMANDS
            if payload is None or len(fds) != 2 or self.running is not None or (gpu and self.next is None):
                with contextlib.suppress(OSError):
                    conn.sendall(b"B")       # busy (one command at a time): it runs in its own process
                return
            # A GPU command takes the child preloaded for it; any other a plain fork made now.
            child = self.next if gpu else self._fork(listener, gpu=False)
            try:
                conn.sendall(b"A")
                socket.send_fds(child.sock, [struct.pack("!Q", len(payload))], [conn.fileno(), *fds])
                child.sock.sendall(payload)
            except OSError:
                if not gpu:                  # a plain fork nobody will hand a command to
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
                    child.reap()
                raise
            self.running = child
            if gpu:
                self.next = None
        except OSError as e:                 # the command or the child went away meanwhile
            log(f"a command was not handed over: {e}")
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()

    def _fork(self, listener: socket.socket, gpu: bool) -> Child:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:                         # the child: never returns into the zygote's code
            try:
                listener.close()
                ours.close()
                for c in (self.next, self.running, *self.exiting):   # the other children's ends
                    if c is not None:
                        c.sock.close()
                        os.close(c.fd)
                _child(theirs, gpu)
            except BaseException:
                log(traceback.format_exc())
            finally:
                os._exit(0)
        theirs.close()
        return Child(pid, ours)


def _child(sock: socket.socket, gpu: bool) -> None:
    """Preload what only a GPU process may load (gpu), say so, then run the one command handed over."""
    if gpu:
        _preload_gpu()
    sock.sendall(READY)
    head, fds, _, _ = socket.recv_fds(sock, 8, 3)
    if len(head) < 8 or len(fds) != 3:       # the zygote exited before a command came
        return
    request = json.loads(_recv_exact(sock, struct.unpack("!Q", head)[0]) or b"null")
    _run(socket.socket(fileno=fds[0]), fds[1:], request, sock)


def _run(conn: socket.socket, fds: list[int], request: dict, zygote: socket.socket | None = None) -> None:
    """Run one command with the client's argv, folder, environment and stdout/stderr."""
    from pkv.cli.main import main

    replying = threading.Event()            # set before the exit code goes out
    threading.Thread(target=_exit_when_gone, args=(conn, replying), daemon=True).start()
    started = time.monotonic()
    os.dup2(fds[0], 1), os.dup2(fds[1], 2)
    for fd in fds:
        os.close(fd)
    _enter(request)
    try:
        rc = int(main(request["argv"]) or 0)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        rc = 1
    sys.stdout.flush(), sys.stderr.flush()
    log(f"rc={rc} {time.monotonic() - started:.1f} s: {' '.join(request['argv'])}")
    if zygote is not None:
        with contextlib.suppress(OSError):
            zygote.sendall(DONE)                # before the command hears: it may send the next at once
    replying.set()
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack("!i", rc))
    conn.close()


def _enter(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ["PKV_WORKER"] = "off"            # what this job starts runs in its own process
    sys.argv = [request["argv0"], *request["argv"]]


def _preload_shared() -> str:
    """The zygote's imports, none of which may initialize CUDA (a forked child could not use it);
    the reason not to serve, if one did."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")   # torch.cuda.is_available() by NVML
    # Forking beside the idle thread pools of OpenBLAS, Arrow and torch is safe: each
    # registers fork handlers (what torch's DataLoader relies on too).
    warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\)", category=DeprecationWarning)
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        import seaborn  # noqa: F401
    except ImportError:
        pass
    import pkv

    for mod in pkgutil.walk_packages(pkv.__path__, "pkv.", onerror=lambda name: None):
        if not mod.name.endswith("__main__"):
            with contextlib.suppress(Exception):     # a job that imports it reports the error
                importlib.import_module(mod.name)
    torch = sys.modules.get("torch")
    if "flashinfer" in sys.modules or (torch is not None and torch.cuda.is_initialized()):
        return "a preloaded module initialized CUDA"
    return ""


def _preload_gpu() -> None:
    """A GPU command's child's own imports: FlashInfer and the CUDA context."""
    import torch

    try:
        torch.cuda.init()
        import flashinfer  # noqa: F401
    except Exception as e:                      # a job that needs it reports it
        log(f"preload stopped: {type(e).__name__}: {e}")


def _mine(pid_file: Path) -> bool:
    try:
        return int(pid_file.read_text()) == os.getpid()
    except (OSError, ValueError):
        return False


def _exit_when_gone(conn: socket.socket, replying: threading.Event) -> None:
    """The command that handed us the job has died: end the job now. Once the exit code is
    on its way, the command closing its end is no longer a death."""
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
    print(f"{time.strftime('%H:%M:%S')} [{os.getpid()}] {text}", file=_LOG or sys.__stdout__, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pkv.cli.worker_serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", required=True, type=Path)
    p.add_argument("--idle-s", type=float, default=float(os.environ.get("PKV_WORKER_IDLE_S", IDLE_S)))
    args = p.parse_args(argv)
    global _LOG
    _LOG = os.fdopen(os.dup(1), "w", buffering=1)
    try:
        Zygote(args.socket, args.idle_s).serve()
    except OSError as e:                        # another worker took the socket first
        log(f"not serving: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
