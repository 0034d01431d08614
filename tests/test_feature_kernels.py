"""The kernel sweep's features rows on the CPU: their table from a synthetic Parquet
(pkv.report.features: the fastest FlashInfer path that ran a row's features, the winner, a row
without a baseline never a win), the config section that puts the stage in `all` (the smoke
profile's has one, the committed reference config not, its hash unchanged), and the bench's
smoke path (`pkv bench kernels --config` of a smoke run: the CPU engines, wall time)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from pkv.config.resolve import ConfigError, check_config, config_hash, effective, load_schema, validate_config
from pkv.config.stages import STAGES
from pkv.config.typed import Config
from pkv.core import io
from pkv.engines import table
from pkv.report import features
from pkv.report.spec import TABLE_SPECS, in_all, stages_in_all
from pkv.report.tables import _build_target, targets
from worktree import REPO, copy_worktree

RAW = yaml.safe_load((REPO / "config.yaml").read_text())
PAPER, SMOKE = effective(RAW, "paper"), effective(RAW, "smoke")
SECTION = {"feature_kernels": {"engines": ["pkv-graph", "flashinfer", "flashinfer-tc", "flashinfer-xqa"]}}
SPEC = TABLE_SPECS["feature_kernels"]
REFUSED = "ValueError: q_len_per_req > 1 requires tensor-core decode"


def row(case, engine, us, error="", window_left=-1, q_len=1, sinks=False, roofline=0.5):
    return dict(family="features", case=case, engine=engine, graph_us=us, cpu_us=math.nan, error=error,
                window_left=window_left, q_len=q_len, sinks=sinks, frac_of_roofline=roofline,
                timing="cuda-graph replay")


def synthetic() -> pd.DataFrame:
    """Four cases: pkv-graph wins one, XQA another, a third has only paths that refused it (no
    baseline), and in the fourth pkv-graph refused while FlashInfer ran."""
    nan = math.nan
    return pd.DataFrame([
        row("gpt-oss sliding B1 32K", "pkv-graph", 10.0, window_left=127, sinks=True, roofline=0.3),
        row("gpt-oss sliding B1 32K", "flashinfer", 14.0, window_left=127, sinks=True),
        row("gpt-oss sliding B1 32K", "flashinfer-tc", 12.0, window_left=127, sinks=True),
        row("gpt-oss sliding B1 32K", "flashinfer-xqa", nan, "ValueError: no sinks", window_left=127, sinks=True),
        row("spec q4 B8 8K", "pkv-graph", 20.0, q_len=4),
        row("spec q4 B8 8K", "flashinfer", nan, REFUSED, q_len=4),
        row("spec q4 B8 8K", "flashinfer-tc", 25.0, q_len=4),
        row("spec q4 B8 8K", "flashinfer-xqa", 16.0, q_len=4),
        # a time beside an error is no run: a refusal is never a candidate, however fast
        row("gemma-3 sliding B8 8K", "pkv-graph", 30.0, window_left=1023),
        row("gemma-3 sliding B8 8K", "flashinfer", 1.0, "RuntimeError: failed", window_left=1023),
        row("gemma-3 sliding B8 8K", "flashinfer-xqa", nan, "ValueError: d 256", window_left=1023),
        row("spec q8 B1 1K", "pkv-graph", nan, "RuntimeError: launch failed", q_len=8),
        row("spec q8 B1 1K", "flashinfer-xqa", 9.0, q_len=8),
    ])


def test_the_fastest_flashinfer_path_that_ran_the_features_is_the_baseline():
    s = features.summary(synthetic()).set_index("case")
    won = s.loc["gpt-oss sliding B1 32K"]
    assert (won.path, won.path_us, won.winner) == ("flashinfer-tc", 12.0, "pkv-graph")   # XQA refused: no candidate
    assert won.ratio == pytest.approx(1.2) and won.refused == ["flashinfer-xqa"]
    assert (won.window, won.sinks, won.q_len) == ("128", True, 1)
    lost = s.loc["spec q4 B8 8K"]
    assert (lost.path, lost.winner, lost.refused) == ("flashinfer-xqa", "flashinfer-xqa", ["flashinfer"])
    assert lost.ratio == pytest.approx(0.8) and lost.window == "full"


def test_a_row_no_flashinfer_path_ran_has_no_baseline_and_is_no_win():
    s = features.summary(synthetic()).set_index("case")
    none = s.loc["gemma-3 sliding B8 8K"]
    assert none.path == "" and math.isnan(none.ratio) and none.winner == features.NO_BASELINE
    assert none.refused == ["flashinfer", "flashinfer-xqa"]
    broken = s.loc["spec q8 B1 1K"]   # pkv-graph did not run: the path's row, not a win of ours
    assert broken.winner == "flashinfer-xqa (pkv-graph did not run)" and math.isnan(broken.ratio)
    assert features.winner(5.0, "flashinfer-tc", 5.0) == "tie"


def test_the_table_names_each_rows_winner_and_the_bar_as_measured(tmp_path):
    path = tmp_path / "features.parquet"
    io.write_parquet(synthetic(), path, {"command": "pkv bench kernels --suites features", "roofline_gbps": "4500"})
    text = features.table(*features.load(path))
    lines = {ln.split(" | ")[0].lstrip("| "): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert lines["gpt-oss sliding B1 32K"].endswith("| 12.0 | 1.200 | pkv-graph | flashinfer-xqa |")
    gemma = lines["gemma-3 sliding B8 8K"]
    assert "| 30.0 | 50.0 | none ran | – | – | no baseline | flashinfer, flashinfer-xqa |" in gemma
    assert "**1 of 3** rows that have one" in text
    assert "Lowest ratio: 0.800 (spec q4 B8 8K, against flashinfer-xqa)" in text
    assert "No FlashInfer path ran 1 of 4 rows (no baseline, not a win): gemma-3 sliding B8 8K." in text
    assert "CPU smoke" not in text and "CUDA-graph replay" in text


def test_the_smoke_rows_time_is_cpu_wall_and_says_so():
    frame = synthetic().assign(cpu_us=lambda f: f.graph_us, graph_us=math.nan, timing="cpu wall")
    text = features.table(frame, {"profile": "smoke", "length_scale": "0.0078125"})
    assert features.time_column(frame) == "cpu_us" and "CPU smoke — not a performance result" in text
    assert "lengths × 0.0078125" in text and "| 10.0 |" in text


def test_a_missing_parquet_is_one_line():
    with pytest.raises(ValueError, match="no features kernel benchmark Parquet.*--suites features"):
        features.load(REPO / "no" / "features.parquet")


# ---------------------------------------------------------------- the stage in `all`


def test_the_stage_is_in_all_where_the_config_has_its_section():
    assert in_all(SPEC, "smoke", SMOKE) and "feature_kernels" in stages_in_all("smoke", SMOKE)
    assert not in_all(SPEC, "paper", PAPER) and "feature_kernels" not in stages_in_all("paper", PAPER)
    paper = effective(RAW, "paper", SECTION)
    assert in_all(SPEC, "paper", paper) and "feature_kernels" in stages_in_all("paper", paper)
    assert STAGES["feature_kernels"].rules == ("bench_feature_kernels",) and STAGES["feature_kernels"].suites == (
        "features",)


def test_the_committed_reference_config_keeps_its_hash_and_tables():
    """The section is absent from config.yaml's top level: the reference run's config hash and
    its report's targets are what they were (the next reference run adds it)."""
    committed = json.loads((REPO / "results" / "config.json").read_text())
    assert "feature_kernels" not in PAPER and config_hash(committed) == config_hash(PAPER)
    assert REPO / "results" / "tables" / "feature_kernels.md" not in targets(REPO / "results")


