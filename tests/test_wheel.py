"""The wheel: built from a copy of the tree, installed into a fresh venv, it carries csrc/ as
pkv/_csrc (so the JIT build finds its sources outside the checkout), a kernel-only base
install, and the API runs from it (no GPU needed: the decode runs its CPU oracle)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from pkv.kernels.loader import HEADERS, SOURCES

REPO = Path(__file__).resolve().parents[1]


def _run(*cmd, cwd, env=None):
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def _site_folders() -> list[str]:
    """The folders this interpreter imports installed packages from (its venv's, the system's, the user's)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]


def _digest(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in SOURCES + HEADERS}


def test_wheel_ships_csrc_and_installs_kernel_only(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", ".gitignore"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "csrc", src / "csrc")
    shutil.copytree(REPO / "pkv", src / "pkv", symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    # The copy as a checkout of its own, so the wheel has a commit to record.
    git = ("git", "-C", src, "-c", "user.name=test", "-c", "user.email=test@example.invalid")
    _run(*git, "init", "-q", cwd=tmp_path)
    _run(*git, "add", "-A", cwd=tmp_path)
    _run(*git, "commit", "-q", "-m", "wheel source", cwd=tmp_path)
    commit = _run("git", "-C", src, "rev-parse", "--short", "HEAD", cwd=tmp_path).strip()
    # As the README builds it, in the checkout: what it leaves there (build/, *.egg-info, the
    # wheel itself) is ignored, never an untracked file.
    _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", ".", cwd=src)
    assert _run("git", "-C", src, "status", "--porcelain", cwd=tmp_path) == ""
    wheel = next(src.glob("pkv-*.whl"))

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {f"pkv/_csrc/{n}" for n in SOURCES + HEADERS} <= names
    assert "pkv/api/op.py" in names
    base = [line.split(": ", 1)[1] for line in meta.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]
    assert sorted(b.split(">")[0].split("=")[0] for b in base) == ["ninja", "numpy", "torch"]
    assert 'snakemake>=9.0; extra == "pipeline"' in meta and "pkv[pipeline]" in meta
    assert "flashinfer-python<0.8,>=0.7" in meta

    # A fresh venv that sees this interpreter's packages (torch, numpy), whether it is the
    # system's Python or itself a virtualenv (where --system-site-packages would see the base
    # interpreter's, without torch): their folders are listed in a .pth file, which adds them
    # after the venv's own site-packages, so the wheel's pkv comes first on its path.
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    own_site = _run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))", cwd=tmp_path).strip()
    (Path(own_site) / "outer.pth").write_text("\n".join(_site_folders()) + "\n")
    _run(sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel, cwd=tmp_path)
    probe = ("import pkv, torch\n"
             "from pkv.kernels.loader import csrc_dir\n"
             "from pkv.api import decode\n"
             "kv = torch.randn(4, 2, 2, 16, 64).half()\n"
             "out = decode(torch.randn(1, 4, 64).half(), kv, torch.arange(4, dtype=torch.int32).view(1, 4),"
             " torch.tensor([50], dtype=torch.int32))\n"
             "print(pkv.__file__); print(csrc_dir()); print(bool(torch.isfinite(out).all()))\n"
             "print(pkv.version_line().split('(commit ')[1].split(';')[0])")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the checkout's pkv must not shadow the wheel's
    pkg_file, csrc, finite, built_from = _run(python, "-c", probe, cwd=tmp_path, env=env).split()
    assert built_from == commit   # `pkv --version` outside a checkout names the wheel's commit
    site = venv / "lib"
    assert Path(pkg_file).is_relative_to(site), pkg_file
    assert Path(csrc) == Path(pkg_file).parent / "_csrc" and not Path(csrc).is_symlink()
    assert _digest(Path(csrc)) == _digest(REPO / "csrc")
    assert finite == "True"
