"""A stage is one row of pkv.config.stages and a function: from the row alone come its job
grid, its seed rule, its files, the paths its rule makes and the tables reading it wait
for (workflow/rules/common.smk's stage_outputs), and its `pkv measure` subcommand."""

from __future__ import annotations

import pytest
import yaml

from pkv.cli.main import build_parser
from pkv.cli.pipeline import check_args, jobs_of
from pkv.config import jobs, seeds, stages
from pkv.config.resolve import ConfigError, effective
from worktree import REPO

CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())


def probe_grid(cfg: dict, seeds_: tuple) -> list[dict]:
    """One job per isolated context, on every seed the stage may use."""
    return [{"context": c, "seed": s} for c in cfg["isolated"]["contexts"] for s in seeds_]


@pytest.fixture
def probe(monkeypatch) -> stages.Stage:
    row = stages.Stage("probe", "a probe stage of this test", "probe_job", "c{context}-s{seed}.parquet",
                       (("context", "positive"), ("seed", "seed")), many=("context", "seed"), grid=probe_grid,
                       seeds="heldout")
    monkeypatch.setitem(stages.STAGES, "probe", row)
    return row


def test_a_new_row_reaches_the_job_grid_seed_rule_files_and_targets(probe):
    cfg = effective(CONFIG, "smoke")
    heldout = cfg["seeds"]["heldout"]
    contexts = cfg["isolated"]["contexts"]
    want = [{"context": c, "seed": s} for c in contexts for s in heldout]
    assert jobs.stage_jobs(cfg, "probe") == want
    assert seeds.stage_seeds(cfg, "probe") == tuple(heldout)
    assert list(jobs.stage_files(cfg, "probe")) == [f"c{c}-s{s}.parquet" for c in contexts for s in heldout]
    assert jobs.stage_paths(cfg, "probe", "results/smoke") == [
        f"results/smoke/raw/probe/c{c}-s{s}.parquet" for c in contexts for s in heldout]
    assert jobs.stage_pattern("probe", "results/smoke") == "results/smoke/raw/probe/c{context}-s{seed}.parquet"
    jobs.check_job(cfg, "probe", context=contexts[0], seed=heldout[0])
    with pytest.raises(ConfigError, match="is the calibration seed"):
        jobs.check_job(cfg, "probe", context=contexts[0], seed=cfg["seeds"]["calibration"])
    with pytest.raises(ConfigError, match="--context 7 is not one of this config's"):
        jobs.check_job(cfg, "probe", context=7, seed=heldout[0])


def test_a_new_row_is_a_pkv_measure_subcommand_checked_against_its_grid(probe, tmp_path):
    cfg = effective(CONFIG, "smoke")
    c, s = cfg["isolated"]["contexts"][0], cfg["seeds"]["heldout"][0]
    parser = build_parser("measure")
    args = parser.parse_args(["measure", "probe", "--config", "c.json", "--constants", "k.json", "--context", str(c),
                              "--seed", str(s), str(cfg["seeds"]["heldout"][1]), "--out", "a.parquet", "b.parquet"])
    one, two = jobs_of(args)
    assert (one.context, one.seed, one.out) == (c, s, "a.parquet") and two.seed == cfg["seeds"]["heldout"][1]
    check_args(cfg, one)   # a job of the grid, on a held-out seed
    with pytest.raises(SystemExit):
        parser.parse_args(["measure", "probe", "--config", "c.json", "--constants", "k.json", "--out", "a.parquet"])


def test_every_stage_a_table_reads_is_a_row_with_a_grid_or_rules():
    from pkv.report.spec import FIGURE_SPECS, TABLE_SPECS

    read = {s for spec in [*TABLE_SPECS.values(), *FIGURE_SPECS.values()] for s in spec.stages}
    assert read <= set(stages.STAGES)
    assert all(stages.STAGES[s].grid is not None or stages.STAGES[s].rules for s in read)
    assert set(seeds.SEED_ROLES) == {n for n, row in stages.STAGES.items() if row.seeds}
