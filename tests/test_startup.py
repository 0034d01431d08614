"""Job start-up: nothing heavy at Snakefile parse time, and each command imports only
what it uses (a table job no torch and no matplotlib, `pkv --help` nothing heavy)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "flashinfer", "pandas", "pyarrow", "numpy", "matplotlib", "seaborn", "tabulate")


def _loaded_after(code: str) -> set[str]:
    """Top-level modules of HEAVY that `code` leaves imported in a fresh interpreter."""
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n{code}\n"
             f"print(' '.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split()[-1:][0].split()) if done.stdout.split() else set()


def test_snakefile_parse_imports_nothing_heavy():
    # What the Snakefile imports from pkv (and nothing else of pkv) ...
    smk = (REPO / "workflow" / "rules" / "common.smk").read_text() + (REPO / "Snakefile").read_text()
    modules = set(re.findall(r"^from (pkv[\w.]*) import", smk, flags=re.M))
    modules |= set(re.findall(r"^import (pkv[\w.]*)", smk, flags=re.M))
    assert modules == {"pkv.config.gpus", "pkv.config.jobs", "pkv.config.resolve", "pkv.config.stages",
                       "pkv.config.typed", "pkv.config.workflow", "pkv.core.families", "pkv.engines.table",
                       "pkv.report.spec"}
    # ... loads none of the heavy modules (the schema's engine names come from the torch-free table).
    assert _loaded_after("import yaml, jsonschema\nimport pkv.config.gpus, pkv.config.jobs, pkv.config.resolve, "
                         "pkv.config.stages, pkv.config.typed, pkv.config.workflow, pkv.core.families, "
                         "pkv.engines.table, pkv.report.spec\n"
                         "pkv.config.resolve.load_schema()") == set()


def test_the_parse_of_the_whole_workflow_imports_nothing_heavy():
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "snakemake", "--list-rules", "--config",
                           "profile=paper"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    names = [line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    # Snakemake and its executor plugins import some of these themselves (tabulate, pandas);
    # torch and plotting never, and the workflow's own code (from pkv's first import on)
    # nothing heavy at all.
    assert not {"torch", "flashinfer", "matplotlib", "seaborn"} & set(names)
    first = names.index("pkv")
    assert not set(names[first:]) & set(HEAVY), sorted(set(names[first:]) & set(HEAVY))


def test_pkv_help_imports_nothing_heavy():
    assert _loaded_after("from pkv.cli.main import build_parser\nbuild_parser('')") == set()


def test_a_table_job_imports_no_torch_and_no_plotting(tmp_path):
    code = (f"from pkv.cli.main import main\nmain(['report', {str(REPO / 'results')!r}, '--target', "
            f"{str(REPO / 'results' / 'tables' / 'b4_sweep.md')!r}])")
    # Writes results/tables/b4_sweep.md again: run it on a copy of the reference run.
    import shutil

    shutil.copytree(REPO / "results" / "raw" / "b4_sweep", tmp_path / "raw" / "b4_sweep")
    code = code.replace(str(REPO / "results"), str(tmp_path))
    loaded = _loaded_after(code)
    assert "torch" not in loaded and "matplotlib" not in loaded and "seaborn" not in loaded
    assert (tmp_path / "tables" / "b4_sweep.md").is_file()


@pytest.mark.parametrize("command", [["--help"], ["report", "--help"], ["trace", "show", "--help"]])
def test_help_is_quick_to_import(command):
    code = f"from pkv.cli.main import build_parser, _command\nbuild_parser(_command({command!r}) or '')"
    assert "torch" not in _loaded_after(code)
