"""Every command of the README's shell blocks works as written on a CPU machine, or is
named here as one this test cannot run (and why). Snakemake commands run as dry runs
(`-n`: the smoke run itself is tests/test_pipeline.py's), in a copy of the checkout;
`pkv` commands run for real there."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from worktree import REPO, copy_worktree

# Commands this test does not run, by their first words, and why.
NOT_RUN = {
    "pip install": "an install step (CI runs it in .ci/run)",
    "python3 -m pytest": "the test suite itself",
    "snakemake --profile profiles/slurm": "needs a SLURM cluster (tests/test_slurm.py plans and runs it on one)",
}


def readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip() and not line.startswith("#")]
    return commands


def _skip_reason(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    dest = copy_worktree(tmp_path_factory.mktemp("readme"), skip="results/smoke/")
    # The README's "your own request file" example names a file of yours: here, a small one.
    (dest / "my_requests.jsonl").write_text(
        "".join(f'{{"prompt_len": {200 * (i + 1)}, "decode_len": {8 + i}}}\n' for i in range(6)))
    return dest


def test_the_readme_has_commands():
    commands = readme_commands()
    assert any(c.startswith("snakemake") for c in commands) and any(c.startswith("pkv ") for c in commands)


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_works_as_written(command, tree):
    why = _skip_reason(command)
    if why:
        pytest.skip(f"not run here: {why}")
    args = shlex.split(command)
    if args[0] == "snakemake":
        args = [sys.executable, "-m", "snakemake", "-n", *args[1:]]
    elif args[0] == "pkv":
        args = [sys.executable, "-m", "pkv", *args[1:]]
    else:
        raise AssertionError(f"README command {command!r}: neither run nor named in NOT_RUN")
    done = subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
