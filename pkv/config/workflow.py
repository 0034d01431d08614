"""The Snakefile's checks at parse time (workflow/rules/common.smk), before any job runs:
what the command line overrides, whether the results folder's frozen config is the one
this invocation resolves to, what would make a job fail at once, and a lock against a
second run writing the same folder. Imports nothing heavy.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

from pkv.config.errors import ConfigError
from pkv.config.frozen import read_json
from pkv.config.merge import deep_merge, differences
from pkv.config.runs import SMOKE_ROOT, slug
from pkv.config.schema import coerce
from pkv.config.yaml_files import read_config_file


def command_line_overrides(config_args: dict, configfiles, own_configfile: str | Path, schema: dict) -> dict:
    """What the command line sets: the --configfile files other than the workflow's own
    config.yaml (each read strictly: a duplicate key is refused), then --config, typed by
    the schema. effective() applies it over the profile's section."""
    own = Path(own_configfile).resolve()
    out: dict = {}
    for f in configfiles:
        if Path(f).resolve() != own:
            out = deep_merge(out, read_config_file(f))
    return coerce(deep_merge(out, copy.deepcopy(dict(config_args))), schema)


def check_frozen(root: str | Path, cfg: dict, reference: bool) -> None:
    """Refuse a results folder whose frozen config.json is not what config.yaml and the
    command line resolve to now: a hand-edited frozen config would otherwise be used by
    every job (and a dry run would say nothing is to be done), and a changed config would
    leave the folder's tables from the old one looking current. One folder, one config."""
    path = Path(root, "config.json")
    if not path.is_file():
        return
    frozen = read_json(path, "frozen config")
    diff = differences(frozen, cfg)
    if not diff:
        return
    keys = f"{', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}"
    if reference:
        raise ConfigError(f"{path}: this config differs from the committed reference run's in {keys}; a changed "
                          "config is a new run: name it with --config run=NAME (it goes to results/runs/NAME/)")
    fix = "remove the folder to start over" if Path(root).as_posix() == SMOKE_ROOT else \
        "name a new run with --config run=NAME, or remove the folder to start over"
    raise ConfigError(f"{path}: differs from what config.yaml and the command line resolve to, in {keys} (edited "
                      f"by hand, or the config changed since this folder was frozen); a results folder holds the "
                      f"results of one config: {fix}")


def check_runnable(cfg: dict, reference: bool) -> None:
    """What would make a job of this plan fail, said before any runs. (A paper plan on a
    machine without a GPU is fine: its report jobs run; its measuring jobs each refuse in
    one line, pkv.cli.pipeline.check_device.)"""
    path = cfg["external"]["path"]
    if not reference and not Path(path).is_file():
        raise ConfigError(f"config: external.path {path}: no such file")


_LOCKS: dict[str, int] = {}
# Snakemake options after which the invocation writes no results (the workflow object
# does not say at parse time whether this is a dry run).
_NOT_WRITING = {"-n", "--dry-run", "--dryrun", "--lint", "--unlock", "--touch", "-t", "--summary", "-S",
                "--detailed-summary", "-D", "--list-rules", "--list", "-l", "--list-target-rules", "--lt", "--dag",
                "--rulegraph", "--filegraph", "--d3dag", "--report", "--list-changes", "--lc", "--cleanup-metadata",
                "--cm", "--containerize", "--generate-unit-tests", "--archive", "--export-cwl", "--help", "-h",
                "--version", "-v", "--print-compilation", "--delete-all-output", "--delete-temp-output"}


def writes_results(argv: list[str]) -> bool:
    """Whether a snakemake command line runs jobs (not a dry run, lint, unlock, listing...)."""
    return not any(a in _NOT_WRITING or re.fullmatch(r"-[a-zA-Z]*n[a-zA-Z]*", a) for a in argv)


def lock_folder(root: str | Path, hold: bool, lock_dir: str | Path = ".snakemake") -> None:
    """Say at once that another snakemake run is writing `root` (instead of Snakemake's
    advice to --rerun-incomplete the files that run has not finished yet). The lock is
    an flock, released by the kernel when its process ends however it ends, so a killed
    run never leaves it behind. `hold`: keep it for this process (a run that writes);
    else only test it (a dry run)."""
    import fcntl

    lock = Path(lock_dir) / f"pkv-{slug(str(root))}.lock"
    if str(lock) in _LOCKS:
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"{root}: another snakemake run (pid {holder}) is writing this results folder; wait for "
                          f"it to finish (the lock {lock} goes with that process)") from None
    if not hold:
        os.close(fd)
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    _LOCKS[str(lock)] = fd
