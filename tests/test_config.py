"""The validated config: unknown keys refused at every level, held-out seeds kept from
calibration, typed command-line overrides, and frozen config and constants that must
belong together at every stage."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pkv.config.resolve import ConfigError, check_config, coerce, config_hash, effective, load_config
from pkv.core.io import write_parquet
from worktree import REPO, copy_worktree

SNAKEMAKE = [sys.executable, "-m", "snakemake"]
CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of the working tree without results/ (no reference run to compare with)."""
    return copy_worktree(tmp_path_factory.mktemp("tree"), "results/")


def dry(tree: Path, *args) -> subprocess.CompletedProcess:
    return subprocess.run([*SNAKEMAKE, "-n", "-p", "--cores", "1", "all", *args], cwd=tree, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("args, key", [
    (["--config", "profile=paper", "nsigth=True"], "'nsigth' was unexpected"),
    (["--config", "profile=paper", "measure={max_step: 4}"], "'max_step' was unexpected"),
    (["--config", "profile=smoke", "smoke={measure: {graf: false}}"], "'graf' was unexpected"),
])
def test_unknown_keys_are_refused_at_every_level_naming_the_key(tree, args, key):
    done = dry(tree, *args)
    assert done.returncode != 0
    assert key in done.stdout + done.stderr


def test_calibration_seed_among_held_out_seeds_is_refused(tree):
    done = dry(tree, "--config", "profile=paper", "seeds={calibration: 20260624}")
    assert done.returncode != 0
    assert "seeds.calibration 20260624 is also in seeds.heldout" in done.stdout + done.stderr
    cfg = effective(CONFIG, "paper")
    cfg["seeds"]["heldout"] = [*cfg["seeds"]["heldout"], cfg["seeds"]["calibration"]]
    with pytest.raises(ConfigError, match="calibration must never see a held-out seed"):
        check_config(cfg)


def test_nested_command_line_numbers_are_typed(tree):
    done = dry(tree, "--config", "profile=paper", "measure={max_steps: 4, holes: 0.25, graph: false}",
               "tolerance={max_abs: 1e-3}", "nsight=false")
    assert done.returncode == 0, done.stderr[-3000:]
    frozen = json.loads(next(line for line in done.stdout.splitlines() if "freeze-config" in line)
                        .split("--json ", 1)[1].rsplit(" --out", 1)[0].strip("'"))
    assert frozen["measure"] == {"max_steps": 4, "holes": 0.25, "reference_every": 16, "graph": False}
    assert frozen["tolerance"]["max_abs"] == 1e-3 and frozen["nsight"] is False


def test_coerce_follows_the_schema():
    cfg = {"measure": {"max_steps": "4", "holes": "0.5"}, "seeds": {"heldout": ["1", "2"]}, "nsight": "true",
           "policy": {"margins": [{"max_active": "3", "margin": "1.5"}]}, "shape": {"page_size": "16", "dtype": "16"},
           "engine_sets": {"main": ["adaptive"]}}
    coerce(cfg, SCHEMA)
    assert cfg["measure"] == {"max_steps": 4, "holes": 0.5} and cfg["seeds"]["heldout"] == [1, 2]
    assert cfg["nsight"] is True and cfg["policy"]["margins"] == [{"max_active": 3, "margin": 1.5}]
    assert cfg["shape"] == {"page_size": 16, "dtype": "16"}          # an enum of strings stays a string
    assert coerce({"measure": {"max_steps": "four"}}, SCHEMA) == {"measure": {"max_steps": "four"}}   # schema says why


def test_ablation_point_must_be_a_serving_point():
    cfg = effective(CONFIG, "paper")
    cfg["ablations"]["raggedness"]["max_active"] = 6
    with pytest.raises(ConfigError, match=r"ablations.raggedness uses \(bimodal, max_active 6\)"):
        check_config(cfg)


# ---------------------------------------------------------------- frozen config <-> constants


def _pkv(*args):
    return subprocess.run([sys.executable, "-m", "pkv", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture
def frozen(tmp_path):
    cfg = effective(CONFIG, "smoke")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "constants.json").write_text(json.dumps({"config_hash": "0000000000000000", "beta_bytes_per_s": 1e9}))
    return tmp_path, cfg


def test_measure_refuses_constants_frozen_for_another_config(frozen):
    d, cfg = frozen
    out = d / "serve.parquet"
    done = _pkv("measure", "serve", "--config", str(d / "config.json"), "--constants", str(d / "constants.json"),
                "--family", "bimodal", "--max-active", "8", "--seed", "20260623", "--engine-set", "main",
                "--out", str(out))
    assert done.returncode == 2 and not out.exists()
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(d / "constants.json") in lines[0]
    assert f"frozen for config hash 0000000000000000, but this config's hash is {config_hash(cfg)}" in lines[0]


def test_measure_refuses_a_frozen_config_with_a_held_out_calibration_seed(frozen):
    d, cfg = frozen
    cfg["seeds"]["calibration"] = cfg["seeds"]["heldout"][0]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="is also in seeds.heldout"):
        load_config(d / "config.json")
    done = _pkv("calibrate", "--config", str(d / "config.json"), "--out", str(d / "c.json"),
                "--raw", str(d / "r.parquet"))
    assert done.returncode == 2 and "is also in seeds.heldout" in done.stderr and not (d / "c.json").exists()


def test_nsight_parse_refuses_constants_of_another_config(frozen, tmp_path):
    import pandas as pd

    d, _ = frozen
    write_parquet(pd.DataFrame({"x": [1]}), d / "run.parquet", {"config_hash": "ffffffffffffffff"})
    (d / "ncu.csv").write_text("")
    done = _pkv("nsight-parse", "--csv", str(d / "ncu.csv"), "--run", str(d / "run.parquet"),
                "--constants", str(d / "constants.json"), "--out", str(d / "k.parquet"))
    assert done.returncode == 2 and "the profiled run" in done.stderr and not (d / "k.parquet").exists()


def test_constants_carry_the_config_hash_and_parquet_both(tmp_path):
    # The committed reference run: every measuring file names the frozen config's hash
    # and the constants file's, and the constants name the config's.
    from pkv.core.io import file_hash, read_meta

    root = REPO / "results"
    cfg = json.loads((root / "config.json").read_text())
    constants = root / "calibration" / "constants.json"
    assert json.loads(constants.read_text())["config_hash"] == config_hash(cfg)
    for f in (root / "raw" / "serve").glob("*.parquet"):
        meta = read_meta(f)
        assert meta["config_hash"] == config_hash(cfg) and meta["constants_hash"] == file_hash(constants)


def test_every_stage_validates_the_frozen_config_against_the_schema(frozen):
    d, cfg = frozen
    cfg["measure"]["max_step"] = 4   # a hand-edited frozen config with a typo
    (d / "config.json").write_text(json.dumps(cfg))
    done = _pkv("calibrate", "--config", str(d / "config.json"), "--out", str(d / "c.json"),
                "--raw", str(d / "r.parquet"))
    assert done.returncode == 2 and not (d / "c.json").exists()
    assert done.stderr.strip() == (f"pkv: error: {d / 'config.json'}: measure: Additional properties are not allowed "
                                   "('max_step' was unexpected)")


def test_a_config_file_that_contains_itself_through_an_alias_is_one_line(tree):
    """`a: &x [1, *x]` would make every reader of the config recurse without end (a
    RecursionError of a thousand lines): it is refused with its file and line; an alias
    that only repeats a node is fine."""
    (tree / "loop.yaml").write_text("measure: {holes: 0.0}\nbaselines: &x [reference, *x]\n")
    done = dry(tree, "--configfile", "config.yaml", "loop.yaml")
    said = done.stdout + done.stderr
    assert done.returncode != 0 and "RecursionError" not in said
    assert "loop.yaml:2: a YAML alias refers to the node that contains it" in said
    from pkv.config.resolve import read_config_file

    (tree / "repeat.yaml").write_text("a: &x {b: 1}\nc: *x\n")
    assert read_config_file(tree / "repeat.yaml") == {"a": {"b": 1}, "c": {"b": 1}}
