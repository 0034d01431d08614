"""One warm process for the pipeline's commands.

Each job of the pipeline is a `python3 -m pkv.cli ...` command, and most of a short one is
start-up: importing torch, pandas and FlashInfer and creating the CUDA context take ~8 s
on the H200, against ~1.5 s for a serving point's measured loop. With PKV_WORKER=on (the
Snakefile sets it, workflow/rules/common.smk) a command hands its argv, working folder,
environment and stdout/stderr to a worker instead (pkv/cli/worker_serve.py): a zygote that
has imported torch, pandas, matplotlib and pkv without initializing CUDA, and runs each
command in a child forked from it. A job's exit code, output and files are those of a
process of its own, because it is one; only its start-up is gone.

What keeps that true:
- A worker is keyed by everything a warm process would carry over: the interpreter, the
  environment (all of it, as an import or a build may read any variable) and the sizes and
  mtimes of pkv/ and csrc/. Any change starts another worker; the old one idles out.
- Every command runs in a fresh child, so nothing a job loads, sets or allocates reaches the
  next one. On a GPU that is measured, not only tidy (docs/pipeline.md, "One warm process"):
  pkv-graph's B8 64K/128K kernel rows ran 13 % slower in a process that had run the model
  step before them, so every GPU job gets a CUDA context nothing else has allocated in.
- The child due to run the next command is forked while the current one runs and, on a GPU
  machine, imports FlashInfer and creates its CUDA context there (FlashInfer's import
  initializes CUDA, so the zygote cannot preload it); a command starts only once its child's
  preload is done (a thread importing beside a timed job slowed B1 1K's graph replay from
  10.6 to ~15 us on the H200).
- One job at a time. A command that finds the worker busy runs in its own process.
- A command that dies (Snakemake killing the job) ends its child at once: no job outlives
  its command.
- The worker's own commands run with PKV_WORKER=off (the Nsight stage's child runs under
  ncu in a process of its own); an idle worker exits after PKV_WORKER_IDLE_S (30 s).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
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
    """Start the worker for `path` unless one is on its way (its pid in `.coming`), then connect."""
    with _locked(path):
        conn = _connect(path)
        if conn is not None:
            return conn
        if not _alive(path.with_suffix(".coming")):
            _start(path, os.environ)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while time.monotonic() < deadline and _alive(path.with_suffix(".coming")):
        conn = _connect(path)
        if conn is not None:
            return conn
        time.sleep(0.01)
    return _connect(path)


@contextlib.contextmanager
def _locked(path: Path):
    """The lock every change of who serves `path` is made under (short: nobody waits in it)."""
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
        return True
    except (OSError, ValueError):
        return False


def _start(path: Path, environ) -> None:
    """A worker for `path` (called under _locked): it serves once `path` has nobody alive behind
    it. Its pid is in `.coming` until then, so that nobody starts a second one."""
    env = {**environ, "PKV_WORKER": "off",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [environ.get("PYTHONPATH")])])}
    with open(path.with_suffix(".log"), "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pkv.cli.worker_serve", "--socket", str(path)],
                                cwd="/", env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    path.with_suffix(".coming").write_text(str(proc.pid))


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
