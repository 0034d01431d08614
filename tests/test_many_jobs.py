"""Several jobs of one stage in one process (pkv.config.stages `many`): `pkv measure serve
--seed S1 S2 --out F1 F2` writes one file per seed, each the job its seed names and equal
(outside measured times) to the same job run alone; every job's flags are checked before
the first one measures, and a mismatched or repeated flag list is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pkv.bench.host import MEASURED_TIMES as HOST_TIMES
from pkv.cli.main import main as pkv
from pkv.config.resolve import effective
from pkv.config.stages import STAGES
from pkv.core.io import read_meta
from pkv.measure.loop import MEASURED_TIMES

REPO = Path(__file__).resolve().parents[1]
SMOKE = effective(yaml.safe_load((REPO / "config.yaml").read_text()), "smoke")
A, B = SMOKE["seeds"]["heldout"][:2]
CAL = SMOKE["seeds"]["calibration"]


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """A frozen smoke config and its own smoke calibration (the router needs its constants)."""
    d = tmp_path_factory.mktemp("calibrated")
    (d / "config.json").write_text(json.dumps(SMOKE))
    assert pkv(["calibrate", "--config", str(d / "config.json"), "--raw", str(d / "calibration.parquet"),
                "--out", str(d / "constants.json")]) == 0
    return d


@pytest.fixture
def frozen(calibrated, tmp_path):
    for name in ("config.json", "constants.json"):
        (tmp_path / name).write_bytes((calibrated / name).read_bytes())
    return tmp_path


def serve(d: Path, seeds, outs) -> int:
    return pkv(["measure", "serve", "--config", str(d / "config.json"), "--constants", str(d / "constants.json"),
                "--family", "bimodal", "--max-active", "4", "--engine-set", "main",
                "--seed", *map(str, seeds), "--out", *map(str, outs)])


def test_every_many_flag_is_a_flag_of_its_stage():
    for name, stage in STAGES.items():
        assert set(stage.many) <= set(dict(stage.flags)), name


def test_one_process_writes_one_file_per_seed_equal_to_the_job_alone(frozen):
    both = [frozen / f"s{A}.parquet", frozen / f"s{B}.parquet"]
    assert serve(frozen, [A, B], both) == 0
    alone = frozen / "alone.parquet"
    assert serve(frozen, [B], [alone]) == 0
    for seed, path in zip((A, B), both):
        f = pd.read_parquet(path)
        assert set(f["seed"]) == {seed} and read_meta(path)["stage"] == "serve"
        # Each file names the command that measures its job alone.
        assert read_meta(path)["command"] == \
            f"pkv measure serve --family bimodal --max-active 4 --seed {seed} --engine-set main"
    timing = {*MEASURED_TIMES, *HOST_TIMES}
    x, y = pd.read_parquet(both[1]), pd.read_parquet(alone)
    keep = [c for c in x.columns if c not in timing]
    pd.testing.assert_frame_equal(x[keep], y[keep])


@pytest.mark.parametrize("seeds, outs, message", [
    ((A, B), ("a.parquet",), "2 --seed value(s) and 1 --out file(s)"),
    ((A, A), ("a.parquet", "b.parquet"), f"--seed names {A} more than once"),
    ((A, B), ("a.parquet", "a.parquet"), "more than once"),
    ((A, CAL), ("a.parquet", "b.parquet"), "calibration"),
])
def test_a_bad_list_is_refused_before_anything_is_measured(frozen, capsys, seeds, outs, message):
    assert serve(frozen, seeds, [frozen / o for o in outs]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not list(frozen.glob("*.parquet"))


def test_one_process_serves_several_points(frozen):
    """The serving rule's form: --family, --max-active and --seed one value per job (a flag
    given once holds for every job)."""
    outs = [frozen / "b4.parquet", frozen / "b8.parquet", frozen / "h8.parquet"]
    assert pkv(["measure", "serve", "--config", str(frozen / "config.json"), "--constants",
                str(frozen / "constants.json"), "--family", "bimodal", "bimodal", "homogeneous",
                "--max-active", "4", "8", "8", "--seed", str(A), "--engine-set", "main",
                "--out", *map(str, outs)]) == 0
    got = [(f["family"].iloc[0], int(f["max_active"].iloc[0]), int(f["seed"].iloc[0]))
           for f in map(pd.read_parquet, outs)]
    assert got == [("bimodal", 4, A), ("bimodal", 8, A), ("homogeneous", 8, A)]


def test_a_job_named_twice_across_points_is_refused(frozen, capsys):
    outs = [frozen / "a.parquet", frozen / "b.parquet"]
    assert pkv(["measure", "serve", "--config", str(frozen / "config.json"), "--constants",
                str(frozen / "constants.json"), "--family", "bimodal", "--max-active", "4", "4",
                "--seed", str(A), str(A), "--engine-set", "main", "--out", *map(str, outs)]) == 2
    err = capsys.readouterr().err
    assert f"--max-active/--seed names 4/{A} more than once" in err and len(err.strip().splitlines()) == 1, err
