"""Bad input never becomes a wrong table. One test (or a few) per numbered item below,
each reproducing what a hostile tester found, on the CPU:

1. the held-out seed discipline in every measuring command and in the report;
2. a duplicate Parquet file is refused, not counted twice;
3. command-line overrides win over the profile's section;
4. a hand-edited frozen config is refused by name;
5. a plan that cannot run fails before any job, and a changed config never leaves the
   old config's tables looking current;
6. `pkv report` writes all of its files or none;
7. NaN, non-integral integers, duplicate YAML keys and sizes above the limits are refused;
8. shell placeholders are quoted (a path with spaces and `$(...)`);
9. one line, never a traceback;
10. clear messages (the file, flag or line named).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pkv.config.jobs import STAGE_FILES, stage_files
from pkv.config.resolve import (
    ConfigError,
    check_config,
    config_hash,
    effective,
    load_config,
    load_schema,
    read_config_file,
    validate_config,
)
from pkv.config.seeds import check_seed
from pkv.core import io
from pkv.core.trace_files import TraceFileError, load_trace
from pkv.core.traces import MAX_LEN, MAX_REQUESTS, SyntheticSpec
from pkv.report.tables import ReportError, build_report, load
from test_report_trust import SEEDS, _config, _serve
from worktree import REPO, copy_worktree

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
SCHEMA = load_schema()
CAL = CONFIG["seeds"]["calibration"]


def pkv(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pkv", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def one_line(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a refused command (exit 2, no traceback)."""
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage:"), lines
    return lines[-1]


@pytest.fixture
def tree(tmp_path) -> Path:
    """A fresh copy of the working tree without results/ (each test its own)."""
    return copy_worktree(tmp_path / "tree", "results/")


def smk(tree: Path, *args, timeout=600) -> subprocess.CompletedProcess:
    """Snakemake in `tree`; its errors go to stdout or stderr by mode, so `stderr` holds both."""
    done = subprocess.run([*SNAKEMAKE, "--cores", "1", *args], cwd=tree, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    done.stderr = done.stdout
    return done


def dry(tree: Path, *args) -> subprocess.CompletedProcess:
    return smk(tree, "-n", "-p", "all", *args)


def frozen_json(done: subprocess.CompletedProcess) -> dict:
    line = next(line for line in done.stdout.splitlines() if "freeze-config" in line)
    return json.loads(shlex.split(line)[shlex.split(line).index("--json") + 1])


@pytest.fixture
def frozen(tmp_path):
    """A frozen smoke config and constants that belong to it (a job's two inputs)."""
    cfg = effective(CONFIG, "smoke")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "constants.json").write_text(json.dumps({"config_hash": config_hash(cfg)}))
    return tmp_path, cfg


def measure(d: Path, stage: str, *flags: str) -> subprocess.CompletedProcess:
    return pkv("measure", stage, "--config", str(d / "config.json"), "--constants", str(d / "constants.json"),
               *flags, "--out", str(d / "out.parquet"))


# ---------------------------------------------------------------- 1. the held-out discipline


@pytest.mark.parametrize("stage, flags, message", [
    ("serve", ["--family", "bimodal", "--max-active", "4", "--seed", str(CAL), "--engine-set", "main"],
     f"--seed {CAL} is the calibration seed"),
    ("serve", ["--family", "bimodal", "--max-active", "4", "--seed", "5", "--engine-set", "main"],
     "--seed 5 is not one of this config's seeds for the stage: serve runs on the held-out seeds"),
    ("raggedness", ["--seed", "20260625"], "--seed 20260625 is not one of this config's seeds for the stage: "
     "raggedness runs on the ablation seed seeds.ablation (20260623)"),
    ("b4-sweep", ["--seed", str(CAL)], f"--seed {CAL} is the calibration seed"),
    ("mlp-proxy", ["--seed", str(CAL)], f"--seed {CAL} is the calibration seed"),
    ("kv-fp8", ["--seed", str(CAL)], f"--seed {CAL} is the calibration seed"),
    ("isolated", ["--context", "100"], "--context 100 is not one of this config's (64, 256, 512)"),
    ("gqa-sweep", ["--group", "3"], "--group 3 is not one of this config's (1, 4, 8)"),
    ("split-sensitivity", ["--family", "zipf", "--max-active", "8"], "--family zipf is not one of this config's"),
])
def test_every_measuring_command_keeps_the_seed_discipline(frozen, stage, flags, message):
    d, _ = frozen
    line = one_line(measure(d, stage, *flags))
    assert message in line and not (d / "out.parquet").exists()


