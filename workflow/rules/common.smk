# Config coercion and validation, profile and results-folder resolution, path helpers and
# the job-graph helpers the rules use as inputs. Imports nothing heavy: no torch, pandas,
# pyarrow or matplotlib at parse time (tests/test_startup.py checks).
import json
import logging
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, workflow.basedir)  # this checkout's pkv package
# Every job's `python3 -m pkv.cli` runs in a child forked from a warm worker that holds the
# imports (each job a fresh process and CUDA context; pkv/cli/worker.py); PKV_WORKER=off runs each alone.
os.environ.setdefault("PKV_WORKER", "on")

from pkv.config.resolve import (REFERENCE_ROOT, SMOKE_BANNER, check_config, coerce, effective, gpu_name, load_schema,
                                read_config_file, resolve_profile, run_root, validate_config)
from pkv.config.workflow import check_frozen, check_runnable, command_line_overrides, lock_folder, writes_results
from pkv.config.gpus import pool as gpu_pool
from pkv.config.jobs import stage_files, stage_jobs, stage_paths, stage_pattern
from pkv.config.stages import EXTERNAL_REPLAYS, EXTERNAL_TITLE, STAGES, external_title
from pkv.config.typed import Config
from pkv.core.families import FAMILIES
from pkv.engines.table import feature_kernels
from pkv.report.spec import FIGURE_SPECS, TABLE_SPECS, in_all, stages_in_all

class _ReferenceMetadata(logging.Filter):
    """Snakemake's notes that the committed reference run's files have no metadata ("N jobs
    have missing provenance/metadata", one "Missing metadata for file" per file of
    `snakemake --report`): a clone never has the .snakemake/ folder of the machine that
    measured them, and nothing depends on it (a reference file is up to date by being
    there, inp). One line says so instead."""

    said = False

    def filter(self, record):
        text = str(record.msg)
        if not (text.startswith("Missing metadata for file ") or " have missing provenance/metadata" in text):
            return True
        if type(self).said:
            return False
        type(self).said = True
        record.msg, record.args = (f"*** the committed reference run {REFERENCE_ROOT}/ was measured on another "
                                   "machine: Snakemake has no metadata of its files here, which is expected (a file "
                                   "that is there is up to date)"), ()
        return True


def quiet_reference_metadata():
    logging.getLogger("snakemake.logging").addFilter(_ReferenceMetadata())


SCHEMA = load_schema(Path(workflow.basedir) / "workflow/schemas/config.schema.yaml")
# Snakemake's YAML loader keeps the last of a key given twice: read config.yaml and every
# --configfile again, refusing that (file and line). What the command line sets wins over
# the profile's section too (effective()).
read_config_file(Path(workflow.basedir) / "config.yaml")
OVERRIDES = command_line_overrides(workflow.config_settings.config, workflow.config_settings.configfiles,
                                   Path(workflow.basedir) / "config.yaml", SCHEMA)
# `--config key={a: 4}` reaches us untyped ("4"): give it the schema's types first. Then
# one line per bad value, naming the key (unknown keys are refused at every level).
coerce(config, SCHEMA)
validate_config(config, SCHEMA)

# nvidia-smi (not torch) says whether this machine has a GPU, and which.
GPU = gpu_name() if config["profile"] == "auto" or (config["profile"] == "paper" and config["run"] == "auto") else None
PROFILE = resolve_profile(config["profile"], GPU is not None)
C = effective(config, PROFILE, OVERRIDES)
validate_config(C, SCHEMA, f"config ({PROFILE} profile)")
Config.from_dict(C, f"config ({PROFILE} profile)")   # every key of every section, named when missing
check_config(C)
# A multi-GPU host (--resources gpu=N, N > 1; profiles/multigpu): each GPU job takes a GPU
# of its own from a pool of this host's GPUs, all of one model (pkv.config.gpus,
# pkv/cli/gpu_pool.py); an automatic run folder is <gpu>x<N>-<date>. gpu=1: nothing changes.
GPU_POOL = None
if workflow.is_main_process:
    GPU_POOL = gpu_pool(workflow.global_resources, PROFILE, writes_results(sys.argv[1:]))
if GPU_POOL:
    os.environ.update(GPU_POOL.env)
ROOT = run_root(PROFILE, config["run"], GPU_POOL.label if GPU_POOL and GPU else GPU)
# The committed reference run: up to date when its files are there, whatever their mtimes
# (a fresh clone's are checkout times), and never re-made from a different config.
REFERENCE = ROOT == REFERENCE_ROOT
# The serving stage's jobs of one engine set (family, max_active, seed): its rule's files
# and flags, one engine set per job (the other stages': job_values, stage_outputs).
SERVE_JOBS = list(dict.fromkeys((j["family"], str(j["max_active"]), str(j["seed"])) for j in stage_jobs(C, "serve")))

# A folder's frozen config.json must be what this config resolves to (never a hand-edited
# one, never an older config's); a plan that cannot run fails here, before any job; and
# a second run writing the same folder is refused at once.
check_frozen(ROOT, C, REFERENCE)
check_runnable(C, REFERENCE)
if workflow.is_main_process:
    lock_folder(ROOT, hold=writes_results(sys.argv[1:]))

if REFERENCE:
    quiet_reference_metadata()

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


CAPTION = "../report/caption.rst"   # renders a report rule's `caption` param (workflow/report/)


def table_title(name, table):
    """A table's title; the external trace's replays' are the config's trace's (pkv.config.stages.external_title)."""
    return external_title(C["external"], name) if name in EXTERNAL_REPLAYS else table.title


