"""A copy of this checkout's working tree for tests that run the pipeline in isolation."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def copy_worktree(dest: Path, skip: str) -> Path:
    """The working tree as git sees it (tracked + untracked, not ignored) copied to `dest`,
    without the files under `skip` (a path prefix such as "results/")."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if rel.startswith(skip) or not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    return dest