def test_one_seed_rule_for_config_commands_and_report():
    cfg = effective(CONFIG, "paper")
    check_seed(cfg, "calibrate", CAL)   # calibration alone may use it
    for stage in ("serve", "b4_sweep", "mlp_proxy", "raggedness", "isolated", "external"):
        with pytest.raises(ConfigError, match="is the calibration seed"):
            check_seed(cfg, stage, CAL)
    cfg["seeds"]["ablation"] = CAL
    with pytest.raises(ConfigError, match="seeds.ablation 20260622 is the calibration seed"):
        check_config(cfg)


def test_report_refuses_a_calibration_seed_file_by_name(tmp_path):
    h = _config(tmp_path)
    for seed in SEEDS:
        _serve(tmp_path, seed, config_hash=h)
    target = tmp_path / "tables" / "serving.md"
    build_report(tmp_path, [target])
    before = target.read_bytes()
    _serve(tmp_path, CAL, config_hash=h)   # the calibration seed measured as if held out
    bad = tmp_path / "raw" / "serve" / f"bimodal-b8-s{CAL}-main.parquet"
    line = one_line(pkv("report", "--target", str(target)))
    assert line.startswith(f"pkv: error: {bad}: seed {CAL} is the calibration seed")
    assert target.read_bytes() == before


# ---------------------------------------------------------------- 2. each file counted once


def test_a_copy_beside_its_original_is_refused_by_name(tmp_path):
    h = _config(tmp_path)
    for seed in SEEDS:
        _serve(tmp_path, seed, config_hash=h)
    orig = tmp_path / "raw" / "serve" / f"bimodal-b8-s{SEEDS[2]}-main.parquet"
    copy = orig.with_name(f"{orig.stem} (copy).parquet")
    shutil.copy(orig, copy)
    line = one_line(pkv("report", "--target", str(tmp_path / "tables" / "counters.md")))
    assert f"{copy}: not one of the files {tmp_path / 'config.json'} implies" in line
    assert not (tmp_path / "tables").exists()
    # A copy under another job's name: its rows say which job it is.
    copy.unlink()
    other = orig.with_name(f"bimodal-b8-s{SEEDS[1]}-main.parquet")
    shutil.copy(orig, other)
    with pytest.raises(ReportError, match=f"{other}: holds rows of seed {SEEDS[2]}, but its name says seed {SEEDS[1]}"):
        load(tmp_path, ("serve",))


def test_without_a_config_two_files_of_the_same_job_are_refused(tmp_path):
    for seed in SEEDS:
        _serve(tmp_path, seed)
    orig = tmp_path / "raw" / "serve" / f"bimodal-b8-s{SEEDS[0]}-main.parquet"
    shutil.copy(orig, orig.with_name("zz-copy.parquet"))
    with pytest.raises(ReportError, match=r"zz-copy.parquet: holds the same measurements as .*s20260623-main.parquet"):
        load(tmp_path, ("serve",))


