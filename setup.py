"""Build hook: a wheel records the commit it was built from as pkv/_commit.txt, so
`pkv --version` names it outside a git checkout. Everything else is in pyproject.toml."""

import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _git(*args: str) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=30)
    except OSError:   # no git on the build machine
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


class BuildPy(build_py):
    def run(self):
        super().run()
        commit = _git("rev-parse", "--short", "HEAD")
        if commit and not self.dry_run:
            dirty = "+dirty" if _git("status", "--porcelain", "--untracked-files=no") else ""
            (Path(self.build_lib) / "pkv" / "_commit.txt").write_text(commit + dirty + "\n")


setup(cmdclass={"build_py": BuildPy})
