"""Parquet results with provenance, written atomically.

Every file carries, as key-value metadata: git commit, host, GPU name (or "cpu") and UUID
(which of the host's GPUs measured it), SM count, driver, CUDA, torch and FlashInfer
versions, config hash, constants hash and the exact list of Python packages installed
where it was measured.
A file appears under its final name only once it is complete (temp file + rename).

Imports nothing heavy at module level (pandas, pyarrow and torch load inside the
functions that use them), so that the Snakefile and the report jobs start fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

PROVENANCE_KEYS = (
    "git_commit", "host", "gpu", "gpu_uuid", "sm_count", "driver", "cuda", "torch", "flashinfer", "config_hash",
    "constants_hash", "packages",
)


def file_hash(path: str | Path | None) -> str:
    """sha256 of a file's bytes (first 16 hex digits), or "none"."""
    if path is None or not Path(path).is_file():
        return "none"
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def dict_hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


@cache
def _git_commit() -> str:
    # A copy of the tree without git history (a lent GPU machine) names its commit here.
    if os.environ.get("PKV_GIT_COMMIT"):
        return os.environ["PKV_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        commit = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@cache
def _device_facts() -> dict:
    import torch

    facts = {"gpu": "cpu", "gpu_uuid": "none", "sm_count": "0", "driver": "none",
             "cuda": str(torch.version.cuda or "none")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        uuid = getattr(props, "uuid", None)   # nvidia-smi -L names the GPU of this UUID
        facts.update(gpu=props.name, gpu_uuid=f"GPU-{uuid}" if uuid else "unknown",
                     sm_count=str(props.multi_processor_count))
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            facts["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else "unknown"
        except (OSError, subprocess.SubprocessError):
            facts["driver"] = "unknown"
    return facts


def _flashinfer_version() -> str:
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:  # noqa: BLE001 - any failure means "not installed" here
        return "none"


@cache
def package_list() -> str:
    """Every installed Python distribution as sorted `name==version` lines: the exact
    environment a file was measured in (recorded as the `packages` metadata key)."""
    from importlib.metadata import distributions

    names = {}
    for d in distributions():
        name = d.metadata["Name"]
        if name:
            names[name.lower()] = f"{name}=={d.version}"
    return "\n".join(names[k] for k in sorted(names))


def provenance(config_hash: str = "none", constants_hash: str = "none") -> dict[str, str]:
    import torch

    return {
        "git_commit": _git_commit(),
        "host": platform.node(),
        **_device_facts(),
        "torch": torch.__version__,
        "flashinfer": _flashinfer_version(),
        "config_hash": config_hash,
        "constants_hash": constants_hash,
        "packages": package_list(),
    }


def _stage(path: Path, data: bytes) -> str:
    """`data` in a temp file beside `path` (made readable as the umask says); its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        # mkstemp makes the file 0600; results on a shared filesystem follow the umask instead.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _named(path: Path, e: OSError) -> OSError:
    """`e` with the path it failed on in its message ("No space left on device" alone names none)."""
    named = type(e)(f"{path}: cannot write ({e.strerror or e})")
    named.errno = e.errno
    return named


def check_writable(path: str | Path) -> None:
    """An output is only ever a regular file: a directory, a device (/dev/null, /dev/full), a
    FIFO, a socket or a symbolic link at `path` is refused in one OSError line, never renamed
    over (the atomic rename would replace the special file with a regular one)."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise _named(path, e) from None
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path}: is a directory, not a file that can be written")
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a special file (device, FIFO or socket)"
        raise OSError(f"{path}: is {kind}; an output must be a regular file or a new name")


def check_inside(path: str | Path, root: str | Path, flag: str, what: str) -> Path:
    """`path` (an output flag's value) is a regular file or a new name under `root`, the
    folder of the run it belongs to; else one OSError line naming `flag`. The path, resolved."""
    resolved = Path(path).resolve()
    base = Path(root).resolve()
    if not resolved.is_relative_to(base):
        raise OSError(f"{flag} {path}: outside {what} {base}; write the run's outputs inside its folder")
    check_writable(path)
    return resolved


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    atomic_write_many({Path(path): data})


def atomic_write_many(files: dict[Path, bytes]) -> None:
    """Write every file or none: each is staged beside its final name first (a directory
    in the way, a full disk or a read-only folder fails here, before any is replaced),
    then all are renamed into place (anything but a regular file at a name is refused
    first: check_writable); should a rename fail, the files already renamed get
    their old content back (each is kept as a hard link until all are in place). An
    OSError names the path it failed on."""
    staged: dict[Path, str] = {}
    kept: dict[Path, str | None] = {}   # replaced so far -> its old content's link (None: it was new)
    try:
        for path, data in files.items():
            path = Path(path)
            check_writable(path)
            try:
                staged[path] = _stage(path, data)
            except OSError as e:
                raise _named(path, e) from None
        for path, tmp in list(staged.items()):
            try:
                old = None
                if path.exists():
                    old = f"{tmp}.old"
                    try:
                        os.link(path, old)
                    except OSError:   # a filesystem without hard links: a copy
                        shutil.copyfile(path, old)
                kept[path] = old
                os.replace(tmp, path)
            except OSError as e:
                _restore(kept)
                kept = {}
                raise _named(path, e) from None
            del staged[path]
    finally:
        for tmp in staged.values():
            Path(tmp).unlink(missing_ok=True)
        for old in kept.values():
            if old is not None:
                Path(old).unlink(missing_ok=True)


def _restore(kept: dict[Path, str | None]) -> None:
    """Put back what atomic_write_many replaced before a rename failed."""
    for path, old in kept.items():
        if old is None:
            path.unlink(missing_ok=True)
        elif Path(old).exists():
            os.replace(old, path)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def write_parquet(frame: "pd.DataFrame", path: str | Path, meta: dict[str, str]) -> None:
    """Write `frame` with `meta` (provenance and anything else) as file metadata, atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    merged = {**(table.schema.metadata or {}), **{f"pkv.{k}".encode(): str(v).encode() for k, v in meta.items()}}
    table = table.replace_schema_metadata(merged)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def read_meta(path: str | Path) -> dict[str, str]:
    import pyarrow.parquet as pq

    raw = pq.read_schema(path).metadata or {}
    return {k.decode()[4:]: v.decode() for k, v in raw.items() if k.startswith(b"pkv.")}


def read_parquet_checked(path: str | Path, need: set[str], what: str,
                         missing_hint: str = "") -> tuple["pd.DataFrame", dict[str, str]]:
    """A benchmark's Parquet and its metadata; one ValueError line naming the file if it is
    missing (plus `missing_hint`: how to make it), unreadable or lacks a `need` column."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no {what} Parquet{missing_hint}")
    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises several types for a damaged file
        raise ValueError(f"{path}: unreadable Parquet ({type(e).__name__}: {e})") from e
    missing = need - set(frame.columns)
    if missing:
        raise ValueError(f"{path}: not the {what} Parquet (missing columns {sorted(missing)})")
    return frame, read_meta(path)
