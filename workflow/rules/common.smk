# Config coercion and validation, profile and results-folder resolution, path helpers and
# the job-graph helpers the rules use as inputs. Imports nothing heavy: no torch, pandas,
# pyarrow or matplotlib at parse time (tests/test_startup.py checks).
import json
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # this checkout's pkv package

from pkv.config.resolve import (REFERENCE_ROOT, SMOKE_BANNER, ConfigError, check_config, coerce, differences,
                                effective, gpu_name, load_schema, resolve_profile, run_root, validate_config)
from pkv.core.traces import FAMILIES
from pkv.report.spec import FIGURE_SPECS, TABLE_SPECS

SCHEMA = load_schema(Path(workflow.basedir) / "workflow/schemas/config.schema.yaml")
# `--config key={a: 4}` reaches us untyped ("4"): give it the schema's types first. Then
# one line per bad value, naming the key (unknown keys are refused at every level).
coerce(config, SCHEMA)
validate_config(config, SCHEMA)

# nvidia-smi (not torch) says whether this machine has a GPU, and which.
GPU = gpu_name() if config["profile"] == "auto" or (config["profile"] == "paper" and config["run"] == "auto") else None
PROFILE = resolve_profile(config["profile"], GPU is not None)
C = effective(config, PROFILE)
validate_config(C, SCHEMA, f"config ({PROFILE} profile)")
check_config(C)
ROOT = run_root(PROFILE, config["run"], GPU)
# The committed reference run: up to date when its files are there, whatever their mtimes
# (a fresh clone's are checkout times), and never re-made from a different config.
REFERENCE = ROOT == REFERENCE_ROOT
HELDOUT = [str(s) for s in C["seeds"]["heldout"]]
ABLATION_SEED = str(C["seeds"]["ablation"])

if REFERENCE and Path(ROOT, "config.json").is_file():
    _diff = differences(json.loads(Path(ROOT, "config.json").read_text()), C)
    if _diff:
        raise ConfigError(f"{ROOT}/config.json: this config differs from the committed reference run's in "
                          f"{', '.join(_diff[:6])}{' ...' if len(_diff) > 6 else ''}; a changed config is a new run: "
                          "name it with --config run=NAME (it goes to results/runs/NAME/)")

if PROFILE == "smoke":
    banner = "*" * 78
    print(f"{banner}\n*** SMOKE PROFILE: {SMOKE_BANNER}.\n*** Tiny shapes, CPU engines; "
          f"writes only under {ROOT}/. Force the GPU run with --config profile=paper.\n{banner}",
          file=sys.stderr)
elif not REFERENCE:
    print(f"*** paper run on {GPU or 'a GPU'} into {ROOT}/ (the committed reference run {REFERENCE_ROOT}/ is "
          f"never written); resume it on another day with --config run={Path(ROOT).name}", file=sys.stderr)


wildcard_constraints:
    family="|".join(FAMILIES),
    max_active="[0-9]+",
    seed="[0-9]+",
    engine_set="[a-z][a-z0-9]*",
    context="[0-9]+",
    group="[0-9]+",


def config_json():
    """The resolved config as canonical JSON: a change to it reruns freeze_config."""
    return json.dumps(C, sort_keys=True)


def out(path):
    """`path` under this run's results folder."""
    return f"{ROOT}/{path}"


def inp(path):
    """An input as the jobs read it. In the reference run only a missing file is out of
    date (ancient: its mtime never triggers a rerun)."""
    return ancient(path) if REFERENCE else path


def inputs(paths):
    return [inp(p) for p in paths]


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


def stage_inputs(stages):
    """The stage files a table or figure reads; one with none (Nsight off) waits for the
    calibration Parquet, whose metadata names the profile its banner depends on."""
    files = [f for stage in stages for f in stage_outputs(stage)]
    return inputs(files or [rules.calibrate_device.output.raw])


def table_inputs(name):
    return stage_inputs(TABLE_SPECS[name].stages)


def figure_inputs(name):
    return stage_inputs(FIGURE_SPECS[name].stages)


def comparison_inputs():
    """Every stage file of this run (the comparison reads all of them)."""
    stages = dict.fromkeys(s for spec in TABLE_SPECS.values() for s in spec.stages)
    return inputs([f for s in stages for f in stage_outputs(s)])


def final_outputs():
    """Every table and figure (the report rules' outputs), the Nsight capture when enabled,
    and for a paper run of your own, its comparison with the reference run."""
    tables = [getattr(rules, f"report_{n}").output.md for n in TABLE_SPECS]
    tables += [getattr(rules, f"report_{n}_latex").output.tex for n, t in TABLE_SPECS.items() if t.latex]
    figures = [getattr(rules, f"plot_{n}").output.png for n in FIGURE_SPECS]
    comparison = [rules.compare_reference.output.md] if PROFILE == "paper" and not REFERENCE else []
    kernels = list(rules.report_kernels.output) if PROFILE == "paper" else []   # GPU kernels: no smoke version
    return tables + figures + stage_outputs("nsight_kernels") + comparison + kernels
