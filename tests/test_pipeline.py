"""The Snakemake pipeline: lint, config validation, the paper job graph, and the CPU smoke
profile end to end in a temporary copy of the working tree (Parquet schema and
provenance, every table and figure, report determinism, no output from a killed job,
and a rerun that resumes)."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from html import escape
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from pkv.config.resolve import SMOKE_BANNER, config_hash, effective
from pkv.config.stages import EXTERNAL_REPLAYS
from pkv.core.io import PROVENANCE_KEYS, file_hash, read_meta
from pkv.measure.loop import COLUMNS
from pkv.measure.model_step import COLUMNS as MODEL_STEP_COLUMNS
from pkv.report.spec import FIGURE_SPECS, TABLE_SPECS, in_all
from pkv.report.tables import targets
from worktree import copy_worktree


def smoke_targets(root: Path) -> list[Path]:
    """The tables and figures `all` makes on the smoke profile (pkv.report.spec)."""
    specs = {**{f"{n}.md": s for n, s in TABLE_SPECS.items()}, **{f"{n}.tex": s for n, s in TABLE_SPECS.items()},
             **{f"{n}.png": s for n, s in FIGURE_SPECS.items()}}
    return [p for p in targets(root) if in_all(specs[p.name], "smoke", SMOKE)]

REPO = Path(__file__).resolve().parents[1]
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
CALIBRATION = CONFIG["seeds"]["calibration"]
SMOKE = effective(CONFIG, "smoke")
HELDOUT = CONFIG["seeds"]["heldout"]


def snakemake(*args, cwd=REPO, check=True) -> subprocess.CompletedProcess:
    done = subprocess.run([*SNAKEMAKE, *args], cwd=cwd, capture_output=True, text=True, timeout=900)
    if check and done.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def test_lint_is_clean():
    done = snakemake("--lint")
    assert "Congratulations" in done.stdout + done.stderr


@pytest.mark.parametrize("override, message", [
    (["--config", "profile=fast"], "'fast' is not one of"),
    (["--config", "nsight=maybe"], "'maybe' is not of type 'boolean'"),
])
def test_bad_config_fails_at_start_with_the_schema_message(override, message):
    done = snakemake("-n", "--cores", "1", "all", *override, check=False)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr


def test_bad_nested_value_fails_before_any_job(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tolerance: {max_abs: -1.0, mean_abs: 3.0e-4}\n")
    done = snakemake("-n", "--cores", "1", "all", "--configfile", "config.yaml", str(bad), check=False)
    assert done.returncode != 0
    assert "-1.0 is less than or equal to the minimum of 0" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the working tree without results/, so the job graph is the full one."""
    return copy_worktree(tmp_path_factory.mktemp("tree"), "results/")


def _dry_run_jobs(tree: Path, *args) -> list[tuple[str, dict[str, str], str]]:
    """(rule, wildcards, shell command) of every job `snakemake -n -p` prints."""
    text = snakemake("-n", "-p", "--cores", "1", *args, cwd=tree).stdout
    jobs = []
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", text):
        m = re.match(r"(?:local)?rule (\w+):", block.strip())
        if not m:
            continue
        wc = re.search(r"^\s+wildcards: (.*)$", block, flags=re.M)
        wildcards = dict(kv.split("=", 1) for kv in wc.group(1).split(", ")) if wc else {}
        shell = re.search(r"^Shell command: (.*)$", block, flags=re.M)
        jobs.append((m.group(1), wildcards, shell.group(1) if shell else ""))
    return jobs


