"""The one table of stages: one row each, from which everything else about a stage derives.

A row says what the command line, the job grid, the seed rule, the files and the
Snakemake targets need of a stage: its `pkv measure` subcommand and flags (none for a
stage measured by another command), the function of pkv.measure that runs one job, the
file one job writes under raw/<stage>/, the function that lists its jobs under a config
(`grid`), the role of the seeds it may use (`seeds`: pkv.config.seeds) and, for a stage
whose files are its Snakemake rules' outputs rather than one file per job, those rules
(`rules`). `pkv.cli.pipeline` builds the subcommands and dispatches from it,
`pkv.config.jobs` lists each job and names its file from it, `pkv.config.seeds` takes each
stage's seed role from it, and workflow/rules/common.smk lists a stage's files (the
targets of the tables that read it) from it. A new stage is a row here, its measuring
function and its rule.

Imports nothing heavy (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath
from typing import Callable

# Flag kinds (pkv.cli.args gives each its checked type): seed, positive (an integer >= 1),
# text, path.
_POINT = (("family", "text"), ("max_active", "positive"))

# A job grid: (config, the seeds the stage may use) -> one identity dict per job, in the
# config's order; its keys name the job's file (Stage.file) and its flags.
Grid = Callable[[dict, tuple], list]


@dataclass(frozen=True)
class Stage:
    command: str | None                   # pkv measure COMMAND (None: measured by another command)
    help: str = ""
    run: str = ""                         # the function of `module` that measures one job
    file: str = ""                        # raw/<stage>/<file> of one job, from its flags
    flags: tuple[tuple[str, str], ...] = ()
    fixed: tuple[tuple[str, object], ...] = ()   # arguments the function always gets from this row
    module: str = "pkv.measure.stages"
    raw: bool = True       # its files are a raw stage the report reads (False: parsed into another first)
    folder: str = ""       # raw/<folder>/ where several commands write one folder (default: the stage's name)
    # The flags one process may take several values of (`--seed S1 S2 ... --out F1 F2 ...`:
    # one file per job, each the job its flags name; a many flag given once holds for every
    # job): a stage's rule runs all its points and seeds (contexts, groups) in one process,
    # paying start-up, CUDA init and kernel loads once.
    many: tuple[str, ...] = ()
    grid: Grid | None = None   # its jobs under a config (None: no job grid, its files are its rules')
    seeds: str | None = None   # the seed role it may use (pkv.config.seeds.SEED_ROLES); None: no seed
    rules: tuple[str, ...] = ()   # the Snakemake rules whose outputs are its files, where not one per job
    suites: tuple[str, ...] = ()  # a kernel sweep's suites (`pkv bench kernels --suites`): what its rule runs
                                  # and what `pkv build-kernels` builds for it when it is in the run


# ---------------------------------------------------------------- job grids


def _serving(cfg: dict, seeds: tuple) -> list[dict]:
    return [{"family": p["family"], "max_active": p["max_active"], "seed": s, "engine_set": es}
            for p in cfg["serving"] for s in seeds for es in sorted(cfg["engine_sets"])]


def _contexts(cfg: dict, seeds: tuple) -> list[dict]:
    return [{"context": c} for c in cfg["isolated"]["contexts"]]


def _split_points(cfg: dict, seeds: tuple) -> list[dict]:
    return [{"family": p["family"], "max_active": p["max_active"], "seed": s}
            for p in cfg["ablations"]["split_sensitivity"]["points"] for s in seeds]


def _groups(cfg: dict, seeds: tuple) -> list[dict]:
    return [{"group": g, "seed": s} for g in cfg["ablations"]["gqa_sweep"]["groups"] for s in seeds]


def _point_of(*section: str) -> Grid:
    """The one (family, max_active) point of a config section, on each seed."""
    def grid(cfg: dict, seeds: tuple) -> list[dict]:
        node = cfg
        for key in section:
            node = node[key]
        return [{"family": node["family"], "max_active": node["max_active"], "seed": s} for s in seeds]
    return grid


def _per_seed(cfg: dict, seeds: tuple) -> list[dict]:
    return [{"seed": s} for s in seeds]


def _external_replay(stage: str) -> Grid:
    """The external trace's one job for `stage`'s replay, none where the config does not ask for it."""
    def grid(cfg: dict, seeds: tuple) -> list[dict]:
        scale = external_scale(cfg["external"], stage)
        return [{"name": external_identity(cfg["external"])[0]}] if scale is not None else []
    return grid


def _nsight_capture(cfg: dict, seeds: tuple) -> list[dict]:
    return [{}] if cfg["nsight"] else []


STAGES: dict[str, Stage] = {
    "serve": Stage("serve", "Table 2: held-out traces of serving points x one engine set", "serve",
                   "{family}-b{max_active}-s{seed}-{engine_set}.parquet",
                   (*_POINT, ("seed", "seed"), ("engine_set", "text")),
                   many=("family", "max_active", "seed"), grid=_serving, seeds="heldout"),
    "isolated": Stage("isolated", "Table 1: one request of CONTEXT tokens, 50%% holes", "isolated",
                      "ctx{context}.parquet", (("context", "positive"),), many=("context",), grid=_contexts,
                      seeds="ablation"),
    "split_sensitivity": Stage("split-sensitivity", "Table 7: the policy at the frozen split and its neighbours",
                               "split_sensitivity", "{family}-b{max_active}.parquet", _POINT, grid=_split_points,
                               seeds="ablation"),
    "b4_sweep": Stage("b4-sweep", "PersistentKV workqueue on B4 over a split grid", "b4_sweep", "s{seed}.parquet",
                      (("seed", "seed"),), many=("seed",), grid=_point_of("ablations", "b4_sweep"), seeds="heldout"),
    "gqa_sweep": Stage("gqa-sweep", "Table 8: one GQA group size G", "gqa_sweep", "g{group}.parquet",
                       (("group", "positive"),), many=("group",), grid=_groups, seeds="ablation"),
    "raggedness": Stage("raggedness", "the raggedness ablation on one seed", "ablation", "s{seed}.parquet",
                        (("seed", "seed"),), (("name", "raggedness"),), grid=_point_of("ablations", "raggedness"),
                        seeds="ablation"),
    "implementation": Stage("implementation", "the implementation ablation on one seed", "ablation", "s{seed}.parquet",
                            (("seed", "seed"),), (("name", "implementation"),),
                            grid=_point_of("ablations", "implementation"), seeds="ablation"),
    "kv_fp8": Stage("kv-fp8", "the FP8 KV ablation (16-bit and e4m3 cache, same trace) on one seed", "kv_fp8",
                    "s{seed}.parquet", (("seed", "seed"),), many=("seed",), grid=_per_seed, seeds="heldout"),
    "mlp_proxy": Stage("mlp-proxy", "Table 3: attention + gated MLP tail on one seed", "mlp_proxy", "s{seed}.parquet",
                       (("seed", "seed"),), many=("seed",), grid=_point_of("mlp_proxy"), seeds="heldout"),
    "external": Stage("external", "the external request trace named in the config", "external", "{name}.parquet",
                      (("trace", "path"),), grid=_external_replay("external"), seeds="ablation"),
    "external_stress": Stage("external-stress", "the external request trace with its prompts multiplied by "
                             "external.stress_scale: a stress test", "external_stress", "{name}.parquet",
                             (("trace", "path"),), grid=_external_replay("external_stress"), seeds="ablation"),
    # The model step (pkv.measure.model_step): in `all` when the config has a model_step
    # section (pkv.report.spec), its rules in workflow/rules/model.smk, both commands writing raw/model_step/; the
    # external trace's file is named like the external stage's (external_identity).
    "model_step": Stage("model-step", "model-level decode step: N layers, per-layer KV, one CUDA graph per bucket, "
                        "one held-out seed", "model_step", "s{seed}.parquet", (("seed", "seed"),),
                        module="pkv.measure.model_step", raw=False, folder="model_step", many=("seed",),
                        grid=_per_seed, seeds="heldout", rules=("model_step", "model_step_external")),
    "model_step_external": Stage("model-step-external", "the model-level decode step on the external request trace",
                                 "model_step_external", "{name}.parquet", (("trace", "path"),),
                                 module="pkv.measure.model_step", raw=False, folder="model_step"),
    "nsight": Stage("nsight-trace", "the short trace the nsight stage profiles (under ncu: `pkv nsight`)",
                    "nsight_trace", "ncu.run.parquet", raw=False, seeds="ablation"),
    # Stages measured by other commands (pkv calibrate, pkv nsight, pkv bench ...).
    "calibrate": Stage(None, file="calibration.parquet", grid=_per_seed, seeds="calibration"),
    "nsight_kernels": Stage(None, file="ncu.parquet", grid=_nsight_capture),
    "calibration": Stage(None, raw=False, rules=("freeze_config", "calibrate_device")),
    "kernels": Stage(None, rules=("bench_kernels",), suites=("homogeneous", "ragged", "shapes")),
    "fp8_kernels": Stage(None, rules=("bench_fp8_kernels",), suites=("fp8",)),
    # Sliding windows, sinks and q_len: in `all` where the config has a feature_kernels section.
    "feature_kernels": Stage(None, rules=("bench_feature_kernels",), suites=("features",)),
    "fp8_accuracy": Stage(None, rules=("bench_fp8_accuracy",)),
    "host": Stage(None, rules=("bench_host",), seeds="heldout"),   # pkv bench host: its active sets' lengths
}


# The external trace's name and title where the config gives none, for the committed
# reference run's Azure trace, so its config (and hash) and its file names stay as they were.
EXTERNAL_NAME = "azure2023"
EXTERNAL_TITLE = "External request trace (Azure LLM inference 2023, conversation)"
EXTERNAL_FILE = "AzureLLMInferenceTrace_conv.csv"


def external_identity(section: dict) -> tuple[str, str]:
    """(name, title) of the config's external trace: its name is the slug of its files
    (raw/external/NAME.parquet), its title the external table's. Without a name: the
    Azure trace's for the Azure file, else the request file's stem as a slug (so
    `--config 'external={path: my.csv}'` writes my.parquet, titled by its own name)."""
    name = section.get("name")
    if not name:
        path = PurePath(section.get("path") or EXTERNAL_FILE)
        name = EXTERNAL_NAME if path.name == EXTERNAL_FILE else \
            re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-._")[:64] or "external"
    title = section.get("title") or (EXTERNAL_TITLE if name == EXTERNAL_NAME else f"External request trace ({name})")
    return name, title


# The replays of the external trace, one stage each: the headline replays the prompts
# scaled by external.prompt_scale (1: as recorded; the committed reference run's config
# says 16 and has no stress replay), a stress test by external.stress_scale where the
# config gives one. stage -> (the external section's key of its prompt scale, the label
# its title and text carry).
EXTERNAL_REPLAYS = {"external": ("prompt_scale", ""), "external_stress": ("stress_scale", "stress test")}


def external_scale(section: dict, stage: str) -> float | None:
    """The prompt scale of the external trace's `stage` replay; None: the config asks for no such replay."""
    return section.get(EXTERNAL_REPLAYS[stage][0])


def external_title(section: dict, stage: str = "external") -> str:
    """The title of the external trace's `stage` replay: the trace's own title (external_identity),
    a stress test's labelled so, with its prompt scale."""
    title = external_identity(section)[1]
    label, scale = EXTERNAL_REPLAYS[stage][1], external_scale(section, stage)
    if not label:
        return title
    return f"{title}: {label}" + (f", prompts ×{scale:g}" if scale is not None else "")


def by_command(command: str) -> tuple[str, Stage]:
    """(stage name, row) of a `pkv measure` subcommand."""
    for name, stage in STAGES.items():
        if stage.command is not None and stage.command == command:
            return name, stage
    commands = [s.command for s in STAGES.values() if s.command]
    raise ValueError(f"unknown stage command {command!r}; choose from {commands}")