def caption_title(name, table):
    """A table's title in its report caption (reStructuredText): a title made from the
    config's strings as plain text (rst_text), the code's own titles as written."""
    title = table_title(name, table)
    return title if title in (table.title, EXTERNAL_TITLE) else rst_text(title)


def rst_text(text):
    """`text` as plain text in reStructuredText, which the HTML report renders captions
    from: every punctuation character backslash-escaped and lines joined, so a string of
    the config (the external trace's title) makes no link (`javascript:` or other), role
    or directive, only the text it says."""
    return re.sub(r"([^\w\s])", r"\\\1", " ".join(str(text).split()))


def table_outputs(name, table):
    """A table's files: Markdown, and LaTeX too for the paper's tables (one job writes both)."""
    files = {"md": report(out(f"tables/{name}.md"), caption=CAPTION, category="Tables",
                          labels={"table": name, "format": "Markdown"})}
    if table.latex:
        files["tex"] = report(out(f"tables/{name}.tex"), caption=CAPTION, category="Tables",
                              labels={"table": name, "format": "LaTeX"})
    return files


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


def kernels_built():
    """With a GPU pool, the kernel build as an input of the GPU jobs that would start beside
    it (those that wait for no calibration): kernels are built once per host, before the fan-out."""
    return [inp(out("build/kernels.json"))] if GPU_POOL else []


def stage_outputs(stage):
    """The Parquet (or capture) files of one stage, as the report reads them, from its row
    of pkv.config.stages: its rules' outputs where the row names rules, else one file per
    job of its grid (pkv.config.jobs, the files the report expects; tests check the rules
    write the same ones)."""
    row = STAGES.get(stage)
    if row is None:
        raise ValueError(f"unknown stage {stage!r}")
    if row.rules:
        return [f for name in row.rules for f in getattr(rules, name).output]
    return stage_paths(C, stage, ROOT)


def suites(stage):
    """The kernel sweep's suites a kernel stage's rule runs (`--suites`), from its row of pkv.config.stages."""
    return ",".join(STAGES[stage].suites)


def feature_engines():
    """The features suite's engines: the config's feature_kernels.engines; without that section
    (the suite a named target), every engine that takes windows, sinks and q_len."""
    section = Config.from_dict(C).feature_kernels
    return list(section.engines) if section else list(feature_kernels())


def job_values(stage, key):
    """One value of `key` per job of `stage`, in the order of its files (stage_outputs): the
    flag values of a rule that runs every job of the stage in one process."""
    return [str(job[key]) for job in stage_jobs(C, stage)]


def job_pattern(stage):
    """The file of one job of `stage` with its identity's keys as wildcards (its rule's output)."""
    return stage_pattern(stage, ROOT)


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
    stages = dict.fromkeys(s for spec in TABLE_SPECS.values() if not spec.render for s in spec.stages)
    return inputs([f for s in stages for f in stage_outputs(s)])


def final_outputs():
    """Every table and figure of this profile that is part of `all` (pkv.report.spec), the
    Nsight capture when enabled, and for a paper run of your own, its comparison with the
    reference run."""
    tables = [getattr(rules, f"report_{n}").output.md for n, t in TABLE_SPECS.items() if in_all(t, PROFILE, C)]
    tables += [getattr(rules, f"report_{n}").output.tex for n, t in TABLE_SPECS.items()
               if t.latex and in_all(t, PROFILE, C)]
    figures = [getattr(rules, f"plot_{n}").output.png for n, f in FIGURE_SPECS.items() if in_all(f, PROFILE, C)]
    comparison = [rules.compare_reference.output.md] if PROFILE == "paper" and not REFERENCE else []
    build = [rules.build_kernels.output.manifest] if PROFILE == "paper" else []   # the GPU's kernels, first
    return build + tables + figures + stage_outputs("nsight_kernels") + comparison + measured_outputs()


def measured_outputs():
    """Every stage file the tables and figures of `all` read, as targets of their own:
    Snakemake does not remake a missing input of an up-to-date table (it treats it like a
    temporary file), so without this a deleted raw file, or the files a killed job's
    outputs were removed for, would never be measured again and the table built from them
    would stay. In the reference run a file that is there is up to date (inp: ancient)."""
    return list(dict.fromkeys(f for stage in stages_in_all(PROFILE, C) for f in stage_outputs(stage)))


def results_summary():
    """One line for the end of a run: the results folder and the tables and figures in it."""
    tables = sorted(p.name for p in Path(ROOT, "tables").glob("*.md"))
    figures = sorted(Path(ROOT, "figures").glob("*.png"))
    return (f"*** results in {ROOT}/: {len(tables)} tables in {ROOT}/tables/ ({', '.join(tables)}), "
            f"{len(figures)} figures in {ROOT}/figures/; the HTML report: snakemake --report {ROOT}/report.html")


def remove_stale_reports():
    """Before a run that writes: remove every table and figure of `all` one of whose inputs
    is gone (deleted, or removed by Snakemake with a killed job's outputs). This run makes
    it again from the remade files; should that fail, no table is left standing on files
    that are no longer there."""
    made = [getattr(rules, f"report_{n}") for n, t in TABLE_SPECS.items() if in_all(t, PROFILE, C)]
    made += [getattr(rules, f"plot_{n}") for n, f in FIGURE_SPECS.items() if in_all(f, PROFILE, C)]
    for maker in made:
        missing = [str(f) for f in maker.input if not Path(str(f)).exists()]
        stale = [Path(str(f)) for f in maker.output if Path(str(f)).exists()]
        if missing and stale:
            for f in stale:
                f.unlink()
            print(f"*** removed {', '.join(map(str, stale))}: its input {missing[0]} is gone"
                  f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; `all` makes it again",
                  file=sys.stderr)
