"""The jobs a config implies, stage by stage, and the Parquet file each writes.

One definition for the measuring commands (a job's flags must name one of these jobs, on
a seed the stage may use: pkv.config.seeds.check_seed) and for the report (it reads
exactly these files under raw/<stage>/, refusing any other file there by name).
workflow/rules/*.smk name the same files as their outputs (tests/test_bad_input.py
checks that the two agree for the paper and the smoke profile).

Imports nothing heavy (the Snakefile may import it at parse time).
"""

from __future__ import annotations

from pkv.config.resolve import ConfigError
from pkv.config.seeds import check_seed, stage_seeds
from pkv.config.stages import STAGES, external_identity

# raw/<stage>/<file> of one job, from its identity (the keys of stage_jobs' dicts).
STAGE_FILES = {"calibrate": "calibration.parquet", "nsight_kernels": "ncu.parquet",
               **{name: stage.file for name, stage in STAGES.items() if stage.raw}}
# Identity keys that are also columns of every row of the job's file (the report checks
# that a file holds the job its name says).
ROW_KEYS = ("family", "max_active", "seed", "group")


def stage_jobs(cfg: dict, stage: str) -> list[dict]:
    """Every job of `stage` under `cfg`, as identity dicts (in the order of the config)."""
    a = cfg["ablations"]
    seeds = stage_seeds(cfg, stage) if stage in _SEEDED else ()
    if stage == "serve":
        return [{"family": p["family"], "max_active": p["max_active"], "seed": s, "engine_set": es}
                for p in cfg["serving"] for s in seeds for es in sorted(cfg["engine_sets"])]
    if stage == "isolated":
        return [{"context": c} for c in cfg["isolated"]["contexts"]]
    if stage == "split_sensitivity":
        return [{"family": p["family"], "max_active": p["max_active"], "seed": s}
                for p in a["split_sensitivity"]["points"] for s in seeds]
    if stage == "b4_sweep":
        return [{"family": a["b4_sweep"]["family"], "max_active": a["b4_sweep"]["max_active"], "seed": s} for s in seeds]
    if stage == "gqa_sweep":
        return [{"group": g, "seed": s} for g in a["gqa_sweep"]["groups"] for s in seeds]
    if stage in ("raggedness", "implementation"):
        return [{"family": a[stage]["family"], "max_active": a[stage]["max_active"], "seed": s} for s in seeds]
    if stage == "mlp_proxy":
        c = cfg["mlp_proxy"]
        return [{"family": c["family"], "max_active": c["max_active"], "seed": s} for s in seeds]
    if stage in ("kv_fp8", "model_step"):
        return [{"seed": s} for s in seeds]
    if stage == "external":
        return [{"name": external_identity(cfg["external"])[0]}]
    if stage == "nsight_kernels":
        return [{}] if cfg["nsight"] else []
    if stage == "calibrate":
        return [{"seed": cfg["seeds"]["calibration"]}]
    raise ValueError(f"unknown stage {stage!r}")


_SEEDED = ("serve", "split_sensitivity", "b4_sweep", "gqa_sweep", "raggedness", "implementation", "kv_fp8",
           "mlp_proxy", "model_step")


def file_name(stage: str, job: dict) -> str:
    return STAGE_FILES[stage].format(**job)


def stage_files(cfg: dict, stage: str) -> dict[str, dict]:
    """File name under raw/<stage>/ -> the job that writes it."""
    return {file_name(stage, job): job for job in stage_jobs(cfg, stage)}


def flag_of(key: str) -> str:
    """The command-line flag of a job identity key (max_active -> --max-active)."""
    return "--" + key.replace("_", "-")


def check_job(cfg: dict, stage: str, **given) -> None:
    """Refuse a measuring command whose flags name no job of `cfg` (one ConfigError line
    naming the flags and the jobs there are): its seed first, by the one seed rule."""
    if "seed" in given:
        check_seed(cfg, stage, given["seed"])
    jobs = stage_jobs(cfg, stage)
    keys = list(given)
    if any({k: job.get(k) for k in keys} == given for job in jobs):
        return
    for k, v in given.items():   # one flag no job has: name it alone
        values = sorted({job[k] for job in jobs if k in job})
        if v not in values:
            raise ConfigError(f"measure {stage.replace('_', '-')}: {flag_of(k)} {v} is not one of this config's "
                              f"({', '.join(map(str, values)) or 'none'})")
    named = " ".join(f"{flag_of(k)} {v}" for k, v in given.items())
    have = sorted({" ".join(f"{flag_of(k)} {job[k]}" for k in keys if k in job) for job in jobs})
    shown = "; ".join(have[:8]) + (f"; ... ({len(have)} in all)" if len(have) > 8 else "")
    raise ConfigError(f"measure {stage.replace('_', '-')} {named}: not a job of this config ({shown or 'none'})")
