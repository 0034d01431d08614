# Profile resolution, path helpers and the job-graph helpers the rules use as inputs.
import json
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # this checkout's pkv package

from pkv.measure_config import ROOTS, SMOKE_BANNER, effective, resolve_profile
from pkv.report import TABLES
from pkv.report_figures import FIGURES


def cuda_available():
    if config["profile"] != "auto":
        return False
    import torch

    return torch.cuda.is_available()


PROFILE = resolve_profile(config["profile"], cuda_available())
C = effective(config, PROFILE)
validate(C, "../schemas/config.schema.yaml")
ROOT = ROOTS[PROFILE]
HELDOUT = [str(s) for s in C["seeds"]["heldout"]]
ABLATION_SEED = str(C["seeds"]["ablation"])

if PROFILE == "smoke":
    banner = "*" * 78
    print(f"{banner}\n*** SMOKE PROFILE: {SMOKE_BANNER}.\n*** Tiny shapes, CPU engines; "
          f"writes only under {ROOT}/. Force the GPU run with --config profile=paper.\n{banner}",
          file=sys.stderr)


wildcard_constraints:
    family="bucketed|homogeneous|bimodal|uniform|zipf",
    max_active="[0-9]+",
    seed="[0-9]+",
    engine_set="[a-z][a-z0-9]*",
    context="[0-9]+",
    group="[0-9]+",


def config_json():
    """The resolved config as canonical JSON: a change to it reruns freeze_config."""
    return json.dumps(C, sort_keys=True)


def out(path):
    """`path` under this profile's results folder."""
    return f"{ROOT}/{path}"


def serve_outputs():
    """One serve job per (family, max_active) point x held-out seed x engine set."""
    return [
        rules.serve_trace.output.parquet.format(family=p["family"], max_active=p["max_active"], seed=seed, engine_set=es)
        for p in C["serving"]
        for seed in HELDOUT
        for es in sorted(C["engine_sets"])
    ]


def model_step_outputs():
    """The model step's Parquet files (workflow/rules/model.smk): one per held-out seed, one for the external trace."""
    return expand(rules.model_step.output.parquet, seed=HELDOUT) + [rules.model_step_external.output.parquet]


def stage_outputs(stage):
    """The Parquet (or capture) files of one raw stage, as the report reads them."""
    a = C["ablations"]
    if stage == "serve":
        return serve_outputs()
    if stage == "isolated":
        return expand(rules.measure_isolated.output.parquet, context=C["isolated"]["contexts"])
    if stage == "split_sensitivity":
        return [rules.sweep_split_sensitivity.output.parquet.format(**p) for p in a["split_sensitivity"]["points"]]
    if stage == "b4_sweep":
        return expand(rules.sweep_b4.output.parquet, seed=HELDOUT)
    if stage == "gqa_sweep":
        return expand(rules.sweep_gqa.output.parquet, group=a["gqa_sweep"]["groups"])
    if stage == "raggedness":
        return expand(rules.ablate_raggedness.output.parquet, seed=ABLATION_SEED)
    if stage == "implementation":
        return expand(rules.ablate_implementation.output.parquet, seed=ABLATION_SEED)
    if stage == "mlp_proxy":
        return expand(rules.measure_mlp_proxy.output.parquet, seed=HELDOUT)
    if stage == "external":
        return [rules.replay_external.output.parquet]
    if stage == "model_step":
        return model_step_outputs()
    if stage == "nsight_kernels":
        return list(rules.parse_nsight.output) if C["nsight"] else []
    raise ValueError(f"unknown stage {stage!r}")


def table_inputs(name):
    """The stage files a table reads; a table with none (Nsight off) waits for the
    calibration Parquet, whose metadata names the profile its banner depends on."""
    files = [f for stage in TABLES[name].stages for f in stage_outputs(stage)]
    return files or [rules.calibrate_device.output.raw]


def figure_inputs(name):
    """Like table_inputs: a figure with no stage files still waits for the profile."""
    files = [f for stage in FIGURES[name].stages for f in stage_outputs(stage)]
    return files or [rules.calibrate_device.output.raw]


def final_outputs():
    """Every table and figure (the report rules' outputs), plus the Nsight capture when enabled."""
    tables = [getattr(rules, f"report_{n}").output.md for n in TABLES]
    tables += [getattr(rules, f"report_{n}_latex").output.tex for n, t in TABLES.items() if t.latex]
    figures = [getattr(rules, f"plot_{n}").output.png for n in FIGURES]
    return tables + figures + stage_outputs("nsight_kernels")