def test_the_next_reference_runs_section_is_written_out_in_config_yaml():
    """config.yaml's comment holds the section the next reference run adds: it validates and names
    pkv-graph and every FlashInfer path that takes the features."""
    line = next(ln for ln in (REPO / "config.yaml").read_text().splitlines() if ln.startswith("#   feature_kernels:"))
    section = yaml.safe_load(line.lstrip("#"))
    assert section["feature_kernels"]["engines"] == list(table.feature_kernels())
    cfg = effective(RAW, "paper", section)
    validate_config(cfg, load_schema())
    check_config(cfg)


def test_the_section_validates_and_refuses_an_engine_without_the_features():
    for cfg in (SMOKE, effective(RAW, "paper", SECTION)):
        validate_config(cfg, load_schema())
        check_config(cfg)
        assert Config.from_dict(cfg).feature_kernels.engines[0] == table.PKV_KERNEL
    for engines, message in ((["pkv-graph", "flashinfer-persistent"], "'flashinfer-persistent', which takes no"),
                             (["flashinfer-tc"], "must name pkv-graph"),
                             (["pkv-graph", "pkv-graph"], "names an engine twice")):
        with pytest.raises(ConfigError, match=message):
            check_config(effective(RAW, "paper", {"feature_kernels": {"engines": engines}}))