def test_report_reads_exactly_the_files_the_pipeline_writes(tree):
    """pkv.config.jobs names the same files as the rules' outputs (paper and smoke)."""
    for args, profile in ((["--config", "profile=paper", "run=reference"], "paper"), ([], "smoke")):
        done = dry(tree, *args)
        assert done.returncode == 0, done.stderr[-2000:]
        outputs = set(re.findall(r"^\s+output: (.*)$", done.stdout, flags=re.M))
        paths = {p for line in outputs for p in line.split(", ")}
        cfg = frozen_json(done)
        root = "results" if profile == "paper" else "results/smoke"
        for stage in STAGE_FILES:
            made = {Path(p).name for p in paths if Path(p).parent == Path(root, "raw", stage)}
            if stage == "kv_fp8":   # a named target, outside `all`
                continue
            assert made == set(stage_files(cfg, stage)), (profile, stage)


# ---------------------------------------------------------------- 3. overrides apply


def test_command_line_values_win_over_the_smoke_section(tree):
    done = dry(tree, "--config", "measure={max_steps: 4}")
    assert done.returncode == 0, done.stderr[-2000:]
    frozen = frozen_json(done)
    assert frozen["profile"] == "smoke" and frozen["measure"]["max_steps"] == 4
    assert frozen["measure"]["reference_every"] == CONFIG["smoke"]["measure"]["reference_every"]   # rest of smoke:
    done = dry(tree, "--config", f"seeds={{heldout: [{CAL}]}}")
    assert done.returncode != 0 and f"seeds.calibration {CAL} is also in seeds.heldout" in done.stderr


def test_effective_applies_overrides_last():
    cfg = effective(CONFIG, "smoke", {"measure": {"max_steps": 4}, "run": "x"})
    assert cfg["measure"] == {**CONFIG["measure"], **CONFIG["smoke"]["measure"], "max_steps": 4}
    assert "run" not in cfg and "smoke" not in cfg
    assert effective(CONFIG, "smoke", {}) == effective(CONFIG, "smoke")


# ---------------------------------------------------------------- 4. a hand-edited frozen config


def test_a_hand_edited_frozen_config_is_refused_by_name(tree):
    done = dry(tree)
    cfg = frozen_json(done)
    frozen = tree / "results" / "smoke" / "config.json"
    frozen.parent.mkdir(parents=True)
    frozen.write_text(json.dumps(cfg))
    assert dry(tree).returncode == 0   # the same config: fine
    cfg["measure"]["max_steps"] = 2
    frozen.write_text(json.dumps(cfg))
    done = dry(tree)
    assert done.returncode != 0
    assert ("results/smoke/config.json: differs from what config.yaml and the command line resolve to, in "
            "measure.max_steps") in done.stderr


# ---------------------------------------------------------------- 5. plans that cannot run


def test_an_unplannable_seed_fails_before_any_job(tree):
    done = smk(tree, "all", "--config", "smoke={seeds: {heldout: [20260623, 100000000000000000000]}}")
    assert done.returncode != 0
    assert "smoke.seeds.heldout.1: 100000000000000000000 is greater than the maximum of 4294967295" in done.stderr
    assert not (tree / "results").exists()


def test_a_mistyped_external_path_is_named_before_any_job(tree):
    done = smk(tree, "all", "--config", "external={path: data/azure2023/typo.csv}")
    assert done.returncode != 0 and "config: external.path data/azure2023/typo.csv: no such file" in done.stderr
    assert not (tree / "results").exists()


def test_a_changed_config_never_runs_beside_the_old_tables(tree):
    cfg = frozen_json(dry(tree))
    root = tree / "results" / "smoke"
    (root / "tables").mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg))
    (root / "tables" / "serving.md").write_text("the old config's table\n")
    done = smk(tree, "all", "--config", "smoke={seeds: {heldout: [20260623]}}")
    assert done.returncode != 0 and "results/smoke/config.json: differs" in done.stderr
    assert "seeds.heldout" in done.stderr and "remove the folder to start over" in done.stderr
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == ["config.json", "tables",
                                                                             "tables/serving.md"]


# ---------------------------------------------------------------- 6. all tables or none


