"""The external trace's two replays (pkv.config.stages.EXTERNAL_REPLAYS): the headline at
external.prompt_scale (1: the trace as recorded) and, where the config gives
external.stress_scale, a stress test, labelled so in its title; the committed reference run
keeps its one replay, file and title (its hash: tests/test_reference_config.py) (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_trace_files import MOONCAKE, pkv, smoke

from pkv.config.errors import ConfigError
from pkv.config.jobs import check_job, stage_files
from pkv.config.resolve import load_schema, validate_config
from pkv.config.stages import EXTERNAL_REPLAYS, EXTERNAL_TITLE, STAGES, external_title
from pkv.config.typed import Config
from pkv.core.io import read_meta
from pkv.measure.stages import external_trace
from pkv.report.spec import TABLE_SPECS, in_all
from pkv.report.tables import targets

REPO = Path(__file__).resolve().parents[1]
STRESS = f"{EXTERNAL_TITLE}: stress test, prompts ×16"


def test_the_committed_reference_run_keeps_one_unlabelled_replay():
    """The reference run's frozen config (results/config.json) has no stress replay: one file, the
    trace's own title, no external_stress table among its targets."""
    committed = json.loads((REPO / "results" / "config.json").read_text())
    assert "stress_scale" not in committed["external"]
    assert list(stage_files(committed, "external")) == ["azure2023.parquet"]
    assert not stage_files(committed, "external_stress")
    assert external_title(committed["external"]) == EXTERNAL_TITLE
    assert Config.from_dict(committed).external.replay("external") == (16.0, EXTERNAL_TITLE)
    assert not in_all(TABLE_SPECS["external_stress"], "paper", committed)
    assert REPO / "results" / "tables" / "external_stress.md" not in targets(REPO / "results")


def test_a_stress_scale_adds_a_second_replay_labelled_a_stress_test():
    cfg = smoke(prompt_scale=1.0, stress_scale=16.0)
    validate_config(cfg, load_schema(), "config")
    assert set(EXTERNAL_REPLAYS) == {"external", "external_stress"}
    for stage in EXTERNAL_REPLAYS:
        assert list(stage_files(cfg, stage)) == ["azure2023.parquet"] and STAGES[stage].file == "{name}.parquet"
    c = Config.from_dict(cfg).external
    assert c.replay("external") == (1.0, EXTERNAL_TITLE)
    assert c.replay("external_stress") == (16.0, STRESS)
    spec = TABLE_SPECS["external_stress"]
    assert in_all(spec, "smoke", cfg) and "stress test" in spec.title


@pytest.mark.parametrize("scale", [0, -1, 2000])
def test_the_schema_refuses_a_stress_scale_out_of_range(scale):
    with pytest.raises(ConfigError, match=r"^config: external\.stress_scale: "):
        validate_config(smoke(stress_scale=scale), load_schema(), "config")


def test_no_stress_replay_is_measured_where_the_config_asks_for_none():
    cfg = smoke()
    cfg["external"].pop("stress_scale", None)
    with pytest.raises(ConfigError, match="measure external-stress: --trace"):
        check_job(cfg, "external_stress", trace="data/x.csv")
    with pytest.raises(ValueError, match=r"no external_stress replay \(external\.stress_scale\)"):
        external_trace(cfg, MOONCAKE, "external_stress")


def test_both_replays_run_and_are_titled_from_their_parquet(tmp_path):
    """freeze-config, calibrate, measure external and external-stress on the Mooncake sample with
    prompt_scale 1 and stress_scale 2; pkv report titles the headline as the trace (its prompts as
    recorded) and the stress test as one."""
    cfg = smoke(path=str(MOONCAKE), name="mooncake-sample", title="Mooncake sample", prompt_scale=1.0,
                stress_scale=2.0, max_requests=6)
    config, constants = tmp_path / "config.json", tmp_path / "calibration" / "constants.json"
    assert pkv("freeze-config", "--json", json.dumps(cfg), "--out", str(config)).returncode == 0
    done = pkv("calibrate", "--config", str(config), "--out", str(constants),
               "--raw", str(tmp_path / "raw" / "calibrate" / "calibration.parquet"))
    assert done.returncode == 0, done.stderr[-2000:]
    scales = {"external": 1.0, "external_stress": 2.0}
    for stage, scale in scales.items():
        out = tmp_path / "raw" / stage / "mooncake-sample.parquet"
        done = pkv("measure", STAGES[stage].command, "--config", str(config), "--constants", str(constants),
                   "--trace", str(MOONCAKE), "--out", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        assert set(pq.read_table(out).to_pandas()["stage"]) == {stage}
        meta = read_meta(out)
        assert json.loads(meta["trace_meta"])["transform"]["prompt_scale"] == scale
        assert meta["trace_title"] == ("Mooncake sample" if stage == "external" else
                                       "Mooncake sample: stress test, prompts ×2")
    tables = [tmp_path / "tables" / f"{stage}.md" for stage in scales]
    done = pkv("report", str(tmp_path), *(a for t in tables for a in ("--target", str(t))))
    assert done.returncode == 0, done.stderr[-2000:]
    headline, stress = (t.read_text() for t in tables)
    assert headline.startswith("# Mooncake sample\n") and "(mooncake request file, prompts as recorded)." in headline
    assert stress.startswith("# Mooncake sample: stress test, prompts ×2\n")
    assert "A stress test, not the trace as recorded" in stress
