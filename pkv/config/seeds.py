"""The held-out discipline: which of the config's seeds each stage may measure on.

One definition, checked by check_config (pkv.config.resolve, through check_seed_roles),
by every measuring command (pkv.config.jobs.check_job) and by the report
(pkv.report.load). Imports nothing heavy (the Snakefile reaches it at parse time).
"""

from __future__ import annotations

from pkv.config.errors import ConfigError
from pkv.config.stages import STAGES

# Which of the config's seeds each stage may measure on: the one definition of the seed
# discipline (each stage's row of pkv.config.stages names its role), checked by
# check_config, by every measuring command (check_seed) and by the report (a file of a
# stage on any other seed is refused, named). Calibration alone sees the calibration
# seed; every other stage sees only held-out seeds (the ablation seed must not be the
# calibration seed either).
SEED_ROLES = {name: stage.seeds for name, stage in STAGES.items() if stage.seeds}


def role_seeds(cfg: dict, role: str) -> tuple[int, ...]:
    """The seeds of one role of SEED_ROLES (seeds.heldout is a list, the others one seed)."""
    seeds = cfg["seeds"][role]
    return tuple(seeds) if isinstance(seeds, list) else (seeds,)


def stage_seeds(cfg: dict, stage: str) -> tuple[int, ...]:
    """The seeds `stage` may run on under `cfg` (SEED_ROLES)."""
    return role_seeds(cfg, STAGES[stage].seeds)


def check_seed_roles(cfg: dict, source: str = "config") -> None:
    """The config itself: no role of SEED_ROLES but calibration's holds the calibration seed."""
    cal = cfg["seeds"]["calibration"]
    why = {"heldout": f"seeds.calibration {cal} is also in seeds.heldout; calibration must never see a held-out seed",
           "ablation": f"seeds.ablation {cal} is the calibration seed; ablations must run on a held-out seed"}
    for role in dict.fromkeys(r for r in SEED_ROLES.values() if r != "calibration"):
        if cal in role_seeds(cfg, role):
            raise ConfigError(f"{source}: {why[role]}")


def check_seed(cfg: dict, stage: str, seed, source: str = "--seed") -> int:
    """`seed` if `stage` may run on it under `cfg`; else one ConfigError line naming
    `source` (a flag, or a file of the report) and the seeds it may use."""
    allowed = stage_seeds(cfg, stage)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed not in allowed:
        role = STAGES[stage].seeds
        if seed == cfg["seeds"]["calibration"] and role != "calibration":
            why = "is the calibration seed, which no measurement other than calibration may use"
        else:
            why = "is not one of this config's seeds for the stage"
        names = {"calibration": "the calibration seed", "heldout": "the held-out seeds seeds.heldout",
                 "ablation": "the ablation seed seeds.ablation"}[role]
        raise ConfigError(f"{source} {seed} {why}: {stage} runs on {names} ({', '.join(map(str, allowed))})")
    return seed