def test_report_writes_all_or_none_when_a_target_cannot_be_written(tmp_path):
    h = _config(tmp_path)
    for seed in SEEDS:
        _serve(tmp_path, seed, config_hash=h)
    serving, counters = tmp_path / "tables" / "serving.md", tmp_path / "tables" / "counters.md"
    build_report(tmp_path, [serving])
    before, mtime = serving.read_bytes(), serving.stat().st_mtime_ns
    counters.mkdir()
    line = one_line(pkv("report", "--target", str(serving), "--target", str(counters)))
    assert line == f"pkv: error: {counters}: is a directory, not a file that can be written"
    assert serving.read_bytes() == before and serving.stat().st_mtime_ns == mtime
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["counters.md", "serving.md"]


# ---------------------------------------------------------------- 7. NaN, integers, YAML, limits


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["policy"]["margins"][0].update(margin=float("nan")), "policy.margins.0.margin: nan is not a finite"),
    (lambda c: c["measure"].update(holes=float("nan")), "measure.holes: nan is not a finite number"),
    (lambda c: c["tolerance"].update(max_abs=float("inf")), "tolerance.max_abs: inf is not a finite number"),
    (lambda c: c["seeds"].update(ablation=20260623.0), "seeds.ablation: 20260623.0 is not of type 'integer'"),
    (lambda c: c["traces"]["bimodal"].update(num_requests=10**12),
     f"traces.bimodal.num_requests: 1000000000000 is greater than the maximum of {MAX_REQUESTS}"),
    (lambda c: c["calibration"].update(bandwidth_bytes=10**13),
     "calibration.bandwidth_bytes: 10000000000000 is greater than the maximum of 17179869184"),
])
def test_schema_refuses_nan_floats_for_integers_and_sizes_above_the_limits(edit, message):
    cfg = effective(CONFIG, "paper")
    edit(cfg)
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(cfg, SCHEMA)


def test_nan_in_a_config_file_fails_at_start_naming_the_key(tree):
    (tree / "bad.yaml").write_text("policy:\n  margins:\n    - {max_active: 1024, margin: .nan}\n")
    done = dry(tree, "--configfile", "config.yaml", "bad.yaml")
    assert done.returncode != 0 and "policy.margins.0.margin: nan is not a finite number" in done.stderr


def test_a_frozen_config_with_nan_is_refused_by_every_command(frozen):
    d, cfg = frozen
    cfg["measure"]["holes"] = float("nan")
    (d / "config.json").write_text(json.dumps(cfg))   # json writes NaN
    with pytest.raises(ConfigError, match=r"config.json: measure.holes: nan is not a finite number"):
        load_config(d / "config.json")


def test_freeze_config_never_freezes_what_every_command_would_refuse(tmp_path):
    cfg = effective(CONFIG, "smoke")
    cfg["measure"]["holes"] = float("nan")
    out = tmp_path / "config.json"
    line = one_line(pkv("freeze-config", "--json", json.dumps(cfg), "--out", str(out)))
    assert line == "pkv: error: freeze-config --json: measure.holes: nan is not a finite number" and not out.exists()


def test_a_key_given_twice_in_yaml_is_refused_with_its_line(tree, tmp_path):
    bad = tmp_path / "dup.yaml"
    bad.write_text("measure:\n  max_steps: 4\n  max_steps: 8\n")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(bad))}:3: key 'max_steps' given twice \(first on line 2\)"):
        read_config_file(bad)
    (tree / "dup.yaml").write_text(bad.read_text())
    done = dry(tree, "--configfile", "config.yaml", "dup.yaml")
    assert done.returncode != 0 and "dup.yaml:3: key 'max_steps' given twice" in done.stderr
    text = (tree / "config.yaml").read_text()
    (tree / "config.yaml").write_text(text.replace("nsight: true\n", "nsight: true\nnsight: false\n", 1))
    done = dry(tree)
    assert done.returncode != 0 and "key 'nsight' given twice" in done.stderr