def test_paper_fan_out_on_any_machine(tree):
    # run=reference: the results/ paths below on any machine (with a GPU, `run: auto` would
    # plan a run of its own under results/runs/).
    jobs = _dry_run_jobs(tree, "all", "--config", "profile=paper", "run=reference")
    rules = [r for r, _, _ in jobs]
    assert rules.count("calibrate_device") == 1
    # One serving job per engine set, over every point and held-out seed in one process.
    serve = [(w, s) for r, w, s in jobs if r == "serve_trace"]
    assert ({w["engine_set"] for w, _ in serve} == set(CONFIG["engine_sets"])
            and len(serve) == len(CONFIG["engine_sets"]))

    def values(args, flag):
        """The arguments after `flag`, up to the next flag."""
        return list(itertools.takewhile(lambda a: not a.startswith("--"), args[args.index(flag) + 1:]))

    for w, shell in serve:
        args = shlex.split(shell.split(" > ")[0])
        jobs_run = list(zip(values(args, "--family"), map(int, values(args, "--max-active")),
                            map(int, values(args, "--seed"))))
        assert jobs_run == [(p["family"], p["max_active"], s) for p in CONFIG["serving"] for s in HELDOUT]
        assert [Path(o).name for o in values(args, "--out")] == [
            f"{f}-b{b}-s{s}-{w['engine_set']}.parquet" for f, b, s in jobs_run]
    # No held-out seed feeds calibration: it reads only the frozen config and runs the
    # calibration seed; every measuring job reads the frozen constants (but the kernel
    # benchmark, which routes nothing: it times fixed engines on fixed shapes).
    cal = next(s for r, _, s in jobs if r == "calibrate_device")
    assert "--config results/config.json" in cal and not any(str(s) in cal for s in HELDOUT)
    assert CALIBRATION not in HELDOUT
    # (The kernel benchmarks route nothing: they time fixed engines on fixed shapes.)
    unrouted = ("calibrate_device", "freeze_config", "all", "bench_kernels", "bench_fp8_kernels", "bench_fp8_accuracy",
                "build_kernels")
    measuring = [s for r, _, s in jobs if r not in unrouted and not r.startswith(("report_", "plot_"))]
    assert rules.count("bench_kernels") == 1
    assert measuring and all("--constants results/calibration/constants.json" in s for s in measuring)
    assert rules.count("sweep_b4") == 1   # every held-out seed in one process
    # Nsight is part of `all` (nsight: true in config.yaml, as in the committed run).
    assert rules.count("capture_nsight") == 1 and rules.count("parse_nsight") == 1
    # Paper outputs go to results/, never results/smoke/.
    assert not any("results/smoke" in s for _, _, s in jobs)


def test_nsight_leaves_all_when_disabled(tree):
    rules = [r for r, _, _ in _dry_run_jobs(tree, "all", "--config", "profile=paper", "run=reference", "nsight=false")]
    assert "capture_nsight" not in rules and "parse_nsight" not in rules


# ---------------------------------------------------------------- end to end, CPU smoke


HOSTILE_TITLE = "Trace `click <javascript:alert(1)>`_ javascript:alert(2)"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """A full smoke run in a copy of the tree, with two of the five held-out seeds (the
    dry-run test checks all five) to stay within CI time."""
    work = copy_worktree(tmp_path_factory.mktemp("pipeline"), "results/")
    # The external trace's title is a string of the config the HTML report shows: one that
    # is reStructuredText markup for a javascript: link must stay text.
    (work / "two-seeds.yaml").write_text(yaml.safe_dump({"smoke": {"seeds": {"heldout": HELDOUT[:2]},
                                                                   "external": {"title": HOSTILE_TITLE}}}))
    # Options that take several values go last, after the target.
    args = ("--configfile", "config.yaml", "two-seeds.yaml", "--config", "profile=smoke")
    t0 = time.perf_counter()
    done = snakemake("all", "--cores", "2", *args, cwd=work)
    return work, args, done, time.perf_counter() - t0


@pytest.mark.slow
def test_smoke_run_announces_itself_and_writes_only_under_results_smoke(smoke):
    work, _, done, seconds = smoke
    assert "SMOKE PROFILE" in done.stderr and SMOKE_BANNER in done.stderr
    assert sorted(p.name for p in (work / "results").iterdir()) == ["smoke"]
    print(f"smoke run (two held-out seeds): {seconds:.0f} s")


@pytest.mark.slow
def test_the_run_ends_naming_its_results_folder_and_tables(smoke):
    _, _, done, _ = smoke
    last = [line for line in done.stderr.splitlines() if line.startswith("*** results in ")]
    assert last and "results/smoke/tables/" in last[-1] and "serving.md" in last[-1], done.stderr[-2000:]


@pytest.mark.slow
def test_a_missing_measured_file_is_measured_again_and_its_tables_rebuilt(smoke, tmp_path):
    """Snakemake does not remake a missing input of an up-to-date table by itself (as if it
    were a temporary file): `all` names every measured file, so a deleted one, or those a
    killed job's outputs were removed for, is measured again and the tables reading it rebuilt."""
    work, args, *_ = smoke
    gone = work / "results" / "smoke" / "raw" / "isolated" / "ctx64.parquet"
    keep = tmp_path / gone.name
    shutil.copy2(gone, keep)
    gone.unlink()
    try:
        dry = snakemake("all", "-n", "--cores", "1", *args, cwd=work)
    finally:
        shutil.copy2(keep, gone)   # the module's run stays whole for the other tests
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, flags=re.M))
    assert counts.get("measure_isolated") == "1" and counts.get("report_isolated") == "1", dry.stdout[-3000:]
    assert "Nothing to be done" not in dry.stdout + dry.stderr


