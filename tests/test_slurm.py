"""The pipeline on a real single-node SLURM cluster, through snakemake-executor-plugin-slurm.

- The paper fan-out dry run through profiles/slurm needs no cluster and puts a GPU
  request (and, with profiles/slurm/h200, the pinned model) on every measuring job.
- The CPU smoke pipeline runs end to end through `--executor slurm` on a throw-away
  cluster (tests/slurm/cluster.sh: slurmctld + slurmd, auth/none, no slurmdbd, two fake
  GPUs of GRES type h200). One serving job is parked with its whole Parquet written under
  the temp name, just before the rename to the final name (tests/slurm/hold/
  sitecustomize.py), and scancel'ed there: the kill leaves no output under the final
  name, and the rerun submits exactly that job again. The outputs then equal a local run's.

"Equal" for timing-bearing outputs (see docs/cluster.md): the same files; each Parquet
file has the same columns and dtypes, the same number of rows and equal values in every
non-timing column (row keys, counters, routes, errors), and NaN in a timing column
exactly where the local run has NaN. The frozen config is byte-identical. Tables,
figures and the calibration constants carry measured times, so only their names are
compared; the local run reuses the SLURM run's frozen calibration so that everything
downstream of it (split choices, routes) can be compared exactly.

Needs root, Debian's slurmctld/slurmd/slurm-client and the plugin: with CI=true (or
PKV_SLURM_INSTALL=1) the fixture installs them with .ci/slurm-setup.sh; elsewhere, and
where they cannot be installed or the daemons do not start, the test is skipped and says
why. The daemons are always stopped (fixture finalizer).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from worktree import copy_worktree

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"
SETUP_SH = REPO / ".ci" / "slurm-setup.sh"
HOLD_HOOK = REPO / "tests" / "slurm" / "hold"  # sitecustomize.py: parks one serve job before its rename
SLURM_TOOLS = ("slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol", "scancel")
# The daemons install to /usr/sbin, which not every PATH (CI's included) need carry.
SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
GPU_TYPE = "h200"  # the fake GRES type; profiles/slurm/h200 pins to it
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
# Two held-out seeds instead of five keep the test within CI time (tests/slurm/two-seeds.yaml).
SMOKE_CONFIG = [] if os.environ.get("PKV_SLURM_TEST_FULL") == "1" else [
    "--configfile", str(REPO / "tests" / "slurm" / "two-seeds.yaml")]



pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (REPO / "Snakefile").is_file(), reason="no Snakefile: the pipeline is not in this tree"),
]


def _plugin_installed() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import snakemake_executor_plugin_slurm"], capture_output=True)
    return probe.returncode == 0


def _missing() -> list[str]:
    missing = [t for t in SLURM_TOOLS if shutil.which(t, path=SEARCH_PATH) is None]
    if not _plugin_installed():
        missing.append("snakemake-executor-plugin-slurm")
    return missing


def _install_if_ci() -> str | None:
    """With CI=true (or PKV_SLURM_INSTALL=1) install what is missing; a reason to skip, or None."""
    if _missing() and (os.environ.get("CI") == "true" or os.environ.get("PKV_SLURM_INSTALL") == "1"):
        r = subprocess.run(["bash", str(SETUP_SH)], capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            return f"could not install SLURM ({SETUP_SH.name} exit {r.returncode}): {(r.stdout + r.stderr)[-800:]}"
    return None


def _jobs_of_dry_run(text: str) -> list[tuple[str, dict[str, str]]]:
    """(rule, resources) for every job block that `snakemake -n` prints."""
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \S+:\n)", text):
        head = re.match(r"(?:local)?rule (\S+):\n", block)
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        if head and head.group(1) != "all":
            pairs = (kv.split("=", 1) for kv in res.group(1).split(", ")) if res else ()
            jobs.append((head.group(1), {k: v for k, v in pairs}))
    return jobs


# ---------------------------------------------------------------- dry run, no cluster


@pytest.fixture(scope="module")
def paper_dry_run(tmp_path_factory):
    reason = _install_if_ci()
    if reason or not _plugin_installed():
        pytest.skip(reason or "snakemake-executor-plugin-slurm is not installed "
                              "(pip install it, or run .ci/slurm-setup.sh)")
    work = copy_worktree(tmp_path_factory.mktemp("dry"), "results/smoke/")
    # No cluster reachable: a dry run must not need one.
    env = {**os.environ, "SLURM_CONF": str(work / "no-such-slurm.conf")}
    # --forceall: the full fan-out even where committed GPU results make jobs up to date.
    cmd = [*SNAKEMAKE, "--profile", "profiles/slurm", "--profile", f"profiles/slurm/{GPU_TYPE}",
           "-n", "--forceall", "all", "--config", "profile=paper"]
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    plain = subprocess.run([*SNAKEMAKE, "--profile", "profiles/slurm", "-n", "--forceall", "all",
                            "--config", "profile=paper"],
                           cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert plain.returncode == 0, plain.stdout[-3000:] + plain.stderr[-3000:]
    import yaml

    config = yaml.safe_load((work / "config.yaml").read_text())
    return _jobs_of_dry_run(r.stdout + r.stderr), _jobs_of_dry_run(plain.stdout + plain.stderr), config


def test_paper_dry_run_fans_out_with_gpu_requests(paper_dry_run):
    pinned, plain, config = paper_dry_run
    by_rule: dict[str, int] = {}
    for rule, _ in plain:
        by_rule[rule] = by_rule.get(rule, 0) + 1
    # The full fan-out: one serving job per engine set, over every point and held-out seed.
    expected_serve = len(config["engine_sets"])
    assert by_rule.get("serve_trace") == expected_serve, by_rule
    assert by_rule.get("calibrate_device") == 1, by_rule
    gpu_rules = {rule for rule, res in plain if res.get("gpu") == "1"}
    assert {"calibrate_device", "serve_trace"} <= gpu_rules
    # Presentation never asks for a GPU.
    assert not {r for r in gpu_rules if r.startswith(("report_", "plot_")) or r == "freeze_config"}
    # The pin profile covers every rule that asks for a GPU, and only those.
    for rule, res in pinned:
        assert (res.get("gpu_model") == GPU_TYPE) == (res.get("gpu") == "1"), (rule, res)


def test_the_pin_profile_names_every_rule_that_asks_for_a_gpu():
    """Every rule of workflow/rules/ with `gpu=1`, in `all` of a profile or a named target, has its
    entry in profiles/slurm/h200 (the dry run above sees only the rules of the paper `all`)."""
    import yaml

    gpu = set()
    for smk in (REPO / "workflow" / "rules").glob("*.smk"):
        for block in re.split(r"^(?=[ \t]*rule \w+:)", smk.read_text(), flags=re.M):   # a rule inside `if` too
            name = re.match(r"[ \t]*rule (\w+):", block)
            if name and re.search(r"^\s+gpu=1,", block, flags=re.M):
                gpu.add(name.group(1))
    pinned = yaml.safe_load((REPO / "profiles" / "slurm" / "h200" / "config.yaml").read_text())["set-resources"]
    assert "bench_feature_kernels" in gpu and gpu == set(pinned), gpu ^ set(pinned)


# ---------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    dir: Path
    env: dict

    def squeue(self) -> dict[str, dict[str, str]]:
        """Every job slurmctld still remembers (finished ones for MinJobAge=300 s)."""
        out = subprocess.run(["squeue", "-h", "-t", "all", "-O", "JobID:20|,State:20|,tres-per-job:60|,Comment:200|"],
                             env=self.env, capture_output=True, text=True, timeout=30)
        jobs = {}
        for line in out.stdout.splitlines():
            parts = [p.strip() for p in line.split("|")]
            if len(parts) >= 4 and parts[0]:
                jobs[parts[0]] = {"state": parts[1], "tres": parts[2], "comment": parts[3]}
        return jobs


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    if os.geteuid() != 0:
        pytest.skip("the SLURM test needs root (it runs slurmd and writes /etc/slurm/slurm.conf)")
    reason = _install_if_ci()
    if reason:
        pytest.skip(reason)
    missing = _missing()
    if missing:
        pytest.skip(f"SLURM test needs {', '.join(missing)}: run .ci/slurm-setup.sh (CI=true does it itself)")
    d = tmp_path_factory.mktemp("slurm")
    # Registered before starting, so that a half-started cluster is torn down too.
    request.addfinalizer(lambda: subprocess.run(["bash", str(CLUSTER_SH), "stop", str(d)], timeout=60))
    env = {**os.environ, "PKV_SLURM_GPU_TYPE": GPU_TYPE, "PKV_SLURM_GPUS": "2"}
    r = subprocess.run(["bash", str(CLUSTER_SH), "start", str(d)], env=env, capture_output=True, text=True,
                       timeout=180)
    if r.returncode != 0:
        pytest.skip(f"the SLURM daemons did not start (cluster.sh exit {r.returncode}): "
                    f"{(r.stdout + r.stderr)[-1500:]}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(d / "slurm.conf")
    return Cluster(d, env)


@dataclass
class SlurmRun:
    """A `snakemake --executor slurm` run; watches squeue and, given a hold folder, scancels
    the measuring job that tests/slurm/hold/sitecustomize.py parked before its rename."""

    cluster: Cluster
    work: Path
    hold: Path | None = None
    seen: dict[str, dict[str, str]] = field(default_factory=dict)
    submitted: dict[str, Path] = field(default_factory=dict)  # SLURM job id -> its SLURM log
    killed: str | None = None
    killed_paths: tuple[str, str] | None = None  # (final output, temp file) of the killed job
    output: list[str] = field(default_factory=list)
    returncode: int | None = None

    def command(self) -> list[str]:
        return [*SNAKEMAKE, "--profile", "profiles/slurm", "--profile", f"profiles/slurm/{GPU_TYPE}",
                "--workflow-profile", "none", *SMOKE_CONFIG, "--config", "profile=smoke",
                # No slurmdbd: no account to look up, and squeue instead of sacct.
                "--slurm-no-account", "--slurm-status-command", "squeue",
                "--slurm-init-seconds-before-status-checks", "2",
                # The profile's per-job requests are sized for a GPU node; this node has 2 CPUs.
                "--default-resources", "mem_mb=1000", "runtime=30", "cpus_per_gpu=1",
                "--keep-incomplete",  # a killed job's files stay, to check what it left
                "all"]

    def environment(self) -> dict[str, str]:
        if self.hold is None:
            return self.cluster.env
        self.hold.mkdir(parents=True, exist_ok=True)
        # sbatch exports the submitting environment (--export=ALL), so every job sees the hook.
        path = os.pathsep.join(filter(None, [str(HOLD_HOOK), self.cluster.env.get("PYTHONPATH", "")]))
        return {**self.cluster.env, "PYTHONPATH": path, "PKV_TEST_HOLD_DIR": str(self.hold)}

    def run(self, timeout: float) -> "SlurmRun":
        proc = subprocess.Popen(self.command(), cwd=self.work, env=self.environment(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        reader = threading.Thread(target=self._read, args=(proc,), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None:
                if time.monotonic() > deadline:
                    pytest.fail(f"the SLURM run took over {timeout:.0f} s:\n" + "".join(self.output[-80:]))
                self._watch()
                time.sleep(1)
        finally:
            if self.hold is not None:
                (self.hold / "release").touch()  # never leave a job parked
            if proc.poll() is None:
                proc.terminate()  # snakemake cancels its SLURM jobs on SIGTERM
                proc.wait(60)
        reader.join(10)
        self._watch()
        self.returncode = proc.returncode
        return self

    def _read(self, proc):
        for line in proc.stdout:
            self.output.append(line)
            m = re.search(r"submitted with SLURM jobid (\d+) \(log: (.+)\)", line)
            if m:
                self.submitted[m.group(1)] = Path(m.group(2))

    def _watch(self):
        for jobid, info in self.cluster.squeue().items():
            self.seen.setdefault(jobid, {}).update(info)
        claimed = self.hold / "claimed" if self.hold is not None else None
        if self.killed or claimed is None or not claimed.is_file():
            return
        jobid, final, temp = claimed.read_text().rstrip("\n").split("\t")
        subprocess.run(["scancel", jobid], env=self.cluster.env, check=True, timeout=30)
        self.killed, self.killed_paths = jobid, (final, temp)
        self.seen.setdefault(jobid, {})

    def text(self) -> str:
        return "".join(self.output)


def _snapshot(root: Path) -> dict[str, Path]:
    return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}


def _compare_parquet(a: Path, b: Path) -> list[str]:
    import numpy as np
    import pandas as pd

    from pkv.bench.host import MEASURED_TIMES as HOST_TIMES
    from pkv.bench.kernels import MEASURED_TIMES as KERNEL_TIMES
    from pkv.measure.loop import MEASURED_TIMES
    from pkv.measure.model_step import MEASURED_TIMES as MODEL_STEP_TIMES

    # Measured times (the router's own decision time included) are compared for presence
    # (NaN pattern) only; every other column is a key, a counter, a route, an error or a
    # model estimate and must match exactly.
    # meets_bar compares a measured time with its bar: timing too.
    timing = {*MEASURED_TIMES, *HOST_TIMES, *MODEL_STEP_TIMES, *KERNEL_TIMES, "meets_bar"}
    fa, fb = pd.read_parquet(a), pd.read_parquet(b)
    problems = []
    if list(fa.columns) != list(fb.columns):
        return [f"{a.name}: columns {list(fa.columns)} != {list(fb.columns)}"]
    if list(fa.dtypes.astype(str)) != list(fb.dtypes.astype(str)):
        problems.append(f"{a.name}: dtypes differ")
    if len(fa) != len(fb):
        return problems + [f"{a.name}: {len(fa)} rows != {len(fb)}"]
    for col in fa.columns:
        x, y = fa[col], fb[col]
        if col in timing:
            if not np.array_equal(x.isna().to_numpy(), y.isna().to_numpy()):
                problems.append(f"{a.name}:{col}: timing present in different rows")
        elif not x.equals(y):
            bad = int((x != y).sum())
            problems.append(f"{a.name}:{col}: {bad} of {len(x)} values differ")
    return problems


def test_smoke_pipeline_through_slurm_equals_local_and_recovers_from_scancel(cluster, tmp_path):
    slurm_work = copy_worktree(tmp_path / "slurm", "results/smoke/")
    local_work = copy_worktree(tmp_path / "local", "results/smoke/")
    smoke = Path("results/smoke")

    # 1. Through SLURM, one serving job parked between its temp write and its rename
    # (tests/slurm/hold/sitecustomize.py) and scancel'ed there.
    first = SlurmRun(cluster, slurm_work, hold=tmp_path / "hold").run(timeout=2400)
    assert first.killed, "no serve_trace job reached the hold:\n" + first.text()[-3000:]
    assert first.returncode != 0, "the run with a cancelled job must report the failure"
    killed = first.seen[first.killed]
    assert killed["state"] == "CANCELLED", killed
    assert killed["comment"].startswith("rule_serve_trace_"), killed
    # Every measuring job asked SLURM for one GPU of the pinned model.
    gpu_jobs = {j: i for j, i in first.seen.items() if i["tres"] != "N/A"}
    assert gpu_jobs and set(gpu_jobs) <= set(first.submitted)
    assert {i["tres"] for i in gpu_jobs.values()} == {f"gres:gpu:{GPU_TYPE}:1"}, gpu_jobs
    # ... and left its SLURM log (written by slurmd, so the job really ran under SLURM).
    missing_logs = [j for j in first.submitted if j != first.killed and not first.submitted[j].is_file()]
    assert not missing_logs, missing_logs
    # Presentation ran on the submit host (localrule), not through the queue.
    assert not [i for i in first.seen.values() if i["comment"].startswith(("rule_report_", "rule_plot_"))]

    # 2. Nothing complete-looking from the killed job: its whole Parquet was on disk under
    # the temp name only, and the kill left it there, not under the final name. Every
    # Parquet file under a final name is whole.
    import pyarrow.parquet as pq

    final, temp = (slurm_work / p for p in first.killed_paths)
    assert not final.exists(), f"the cancelled job left {final}"
    assert temp.is_file() and temp.name.startswith(".") and temp.name.endswith(".tmp"), temp
    for f in sorted((slurm_work / smoke / "raw").rglob("*.parquet")):
        pq.read_table(f)  # raises on a truncated file

    # 3. The rerun submits exactly the killed measuring job again (plus the tables/figures
    # downstream of it, on the submit host) and finishes.
    second = SlurmRun(cluster, slurm_work).run(timeout=1200)
    assert second.returncode == 0, second.text()[-4000:]
    resubmitted = {i["comment"] for j, i in second.seen.items() if j in second.submitted}
    assert resubmitted == {killed["comment"]}, resubmitted
    pq.read_table(final)

    # 4. A local run from the same frozen calibration (calibration itself is a timing).
    for rel in ("config.json", "calibration/constants.json", "raw/calibrate/calibration.parquet"):
        src = slurm_work / smoke / rel
        (local_work / smoke / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, local_work / smoke / rel)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    local = subprocess.run([*SNAKEMAKE, "--cores", "2", "all", *SMOKE_CONFIG, "--config", "profile=smoke"],
                           cwd=local_work,
                           env=env, capture_output=True, text=True, timeout=2400)
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    assert "calibrate_device" not in local.stdout + local.stderr, "the local run must reuse the frozen calibration"

    # 5. Outputs equal (module docstring says what "equal" means).
    ours = {k: v for k, v in _snapshot(slurm_work / smoke).items() if not k.startswith(("logs/", "benchmarks/"))}
    theirs = {k: v for k, v in _snapshot(local_work / smoke).items() if not k.startswith(("logs/", "benchmarks/"))}
    # The cancelled job's temp file, if the kill landed mid-write, is the one allowed extra.
    leftovers = {k for k in ours if Path(k).name.startswith(".") and k.endswith(".tmp")}
    assert set(ours) - leftovers == set(theirs)
    assert (slurm_work / smoke / "config.json").read_bytes() == (local_work / smoke / "config.json").read_bytes()
    problems = [p for k in sorted(theirs) if k.endswith(".parquet") for p in _compare_parquet(ours[k], theirs[k])]
    assert not problems, "\n".join(problems)
    assert any(k.startswith("raw/serve/") for k in theirs) and any(k.startswith("tables/") for k in theirs)