def test_schema_limits_are_the_traces_limits():
    defs = read_config_file(REPO / "workflow" / "schemas" / "config.schema.yaml")["$defs"]
    assert defs["tokens"]["maximum"] == MAX_LEN and defs["requests"]["maximum"] == MAX_REQUESTS


# ---------------------------------------------------------------- 8. quoted shell placeholders


def test_every_placeholder_is_quoted(tmp_path):
    unquoted = []
    for f in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        shell = False
        for n, line in enumerate(f.read_text().splitlines(), 1):
            shell = line.strip() == "shell:" or (shell and line.strip().startswith('"'))
            if shell:
                unquoted += [f"{f.name}:{n}: {m}" for m in re.findall(r"\{[A-Za-z_][\w.]*(?![\w.]*:q)\}", line)]
                # A command substitution's output is split by the shell unless it is quoted too.
                unquoted += [f"{f.name}:{n}: {m}" for m in re.findall(r'(?<!\\")\$\([^)]*\)', line)]
    assert not unquoted


def test_a_path_with_spaces_and_command_substitution_is_one_argument(tree):
    odd = tree / "data" / "a b $(touch INJECTED).csv"
    shutil.copy(tree / CONFIG["external"]["path"], odd)
    over = tree / "odd.yaml"
    over.write_text(yaml.safe_dump({"external": {"path": str(odd)}}))
    done = dry(tree, "--configfile", "config.yaml", "odd.yaml")
    assert done.returncode == 0, done.stderr[-2000:]
    shells = re.findall(r"^Shell command: (.*)$", done.stdout, flags=re.M) or \
        [line for line in done.stdout.splitlines() if line.startswith("python3 -m ")]
    external = [s for s in shells if " measure external " in s]
    assert external and shlex.split(external[0])[shlex.split(external[0]).index("--trace") + 1] == str(odd)
    # And run for real: calibration, then the external job reads the file, and nothing is injected.
    # Unnamed, the trace is named after its file (pkv.config.stages.external_identity).
    done = smk(tree, "results/smoke/raw/external/a-b-touch-INJECTED.parquet", "--configfile", "config.yaml", "odd.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tree / "results" / "smoke" / "raw" / "external" / "a-b-touch-INJECTED.parquet").is_file()
    assert not list(tree.rglob("INJECTED"))


# ---------------------------------------------------------------- 9. one line, never a traceback


def test_deep_json_and_huge_csv_fields_are_one_line(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 1000 + "]" * 1000)
    assert one_line(pkv("trace", "show", "--file", str(deep))) == (
        f"pkv: error: {deep}: JSON nested deeper than 64 levels (pkv.core.trace_files.MAX_JSON_DEPTH); "
        "a request file is a list of flat objects")
    wide = tmp_path / "wide.csv"
    wide.write_text("prompt_len,decode_len\n4,4\n" + "1" * 200_000 + ",2\n")
    assert one_line(pkv("trace", "show", "--file", str(wide))) == (
        f"pkv: error: {wide}:line 3: not valid CSV (field larger than field limit (131072))")


@pytest.mark.parametrize("flags, message", [
    (["--file", "x.csv", "--step-ms", "inf"],
     "argument --step-ms: must be a finite number in (0, 86400000.0], got 'inf'"),
    (["--family", "bimodal", "--num-requests", "1000000000000"],
     f"argument --num-requests: must be in 1..{MAX_REQUESTS}, got 1000000000000"),
])
def test_bad_trace_flags_are_refused_before_any_work(flags, message):
    t0 = time.perf_counter()
    assert one_line(pkv("trace", "show", *flags)).endswith(message)
    assert time.perf_counter() - t0 < 30   # refused, not generated first


def test_huge_synthetic_trace_is_refused_before_generating():
    with pytest.raises(ValueError, match=f"num_requests must be in 1..{MAX_REQUESTS}"):
        SyntheticSpec("bimodal", 1, num_requests=10**8)


def test_unknown_engine_set_is_one_line(frozen):
    d, _ = frozen
    line = one_line(measure(d, "serve", "--family", "bimodal", "--max-active", "4", "--seed", "20260623",
                            "--engine-set", "nope"))
    assert line == "pkv: error: measure serve: --engine-set nope is not one of this config's (main)"


def test_paper_profile_on_a_machine_without_a_gpu(tree, frozen):
    if shutil.which("nvidia-smi"):
        pytest.skip("this machine has a GPU")
    # Planning it is fine (tests/test_fresh_clone.py: its report jobs run); each measuring
    # job refuses in one line.
    done = smk(tree, "results/runs/x/calibration/constants.json", "--config", "profile=paper", "run=x")
    assert done.returncode != 0
    log = (tree / "results" / "runs" / "x" / "logs" / "calibrate.log").read_text()
    assert log.strip().splitlines()[-1].startswith("pkv: error: profile paper: this config measures on a GPU, and "
                                                   "torch sees none") and "Traceback" not in log
    d, _ = frozen
    cfg = effective(CONFIG, "paper")
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "constants.json").write_text(json.dumps({"config_hash": config_hash(cfg)}))
    line = one_line(measure(d, "raggedness", "--seed", str(cfg["seeds"]["ablation"])))
    assert "profile paper: this config measures on a GPU, and torch sees none" in line