@pytest.mark.parametrize("profile, extra", [("smoke", []), ("paper", ["run=reference"])])
def test_all_plans_the_stage_and_its_table(tmp_path, profile, extra):
    tree = copy_worktree(tmp_path, "results/")
    section = [] if profile == "smoke" else ["feature_kernels={engines: [pkv-graph, flashinfer-tc, flashinfer-xqa]}"]
    done = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "all", "--config",
                           f"profile={profile}", *extra, *section], cwd=tree, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", done.stdout, flags=re.M))
    assert counts.get("bench_feature_kernels") == "1" and counts.get("report_feature_kernels") == "1", counts
    shell = next(ln for ln in done.stdout.splitlines() if "--suites features" in ln)
    root = "results/smoke" if profile == "smoke" else "results"
    assert f"--config {root}/config.json" in shell
    engines = "pkv-graph" if profile == "smoke" else "pkv-graph flashinfer-tc flashinfer-xqa"
    assert f"--engines {engines} --out {root}/raw/kernels/features.parquet" in shell


# ---------------------------------------------------------------- the bench's smoke path


def test_a_smoke_config_runs_the_suite_on_the_cpu(tmp_path):
    """One case per attention of the suite, lengths x 1/128, the CPU engines only (the FlashInfer
    paths named are left out: none runs on a CPU), wall time in cpu_us, the run's hash and profile;
    and its table, built by `pkv report` like the rest (the smoke banner on it)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMOKE))
    out = tmp_path / "raw" / "kernels" / "features.parquet"
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "bench", "kernels", "--config", str(config),
                           "--suites", "features", "--engines", "pkv-graph", "flashinfer-xqa", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    frame, meta = pq.read_table(out).to_pandas(), io.read_meta(out)
    assert set(frame.engine) == {"pkv-graph"} and (frame.timing == "cpu wall").all()
    assert frame.cpu_us.gt(0).all() and frame.graph_us.isna().all() and (frame.error == "").all()
    assert len(frame) == len({(r.window_left, r.q_len, r.sinks, r.head_dim) for r in frame.itertuples()}) == 6
    assert frame.max_len.max() == 32 * 1024 // 128
    assert meta["profile"] == "smoke" and meta["config_hash"] == config_hash(SMOKE) and meta["complete"] == "true"
    text = _build_target(tmp_path, tmp_path / "tables" / "feature_kernels.md", {}).decode()
    assert "CPU smoke — not a performance result" in text and text.count("| no baseline |") == 6


def test_without_a_gpu_or_a_smoke_config_it_refuses_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "bench", "kernels", "--suites", "features",
                           "--out", str(tmp_path / "f.parquet")], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    if "needs a CUDA device" not in done.stderr:
        pytest.skip("a CUDA device is present")
    assert done.returncode != 0 and "Traceback" not in done.stderr
