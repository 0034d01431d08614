"""config.yaml, the committed reference run's config: it validates on the paper profile,
names only engines and runners that exist, is the config results/ was made with, and
plans every stage of the run (the model step in `all` among them) from an empty results/."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import yaml

from pkv.config.resolve import config_hash, effective, load_schema, validate_config
from pkv.config.typed import Config
from pkv.engines import table
from pkv.engines.model import GPU_ENGINES
from pkv.measure import model_plan
from pkv.report.spec import TABLE_SPECS, in_all
from worktree import REPO, copy_worktree

RAW = yaml.safe_load((REPO / "config.yaml").read_text())
PAPER = effective(RAW, "paper")


def test_it_validates_and_names_registered_engines():
    validate_config(PAPER, load_schema(), "reference run")
    cfg = Config.from_dict(PAPER)
    assert "pkv-graph" in cfg.engine_sets["main"] and "adaptive:objective=overlapped" in cfg.engine_sets["main"]
    specs = [*cfg.engine_sets["main"], *cfg.ablations.gqa_sweep.engines, *cfg.ablations.kv_fp8.engines,
             *cfg.mlp_proxy.engines, *cfg.external.engines, *cfg.nsight_capture.engines]
    assert {table.parse_spec(s)[0] for s in specs} <= set(table.ENGINES)
    step = model_plan.settings(cfg)
    # GPU runners only, in the runner table's order (the report's rows and colours)
    assert step.engines == tuple(e for e in GPU_ENGINES if e in step.engines) and "pkv-graph" in step.engines
    assert step.shapes == ("llama-8b", "llama-70b") and step.buckets == (1, 8)


def test_the_model_step_is_in_all_and_results_are_this_configs():
    assert in_all(TABLE_SPECS["model_step"], "paper", PAPER)
    committed = json.loads((REPO / "results" / "config.json").read_text())
    assert config_hash(committed) == config_hash(PAPER)


def test_the_run_plans_every_stage(tmp_path):
    tree = copy_worktree(tmp_path, "results/")
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "all", "--config", "profile=paper",
                        "run=reference"],
                       cwd=tree, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", r.stdout, flags=re.M))
    for rule in ("calibrate_device", "serve_trace", "model_step", "model_step_external", "measure_kv_fp8",
                 "report_model_step", "plot_model_step", "bench_kernels", "capture_nsight", "build_kernels"):
        assert counts.get(rule) == "1", (rule, counts)
