"""Reports that refuse to mix runs, name a bad file, write all or nothing, and say when a
seed is missing; and the comparison of a run against the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pkv.core.io import write_parquet
from pkv.report.compare import compare
from pkv.report.tables import ReportError, build_report, load
from test_report import _frame, _rows

SEEDS = (20260623, 20260624, 20260625)


def _meta(**over):
    meta = {"gpu": "NVIDIA H200", "profile": "paper", "torch": "2.11", "flashinfer": "0.7.2.post1", "cuda": "13.0",
            "config_hash": "c" * 16, "constants_hash": "k" * 16, "git_commit": "g", "stage": "serve"}
    return {**meta, **over}


def _serve(root: Path, seed: int, wall: float = 1.0, **meta):
    frame = _frame(_rows("flashinfer", 2.0, 1.0, seed), _rows("flashinfer-tc", 3.0, 0.5, seed),
                   _rows("adaptive", wall, 1.0, seed, route="pkv-workqueue/s8"))
    write_parquet(frame, root / "raw" / "serve" / f"bimodal-b8-s{seed}-main.parquet", _meta(**meta))


def _config(root: Path, seeds=SEEDS) -> str:
    """A frozen smoke config in `root` whose only serving point is these tests' (Bimodal
    B8, engine set main) on `seeds`; returns its hash."""
    import yaml

    from pkv.config.resolve import config_hash, effective

    cfg = effective(yaml.safe_load((Path(__file__).resolve().parents[1] / "config.yaml").read_text()), "smoke")
    cfg["seeds"]["heldout"] = list(seeds)
    cfg["serving"] = [{"family": "bimodal", "max_active": 8}]
    for key in ("split_sensitivity",):
        cfg["ablations"][key]["points"] = [{"family": "bimodal", "max_active": 8}]
    for key in ("b4_sweep", "raggedness", "implementation"):
        cfg["ablations"][key]["max_active"] = 8
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))
    return config_hash(cfg)


def _pkv(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "pkv", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.parametrize("key", ["config_hash", "constants_hash"])
def test_a_report_over_two_runs_is_refused(tmp_path, key):
    _serve(tmp_path, SEEDS[0])
    _serve(tmp_path, SEEDS[1], **{key: "d" * 16})
    with pytest.raises(ReportError, match=f"mixes results of several {key.replace('_', ' ')}es"):
        load(tmp_path, ("serve",))
    done = _pkv("report", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "tables").exists()


def test_files_must_match_the_folders_frozen_config(tmp_path):
    _config(tmp_path, SEEDS[:1])
    _serve(tmp_path, SEEDS[0])   # config_hash "ccc...", not this config.json's
    with pytest.raises(ReportError, match=r"config hash c{16} is not this folder's"):
        load(tmp_path, ("serve",))


def test_corrupt_parquet_is_named_in_one_line_and_nothing_is_rewritten(tmp_path):
    for seed in SEEDS[:2]:
        _serve(tmp_path, seed)
    build_report(tmp_path, [tmp_path / "tables" / "serving.md"])
    before = (tmp_path / "tables" / "serving.md").read_bytes()
    bad = tmp_path / "raw" / "serve" / f"bimodal-b8-s{SEEDS[2]}-main.parquet"
    bad.write_bytes(b"PAR1 this is not a parquet file")
    done = _pkv("report", str(tmp_path))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"pkv: error: {bad}: unreadable Parquet")
    assert "Traceback" not in done.stderr
    assert (tmp_path / "tables" / "serving.md").read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "tables").iterdir()) == ["serving.md"]
    assert not (tmp_path / "figures").exists()


def test_report_is_all_or_nothing(tmp_path):
    _serve(tmp_path, SEEDS[0])
    iso = tmp_path / "raw" / "isolated" / "ctx64.parquet"
    iso.parent.mkdir(parents=True)
    iso.write_bytes(b"garbage")
    with pytest.raises(ReportError, match="unreadable Parquet"):
        build_report(tmp_path, [tmp_path / "tables" / "serving.md", tmp_path / "tables" / "isolated.md"])
    assert not (tmp_path / "tables").exists()


def test_missing_results_folder_is_an_error_and_nothing_is_created(tmp_path):
    typo = tmp_path / "typo" / "path"
    done = _pkv("report", str(typo))
    assert done.returncode == 2 and f"{typo}: no such results folder" in done.stderr
    assert not (tmp_path / "typo").exists()
    done = _pkv("report", str(tmp_path))   # a folder, but not a results folder
    assert done.returncode == 2 and "no raw/ inside" in done.stderr and not (tmp_path / "tables").exists()


def test_missing_seed_is_flagged_in_the_table(tmp_path):
    config = _config(tmp_path)
    for seed in (SEEDS[0], SEEDS[2]):
        _serve(tmp_path, seed, config_hash=config)
    build_report(tmp_path, [tmp_path / "tables" / "serving.md", tmp_path / "tables" / "serving.tex"])
    md = (tmp_path / "tables" / "serving.md").read_text()
    assert f"| 2 of 3 (missing {SEEDS[1]})" in md
    assert "**Missing seeds**" in md and f"serve: Bimodal B8 lacks seed(s) {SEEDS[1]}" in md
    assert f"lacks seed(s) {SEEDS[1]}" in (tmp_path / "tables" / "serving.tex").read_text()


def test_complete_tables_do_not_change(tmp_path):
    # The committed reference run's tables are what the report still makes from its Parquet.
    repo = Path(__file__).resolve().parents[1] / "results"
    out = tmp_path / "ref"
    for rel in ("config.json", "calibration/constants.json"):
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes((repo / rel).read_bytes())
    for f in (repo / "raw").rglob("*.parquet"):
        (out / f.relative_to(repo)).parent.mkdir(parents=True, exist_ok=True)
        (out / f.relative_to(repo)).write_bytes(f.read_bytes())
    targets = [out / "tables" / f"{n}.md" for n in ("serving", "b4_sweep", "mlp_proxy", "coverage")]
    build_report(out, targets)
    for t in targets:
        assert t.read_bytes() == (repo / "tables" / t.name).read_bytes(), t.name


def test_compare_puts_ratios_side_by_side(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    for seed in SEEDS[:2]:
        _serve(ref, seed, wall=1.0)
        _serve(run, seed, wall=2.0)
    text = compare(run, ref)
    assert "## Table 2: calibrated cost-model serving results" in text
    header = next(line for line in text.splitlines() if line.startswith("| Trace / mode"))
    assert "Wall tok/s ratio (reference)" in header and "Wall tok/s ratio (this run)" in header
    row = next(line for line in text.splitlines() if line.startswith("| Bimodal B8"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    cells = dict(zip(cols, (c.strip() for c in row.strip("|").split("|"))))
    assert cells["Wall tok/s ratio (reference)"].startswith("2.000±")
    assert cells["Wall tok/s ratio (this run)"].startswith("1.000±")
    assert "## Table 1" in text and "Not measured in reference and this run." in text


def test_compare_never_pairs_two_different_external_traces(tmp_path):
    """A run replaying its own request file is compared by name, not row by row with the reference's."""
    ref, run = tmp_path / "ref", tmp_path / "run"
    from pkv.config.resolve import config_hash

    for root, external in ((ref, {}), (run, {"path": "/data/code.jsonl", "title": "Code completions"})):
        _config(root, SEEDS[:1])
        cfg = json.loads((root / "config.json").read_text())
        cfg["external"].update(external)
        (root / "config.json").write_text(json.dumps(cfg))
        _serve(root, SEEDS[0], config_hash=config_hash(cfg), profile="smoke")
    text = compare(run, ref)
    assert "## Code completions\n" in text
    assert "Not compared: this run replays the external trace 'code', the reference run 'azure2023'." in text


