"""The jobs a config implies, stage by stage, and the Parquet file each writes.

One definition for the measuring commands (a job's flags must name one of these jobs, on
a seed the stage may use: pkv.config.seeds.check_seed) and for the report (it reads
exactly these files under raw/<stage>/, refusing any other file there by name).
workflow/rules/*.smk name the same files as their outputs (tests/test_bad_input.py
checks that the two agree for the paper and the smoke profile).

Imports nothing heavy (the Snakefile may import it at parse time).
"""

from __future__ import annotations

from pkv.config.errors import ConfigError
from pkv.config.seeds import check_seed, stage_seeds
from pkv.config.stages import STAGES

# raw/<stage>/<file> of one job, from its identity (the keys of stage_jobs' dicts): the
# stages of the table with a job grid whose files the report reads as they are.
STAGE_FILES = {name: stage.file for name, stage in STAGES.items() if stage.grid is not None and stage.raw}
# Identity keys that are also columns of every row of the job's file (the report checks
# that a file holds the job its name says).
ROW_KEYS = ("family", "max_active", "seed", "group")


def stage_jobs(cfg: dict, stage: str) -> list[dict]:
    """Every job of `stage` under `cfg`, as identity dicts (in the order of the config):
    the row's job grid on the seeds its seed role gives."""
    row = STAGES.get(stage)
    if row is None or row.grid is None:
        raise ValueError(f"unknown stage {stage!r}" if row is None else f"stage {stage!r} has no job grid")
    return row.grid(cfg, stage_seeds(cfg, stage) if row.seeds else ())


def file_name(stage: str, job: dict) -> str:
    return STAGES[stage].file.format(**job)


def stage_files(cfg: dict, stage: str) -> dict[str, dict]:
    """File name under raw/<stage>/ -> the job that writes it."""
    return {file_name(stage, job): job for job in stage_jobs(cfg, stage)}


def stage_pattern(stage: str, root: str = "") -> str:
    """<root>/raw/<folder>/<file pattern> of a stage's jobs (its rule's output, with the
    job identity's keys as wildcards)."""
    row = STAGES[stage]
    return f"{root}/raw/{row.folder or stage}/{row.file}" if root else f"raw/{row.folder or stage}/{row.file}"


def stage_paths(cfg: dict, stage: str, root: str) -> list[str]:
    """<root>/raw/<folder>/<file> of every job of `stage` under `cfg`: the files its rule
    makes and the tables that read it wait for."""
    return [stage_pattern(stage, root).format(**job) for job in stage_jobs(cfg, stage)]


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
