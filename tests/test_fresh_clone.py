"""The committed reference run and your run, on a fresh `git clone` in a temporary folder.

- A fresh clone's paper dry run has nothing to do, whatever order the checkout wrote the
  files in: here every input of the reference run is made newer than every output (the
  worst case of checkout mtimes), and still nothing is planned.
- A paper run of your own goes to results/runs/<name>/ and ends in a comparison table
  against the reference; nothing under the reference run is written.
- A changed config is never run into the reference folder.

The clone is of this repository's HEAD; uncommitted changes of the working tree are laid
over it (CI runs on a clean clone, where there are none).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pkv.config.resolve import gpu_name, run_root
from worktree import REPO, copy_worktree

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# Without a GPU (CI), `run: auto` of the paper profile is the reference run. With one, it
# is a run of this machine's own, so name the reference explicitly there.
REFERENCE = [] if gpu_name() is None else ["run=reference"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(),
                                reason="needs git and a git checkout")


def snakemake(cwd: Path, *args, check=True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the clone's own pkv
    done = subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=900, env=env)
    if check and done.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def git_status(cwd: Path, *paths) -> str:
    return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all", "--", *paths], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    dest = tmp_path_factory.mktemp("fresh") / "repo"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True, timeout=600)
    copy_worktree(dest, "results/")   # the working tree's changes, if any, over HEAD
    # Untracked files laid over the clone are this test's doing, not a user's: commit them
    # locally so that `git status` below shows only what the pipeline writes.
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "working tree",
                    "--allow-empty"],
                   cwd=dest, check=True)
    # Worst-case checkout mtimes: every input of the reference run newer than every output.
    old, new = time.time() - 3600, time.time()
    for f in (dest / "results").rglob("*"):
        if f.is_file():
            os.utime(f, (old, old))
    for f in [dest / "results" / "config.json", dest / "results" / "calibration" / "constants.json",
              dest / "data" / "azure2023" / "AzureLLMInferenceTrace_conv.csv", *(dest / "results" / "raw").rglob("*")]:
        if f.is_file():
            os.utime(f, (new, new))
    assert not (dest / ".snakemake").exists()
    return dest


def test_fresh_clone_paper_dry_run_has_nothing_to_do(clone):
    done = snakemake(clone, "-n", "all", "--config", "profile=paper", *REFERENCE)
    assert "Nothing to be done" in done.stdout + done.stderr, done.stdout[-3000:]
    assert git_status(clone) == ""


def test_the_reference_runs_missing_metadata_is_said_once_and_the_report_stays_out_of_git(clone):
    """A clone has no .snakemake/ metadata of the reference run's files, and needs none (they
    are up to date by being there): one line says so, instead of Snakemake's "N jobs have
    missing provenance/metadata" and a "Missing metadata for file" per file of the report.
    The HTML report, in the checkout root or in the results folder, is not an untracked file."""
    said = "Snakemake has no metadata of its files here"
    done = snakemake(clone, "-n", "all", "--config", "profile=paper", *REFERENCE)
    text = done.stdout + done.stderr
    assert "missing provenance/metadata" not in text and text.count(said) == 1, text[-3000:]
    for where in ("report.html", "results/report.html"):
        done = snakemake(clone, "--report", where, "--config", "profile=paper", *REFERENCE)
        text = done.stdout + done.stderr
        assert "Missing metadata for file" not in text and text.count(said) == 1, text[-3000:]
        assert (clone / where).is_file()
    assert git_status(clone) == ""


def test_a_missing_reference_file_is_planned_and_nothing_else(clone, tmp_path):
    """The reference run is up to date by its files being there; one that is gone is made
    again (with the tables that read it), whatever the checkout's mtimes."""
    gone = clone / "results" / "raw" / "isolated" / "ctx8192.parquet"
    keep = tmp_path / gone.name
    shutil.copy2(gone, keep)
    gone.unlink()
    try:
        done = snakemake(clone, "-n", "all", "--config", "profile=paper", *REFERENCE)
    finally:
        shutil.copy2(keep, gone)
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", done.stdout, flags=re.M))
    measuring = {r for r in counts if not r.startswith(("report_", "plot_")) and r not in ("all", "total")}
    assert measuring == {"measure_isolated"}, done.stdout[-3000:]


def _planned_outputs(text: str) -> list[str]:
    outs = []
    for m in re.finditer(r"^\s+output: (.*)$", text, flags=re.M):
        outs += [o.strip() for o in m.group(1).split(",")]
    return outs


def test_your_run_lands_in_its_own_folder_with_a_comparison(clone):
    done = snakemake(clone, "-n", "all", "--config", "profile=paper", "run=mygpu-2026-11-30")
    text = done.stdout + done.stderr
    outputs = _planned_outputs(text)
    assert len(outputs) > 80
    assert all(o.startswith("results/runs/mygpu-2026-11-30/") for o in outputs), \
        [o for o in outputs if not o.startswith("results/runs/")][:5]
    assert "results/runs/mygpu-2026-11-30/tables/comparison.md" in outputs
    assert re.search(r"^compare_reference\s+1$", text, flags=re.M)


def test_run_folder_names():
    day = datetime.date(2026, 11, 30)
    assert run_root("paper", "auto", "NVIDIA H200", day) == "results/runs/nvidia-h200-2026-11-30"
    assert run_root("paper", "auto", None, day) == "results"          # no GPU here: the reference, to plan against
    assert run_root("paper", "reference", "NVIDIA H200", day) == "results"
    assert run_root("paper", "mine", "NVIDIA H200", day) == "results/runs/mine"
    assert run_root("smoke", "mine", None, day) == "results/smoke"


def test_finished_run_gets_a_comparison_and_the_reference_is_untouched(clone):
    # A finished measurement of your own: here the reference's own Parquet, copied in
    # the order a run writes them (config, constants, then the stages).
    run = clone / "results" / "runs" / "copy"
    ref = clone / "results"
    t = time.time() - 600
    trace = clone / "data" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"
    os.utime(trace, (t - 100, t - 100))   # the request file predates the run, as on a real machine
    for i, rel in enumerate(["config.json", "calibration/constants.json"]):
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ref / rel, run / rel)
        os.utime(run / rel, (t + i, t + i))
    for f in sorted((ref / "raw").rglob("*")):
        if f.is_file() and f.parent.name != "kernels":
            dest = run / f.relative_to(ref)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dest)
            os.utime(dest, (t + 10, t + 10))
    target = "results/runs/copy/tables/comparison.md"
    snakemake(clone, "--cores", "1", target, "--config", "profile=paper", "run=copy")
    text = (clone / target).read_text()
    assert "## Table 2: calibrated cost-model serving results" in text
    assert "Wall tok/s ratio (reference)" in text and "Wall tok/s ratio (this run)" in text
    assert "Configs: identical." in text
    row = next(line for line in text.splitlines() if line.startswith("| Bucketed B1 "))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == cells[2]   # the same Parquet on both sides: the same ratio
    # The reference run is byte for byte as committed; the run is the only new folder.
    assert git_status(clone, "results", ":(exclude)results/runs") == ""


def test_a_changed_config_never_runs_into_the_reference(clone):
    done = snakemake(clone, "-n", "all", "--config", "profile=paper", *REFERENCE, "nsight=false", check=False)
    assert done.returncode != 0
    text = done.stdout + done.stderr
    assert "differs from the committed reference run's in nsight" in text and "run=NAME" in text
