"""The one table of measuring stages (`pkv measure STAGE`).

Each row says what the command line, the job grid and the report need of a stage: its
`pkv measure` subcommand and flags, the function of pkv.measure that runs one job, and
the file one job writes under raw/<stage>/. `pkv.cli.pipeline` builds the subcommands
and dispatches from it, `pkv.config.jobs` names each job's file from it (for the
measuring commands' checks and the report), and workflow/rules/common.smk lists a
stage's outputs through pkv.config.jobs. A new stage is a row here, its function, its
job grid in pkv.config.jobs.stage_jobs and its rule.

Imports nothing heavy (the Snakefile reads it at parse time).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import PurePath

# Flag kinds (pkv.cli.args gives each its checked type): seed, positive (an integer >= 1),
# text, path.
_POINT = (("family", "text"), ("max_active", "positive"))


@dataclass(frozen=True)
class Stage:
    command: str                          # pkv measure COMMAND
    help: str
    run: str                              # the function of `module` that measures one job
    file: str                             # raw/<stage>/<file> of one job, from its flags
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


STAGES: dict[str, Stage] = {
    "serve": Stage("serve", "Table 2: held-out traces of serving points x one engine set", "serve",
                   "{family}-b{max_active}-s{seed}-{engine_set}.parquet",
                   (*_POINT, ("seed", "seed"), ("engine_set", "text")),
                   many=("family", "max_active", "seed")),
    "isolated": Stage("isolated", "Table 1: one request of CONTEXT tokens, 50%% holes", "isolated", "ctx{context}.parquet",
                      (("context", "positive"),), many=("context",)),
    "split_sensitivity": Stage("split-sensitivity", "Table 7: the policy at the frozen split and its neighbours",
                               "split_sensitivity", "{family}-b{max_active}.parquet", _POINT),
    "b4_sweep": Stage("b4-sweep", "PersistentKV workqueue on B4 over a split grid", "b4_sweep", "s{seed}.parquet",
                      (("seed", "seed"),), many=("seed",)),
    "gqa_sweep": Stage("gqa-sweep", "Table 8: one GQA group size G", "gqa_sweep", "g{group}.parquet",
                       (("group", "positive"),), many=("group",)),
    "raggedness": Stage("raggedness", "the raggedness ablation on one seed", "ablation", "s{seed}.parquet",
                        (("seed", "seed"),), (("name", "raggedness"),)),
    "implementation": Stage("implementation", "the implementation ablation on one seed", "ablation", "s{seed}.parquet",
                            (("seed", "seed"),), (("name", "implementation"),)),
    "kv_fp8": Stage("kv-fp8", "the FP8 KV ablation (16-bit and e4m3 cache, same trace) on one seed", "kv_fp8",
                    "s{seed}.parquet", (("seed", "seed"),), many=("seed",)),
    "mlp_proxy": Stage("mlp-proxy", "Table 3: attention + gated MLP tail on one seed", "mlp_proxy", "s{seed}.parquet",
                       (("seed", "seed"),), many=("seed",)),
    "external": Stage("external", "the external request trace named in the config", "external", "{name}.parquet",
                      (("trace", "path"),)),
    # The model step (pkv.measure.model_step): in `all` when the config has a model_step
    # section (pkv.report.spec), its rules in workflow/rules/model.smk, both commands writing raw/model_step/; the
    # external trace's file is named like the external stage's (external_identity).
    "model_step": Stage("model-step", "model-level decode step: N layers, per-layer KV, one CUDA graph per bucket, "
                        "one held-out seed", "model_step", "s{seed}.parquet", (("seed", "seed"),),
                        module="pkv.measure.model_step", raw=False, folder="model_step", many=("seed",)),
    "model_step_external": Stage("model-step-external", "the model-level decode step on the external request trace",
                                 "model_step_external", "{name}.parquet", (("trace", "path"),),
                                 module="pkv.measure.model_step", raw=False, folder="model_step"),
    "nsight": Stage("nsight-trace", "the short trace the nsight stage profiles (under ncu: `pkv nsight`)",
                    "nsight_trace", "ncu.run.parquet", raw=False),
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


def by_command(command: str) -> tuple[str, Stage]:
    """(stage name, row) of a `pkv measure` subcommand."""
    for name, stage in STAGES.items():
        if stage.command == command:
            return name, stage
    raise ValueError(f"unknown stage command {command!r}; choose from {[s.command for s in STAGES.values()]}")