def _tampered(root: Path, seed: int, edit) -> Path:
    """Seed `seed`'s serving file rewritten by `edit(frame) -> frame` (its metadata kept)."""
    import pyarrow.parquet as pq

    from pkv.core.io import read_meta

    f = root / "raw" / "serve" / f"bimodal-b8-s{seed}-main.parquet"
    meta = read_meta(f)
    write_parquet(edit(pq.read_table(f).to_pandas()), f, meta)
    return f


def _bitflipped(frame):
    frame.loc[frame["engine"] == "adaptive", "wall_s"] = 1e-23
    return frame


def _textual(frame):
    return frame.assign(wall_s=frame["wall_s"].map(str))


@pytest.mark.parametrize("edit, message", [
    (_bitflipped, r"column wall_s row \d+ \(engine adaptive, step 0\) is 1e-23 s, outside a plausible"),
    (lambda frame: frame.drop(columns="wall_s"), r"no column wall_s: not a complete serve file"),
    (_textual, r"column wall_s holds (object|str|string) values, not times in seconds"),
    (lambda frame: frame.assign(cuda_s=frame["cuda_s"].where((frame["engine"] != "adaptive") | (frame["step"] != 1),
                                                             1e-6)),
     r"column cuda_s row \d+ \(engine adaptive, step 1\) is 1e-06 s, 5e\+05 times off the same step's other "
     r"engines \(median 0.5 s\)"),
])
def test_a_damaged_times_column_is_refused_naming_file_and_column(tmp_path, edit, message):
    for seed in SEEDS:
        _serve(tmp_path, seed)
    bad = _tampered(tmp_path, SEEDS[1], edit)
    with pytest.raises(ReportError, match=rf"^{bad}: {message}"):
        load(tmp_path, ("serve",))
    for command in (("report", str(tmp_path)), ("compare", str(tmp_path), "--reference", str(tmp_path))):
        done = _pkv(*command)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert len(done.stderr.strip().splitlines()) == 1 and str(bad) in done.stderr
    assert not (tmp_path / "tables").exists()


def test_device_times_not_measured_are_fine(tmp_path):
    """On the CPU cuda_s is NaN: not a damaged value."""
    for seed in SEEDS:
        _serve(tmp_path, seed)
    _tampered(tmp_path, SEEDS[0], lambda frame: frame.assign(cuda_s=float("nan")))
    assert len(load(tmp_path, ("serve",)).frame) == 9 * len(SEEDS)