@pytest.mark.slow
def test_a_table_whose_input_is_gone_is_removed_not_left_stale(smoke, tmp_path):
    """A run that writes (here one whose own target is up to date) first removes each table
    and figure one of whose inputs is gone, naming it; `all` makes them again."""
    work, args, *_ = smoke
    root = work / "results" / "smoke"
    gone = root / "raw" / "isolated" / "ctx64.parquet"
    stale = [root / "tables" / "isolated.md", root / "tables" / "isolated.tex",
             root / "figures" / "latency_vs_context.png"]
    kept = [gone, *stale]
    for f in kept:
        shutil.copy2(f, tmp_path / f.name)
    gone.unlink()
    try:
        done = snakemake("--cores", "1", "results/smoke/tables/serving.md", *args, cwd=work)
        left = [f for f in stale if f.exists()]
    finally:
        for f in kept:   # the module's run stays whole for the other tests
            shutil.copy2(tmp_path / f.name, f)
    assert left == [] and "removed results/smoke/tables/isolated.md" in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_smoke_run_makes_every_table_and_figure(smoke):
    work, *_ = smoke
    root = work / "results" / "smoke"
    for path in smoke_targets(root):
        assert path.is_file() and path.stat().st_size > 0, path
        if path.suffix in (".md", ".tex"):
            assert SMOKE_BANNER in path.read_text(), path
    assert (root / "figures" / "serving_ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_parquet_schema_provenance_and_seeds(smoke):
    work, *_ = smoke
    root = work / "results" / "smoke"
    cfg = json.loads((root / "config.json").read_text())
    constants = root / "calibration" / "constants.json"
    files = sorted((root / "raw").rglob("*.parquet"))
    stages = {f.parent.name for f in files}
    stress = {"external_stress"} if cfg["external"].get("stress_scale") else set()   # EXTERNAL_REPLAYS
    # kernels: the features sweep's rows (the smoke profile's feature_kernels section)
    assert stages == {"calibrate", "serve", "isolated", "split_sensitivity", "b4_sweep", "gqa_sweep", "raggedness",
                      "implementation", "mlp_proxy", "external", "host", "model_step", "kernels", *stress}
    for f in files:
        schema = pq.read_schema(f)
        if f.parent.name == "model_step":   # the model step's own rows (pkv.measure.model_step)
            assert schema.names == list(MODEL_STEP_COLUMNS), f
        elif f.parent.name not in ("host", "kernels"):   # the benchmarks' own rows (pkv bench), not the loop's
            assert schema.names == list(COLUMNS), f
        meta = read_meta(f)
        assert set(PROVENANCE_KEYS) <= set(meta), f
        assert meta["profile"] == "smoke" and meta["gpu"] == "cpu"
        assert meta["config_hash"] == config_hash(cfg)
        if f.parent.name not in ("calibrate", "kernels"):   # the kernel benchmark routes nothing: no constants
            assert meta["constants_hash"] == file_hash(constants)
    cal = pq.read_table(root / "raw" / "calibrate" / "calibration.parquet").to_pandas()
    assert set(cal["seed"]) == {CALIBRATION}
    serve = [pq.read_table(f).to_pandas() for f in (root / "raw" / "serve").glob("*.parquet")]
    seeds = {int(s) for frame in serve for s in frame["seed"].unique()}
    assert seeds == set(HELDOUT[:2])
    for frame in serve:
        assert frame["route"].notna().all() and (frame["max_abs_err"] < 2e-3).all()
        assert frame["cuda_s"].isna().all() and frame["wall_s"].gt(0).all()
    assert json.loads(constants.read_text())["calibration_seed"] == CALIBRATION


@pytest.mark.slow
def test_report_regenerates_tables_bit_for_bit(smoke):
    work, *_ = smoke
    root = work / "results" / "smoke"
    tables = sorted((root / "tables").iterdir())
    before = {p.name: p.read_bytes() for p in tables}
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "report", str(root)], cwd=work, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    assert {p.name: p.read_bytes() for p in sorted((root / "tables").iterdir())} == before