# ---------------------------------------------------------------- 10. clear messages


def test_a_corrupt_first_parquet_is_named_for_a_stage_without_files(tmp_path):
    _serve(tmp_path, SEEDS[0])
    first = tmp_path / "raw" / "b4_sweep" / "s1.parquet"   # sorts before raw/serve/
    first.parent.mkdir(parents=True)
    first.write_bytes(b"PAR1 not parquet")
    line = one_line(pkv("report", "--target", str(tmp_path / "tables" / "nsight.md")))
    assert line.startswith(f"pkv: error: {first}: unreadable Parquet")
    ref = tmp_path / "ref"
    _serve(ref, SEEDS[0])
    line = one_line(pkv("compare", str(tmp_path), "--reference", str(ref), "--out", str(tmp_path / "c.md")))
    assert line.startswith(f"pkv: error: {first}: unreadable Parquet") and not (tmp_path / "c.md").exists()


def test_a_corrupt_constants_file_is_named_not_blamed_on_the_parquet(tmp_path):
    h = _config(tmp_path)
    for seed in SEEDS:
        _serve(tmp_path, seed, config_hash=h)
    constants = tmp_path / "calibration" / "constants.json"
    constants.parent.mkdir()
    constants.write_text('{"config_hash": ')
    line = one_line(pkv("report", "--target", str(tmp_path / "tables" / "serving.md")))
    assert line.startswith(f"pkv: error: {constants}: not a readable constants file")
    constants.write_text(json.dumps({"config_hash": "0" * 16}))
    line = one_line(pkv("report", "--target", str(tmp_path / "tables" / "serving.md")))
    assert line.startswith(f"pkv: error: {constants}: frozen for config hash 0000000000000000, but")


@pytest.mark.parametrize("flags, message", [
    (["--family", "bimodal", "--seed", "-1"], "argument --seed: must be in 0..4294967295, got -1"),
    (["--file", "x.csv", "--step-ms", "nan"],
     "argument --step-ms: must be a finite number in (0, 86400000.0], got 'nan'"),
    (["--family", "bimodal", "--prompt-scale", "nan"],
     f"argument --prompt-scale: must be a finite number in (0, {MAX_LEN}], got 'nan'"),
])
def test_bad_flag_values_name_the_flag(flags, message):
    assert one_line(pkv("trace", "show", *flags)).endswith(message)