@pytest.mark.slow
def test_failed_measurement_leaves_no_output(smoke, tmp_path):
    work, *_ = smoke
    root = work / "results" / "smoke"
    cfg = json.loads((root / "config.json").read_text())
    cfg["tolerance"] = {"max_abs": 1e-12, "mean_abs": 1e-12}   # every PKV engine now "fails"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    # Constants that belong to this config (every stage refuses constants of another one).
    constants = json.loads((root / "calibration" / "constants.json").read_text())
    (tmp_path / "constants.json").write_text(json.dumps({**constants, "config_hash": config_hash(cfg)}))
    out = tmp_path / "raw" / "serve.parquet"
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "measure", "serve",
                           "--config", str(tmp_path / "config.json"),
                           "--constants", str(tmp_path / "constants.json"), "--family", "bimodal",
                           "--max-active", "8", "--seed", str(HELDOUT[0]), "--engine-set", "main", "--out", str(out)],
                          cwd=work, capture_output=True, text=True)
    assert done.returncode == 2
    assert "max|e|" in done.stderr and "Traceback" not in done.stderr
    assert not out.exists() and not list(tmp_path.rglob("*.tmp"))


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, from /proc (children first found, then theirs)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(int(stat.parent.name))
    return kids + [d for k in kids for d in _descendants(k)]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the running job through /proc")
@pytest.mark.slow
def test_killed_run_leaves_no_complete_looking_output_and_a_rerun_resumes(smoke):
    work, args, *_ = smoke
    root = work / "results" / "smoke"
    serve = sorted((root / "raw" / "serve").glob("*.parquet"))
    # The serving job is one engine set over every point and seed: two of its files gone.
    jobs = sorted({p.stem.rsplit("-", 1)[1] for p in serve})
    victims = [serve[0], serve[-1]]
    kept = sorted((root / "raw" / "b4_sweep").glob("*.parquet"))   # another stage's files stay as they are
    assert len(jobs) == 1 and kept
    # The state of a run that died in the serve job: two of its files and everything after it missing.
    for v in victims:
        v.unlink()
    for done in [*(root / "tables").iterdir(), *(root / "figures").iterdir()]:
        done.unlink()
    stamps = {p: p.stat().st_mtime_ns for p in [*kept, root / "calibration" / "constants.json"]}
    logs = [root / "logs" / "serve" / f"{j}.log" for j in jobs]
    for log in logs:
        log.unlink()
    proc = subprocess.Popen([*SNAKEMAKE, "all", "--cores", "1", *args], cwd=work, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    # Kill the whole run while the first re-made serve job is running.
    while time.time() < deadline and not any(log.exists() for log in logs):
        time.sleep(0.1)
    # Kill snakemake and the job it is running (its own session), all by pid.
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:   # ended on its own meanwhile
            pass
    proc.wait()
    assert not any(v.exists() for v in victims), "a killed job left its output behind"
    assert not list((root / "raw").rglob("*.tmp"))
    # The rerun redoes only the serve job and the reports.
    dry = snakemake("all", "-n", "--rerun-incomplete", "--cores", "1", *args, cwd=work)
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, flags=re.M))
    assert counts.get("serve_trace") == "1", dry.stdout[-3000:] + dry.stderr[-3000:]
    measuring = {r for r in counts if not r.startswith(("report_", "plot_")) and r not in ("all", "total")}
    assert measuring == {"serve_trace"}, counts
    snakemake("--unlock", *args, cwd=work)   # the killed run's stale lock
    snakemake("all", "--rerun-incomplete", "--cores", "2", *args, cwd=work)
    assert all(v.exists() for v in victims)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.slow
def test_snakemake_report_embeds_every_table_and_figure_with_its_caption(smoke, tmp_path):
    work, args, *_ = smoke
    html = tmp_path / "report.html"
    snakemake("--report", str(html), *args, cwd=work)
    text = html.read_text(errors="replace")
    for path in smoke_targets(Path("results/smoke")):
        assert path.name in text, f"{path.name} is not in the report"
    for name, spec in TABLE_SPECS.items():
        # the config's, as text (a stress test's title begins with it)
        title = escape(HOSTILE_TITLE, quote=False) if name in EXTERNAL_REPLAYS else spec.title
        assert title in text or not in_all(spec, "smoke", SMOKE), title
    for spec in FIGURE_SPECS.values():
        assert spec.caption.split(",")[0] in text or not in_all(spec, "smoke", SMOKE), spec.caption
    assert "javascript:alert(1)" in text and not re.search(r"href=\\*[\"']?\s*javascript:", text, flags=re.I)


@pytest.mark.slow
def test_smoke_parquet_records_the_package_list(smoke):
    work, *_ = smoke
    f = next((work / "results" / "smoke" / "raw" / "serve").glob("*.parquet"))
    packages = read_meta(f)["packages"].splitlines()
    assert any(p.lower().startswith("torch==") for p in packages)
    assert any(p.lower().startswith("pandas==") for p in packages)