def test_measure_seed_flag_is_checked_by_type(frozen):
    d, _ = frozen
    assert one_line(measure(d, "b4-sweep", "--seed", "-1")).endswith(
        "argument --seed: must be in 0..4294967295, got -1")


def test_the_host_bench_keeps_the_seed_discipline(frozen):
    d, _ = frozen
    for seed, message in ((str(CAL), f"--seed {CAL} is the calibration seed"),
                          ("-1", "--seed -1 is not one of this config's seeds for the stage: "
                                 "host runs on the held-out")):
        line = one_line(pkv("bench", "host", "--config", str(d / "config.json"), "--seed", seed,
                            "--out", str(d / "host.parquet")))
        assert message in line and not (d / "host.parquet").exists()


def test_constants_without_a_key_are_named_not_a_traceback(frozen):
    d, _ = frozen   # constants.json holds its config hash and nothing else
    line = one_line(measure(d, "gqa-sweep", "--group", "4"))
    assert line == f"pkv: error: {d / 'constants.json'}: constants key 'device' missing; rerun the calibration " \
                   "(pkv measure calibrate) to rewrite it"
    assert not (d / "out.parquet").exists()


def test_a_full_disk_names_the_path(tmp_path, monkeypatch):
    def full(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io.os, "replace", full)
    target = tmp_path / "tables" / "serving.md"
    with pytest.raises(OSError, match=re.escape(f"{target}: cannot write (No space left on device)")):
        io.atomic_write_bytes(target, b"x")
    assert list((tmp_path / "tables").iterdir()) == []   # no temp file left behind


def test_a_rename_that_fails_midway_puts_back_what_was_replaced(tmp_path, monkeypatch):
    tables = tmp_path / "tables"
    tables.mkdir()
    a, b, c = tables / "a.md", tables / "b.md", tables / "c.md"
    a.write_text("old a")
    b.write_text("old b")
    real, calls = os.replace, []

    def fails_third(src, dst):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(io.os, "replace", fails_third)
    with pytest.raises(OSError, match=re.escape(f"{c}: cannot write (Input/output error)")):
        io.atomic_write_many({a: b"new a", b: b"new b", c: b"new c"})
    monkeypatch.undo()
    assert (a.read_text(), b.read_text()) == ("old a", "old b") and not c.exists()
    assert sorted(p.name for p in tables.iterdir()) == ["a.md", "b.md"]   # no temp or kept file left


def test_a_second_concurrent_run_is_told_the_folder_is_in_use(tree):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pkv.config.workflow import lock_folder; "
                               "lock_folder('results/smoke', hold=True); print('held', flush=True); time.sleep(120)"],
                              cwd=tree, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tree)})
    try:
        assert holder.stdout.readline().strip() == "held"
        for args in (["all"], ["-n", "all"]):
            done = smk(tree, *args)
            assert done.returncode != 0
            assert (f"results/smoke: another snakemake run (pid {holder.pid}) is writing this results folder; wait "
                    "for it to finish") in done.stderr
            assert "--rerun-incomplete" not in done.stderr
        assert not (tree / "results").exists()
    finally:
        holder.kill()
        holder.wait()
    assert dry(tree).returncode == 0   # the lock went with its process


def test_a_quoted_line_break_in_a_number_is_not_read_as_one_number(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text('prompt_len,decode_len\n"1\n00",2\n')
    with pytest.raises(TraceFileError, match=r"field 'prompt_len' must be an integer, got '1\\n00'"):
        load_trace(f)


def test_a_timestamp_with_a_timezone_is_refused_not_converted(tmp_path):
    f = tmp_path / "azure.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5,6\n"
                 "2023-11-16 18:15:47+02:00,5,6\n")
    with pytest.raises(TraceFileError, match=r"azure.csv:line 3: field 'TIMESTAMP' .* with a timezone"):
        load_trace(f)
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,5,6\n")
    assert len(load_trace(f)) == 1
