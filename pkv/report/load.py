"""What the report reads, and what it refuses to read.

A results folder with a frozen config.json is read by that config: under raw/<stage>/
exactly the files its jobs write (pkv.config.jobs), each once. Any other Parquet file
there (a copy, a renamed file, one from another config) is refused by name, and so is a
file whose rows are not the job its name says, or whose seed its stage may not use (the
held-out discipline, pkv.config.resolve.check_seed). A file the config names but the
folder lacks is a missing seed (flagged in the table) for the per-seed stages. Without a
config.json (a hand-made folder), every file is read and two files holding the same rows
are refused.

Every file must name one GPU model, one config hash and one constants hash: those of the
folder's config.json and calibration/constants.json, which must be readable and belong
together. An unreadable file is named in a one-line error.

Every timed file must hold what a measurement can hold (check_times): the columns a step
row has, each time a number, `wall_s` positive and finite, a device time positive and
finite or NaN (not measured, as on the CPU), every time within PLAUSIBLE_S and within a
factor PLAUSIBLE_SPREAD of the same step's other engines. A file that fails (a damaged,
truncated or hand-edited one) is refused naming the file and the column, never averaged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from pkv.config.jobs import ROW_KEYS, stage_files
from pkv.config.resolve import ConfigError, load_config
from pkv.config.seeds import SEED_ROLES, check_seed
from pkv.core.io import dict_hash, file_hash, read_meta
from pkv.report.ratios import trace_label
from pkv.report.spec import PER_SEED_STAGES

# What a step row of a timed stage must have, and its measured times: wall_s always, the
# device times where measured (NaN on the CPU). nsight_kernels holds Nsight's own columns.
STEP_COLUMNS = ("stage", "engine", "step", "wall_s", "cuda_s")
TIMES = ("wall_s", "cuda_s", "graph_s")
UNTIMED_STAGES = frozenset({"nsight_kernels"})
# A step of decode attention (a model step at most) lasts between a nanosecond and an hour,
# and no engine is 10^5 times faster or slower than the others on the same step: outside
# either range a value is damaged, not measured. (The committed runs' widest spread is
# below 10^3.)
PLAUSIBLE_S = (1e-9, 3600.0)
PLAUSIBLE_SPREAD = 1e5

# Row columns that tell two measurements apart: two files sharing a row are one job twice.
IDENTITY = ("stage", "trace", "family", "max_active", "seed", "engine", "split", "group", "layers", "kv_dtype", "step")


@dataclass
class Raw:
    """The rows and per-file metadata of the stages a target reads."""

    frame: pd.DataFrame
    metas: list[dict]
    smoke: bool
    missing_seeds: dict[str, list[int]] = field(default_factory=dict)   # row label -> seeds without a file


class MissingStage(ValueError):
    """A target's stage has not been measured in this results folder."""


class ReportError(ValueError):
    """A results folder that cannot be reported as it is (one line, naming the file)."""


def check_folder(root: Path) -> None:
    if not root.exists():
        raise ReportError(f"{root}: no such results folder")
    if not root.is_dir():
        raise ReportError(f"{root}: not a folder")
    if not (root / "raw").is_dir():
        raise ReportError(f"{root}: not a results folder (no raw/ inside; name the folder that holds raw/)")


def frozen(root: Path) -> tuple[dict | None, str | None, str | None]:
    """(config, config hash, constants hash) of the folder's frozen files, where it has
    them; a config.json that is not a valid frozen config, or constants that are not
    readable or were frozen for another config, are refused naming the file."""
    cfg_path, const_path = root / "config.json", root / "calibration" / "constants.json"
    cfg = None
    if cfg_path.exists():
        try:
            cfg = load_config(cfg_path)
        except ConfigError as e:
            raise ReportError(str(e)) from None
    if not const_path.exists():
        return cfg, cfg and dict_hash(cfg), None
    try:
        constants = json.loads(const_path.read_text())
    except (OSError, ValueError) as e:
        raise ReportError(f"{const_path}: not a readable constants file ({e})") from None
    if not isinstance(constants, dict):
        raise ReportError(f"{const_path}: not a constants file (expected a JSON object)")
    if cfg is not None and constants.get("config_hash") != dict_hash(cfg):
        raise ReportError(f"{const_path}: frozen for config hash {constants.get('config_hash', 'none')}, but "
                          f"{cfg_path} has hash {dict_hash(cfg)}; recalibrate (snakemake reruns calibrate_device)")
    return cfg, cfg and dict_hash(cfg), file_hash(const_path)


def _one(values: dict[str, list[Path]], what: str, root: Path, frozen_value: str | None, frozen_file: str) -> None:
    values = {k: v for k, v in values.items() if k != "none"}
    if frozen_value is not None:
        wrong = {k: v for k, v in values.items() if k != frozen_value}
        if wrong:
            k, files = sorted(wrong.items())[0]
            raise ReportError(f"{files[0]}: {what} {k} is not this folder's ({frozen_value}, {root / frozen_file}); "
                              f"{sum(len(v) for v in wrong.values())} file(s) come from another run: rerun them or "
                              "report them separately")
    if len(values) > 1:
        listing = "; ".join(f"{k}: {v[0].name}{' and others' if len(v) > 1 else ''}" for k, v in sorted(values.items()))
        raise ReportError(f"{root} mixes results of several {what}es ({listing}); report each run's folder separately")


def _read(f: Path) -> tuple[dict, pd.DataFrame]:
    import pyarrow.parquet as pq

    try:
        return read_meta(f), pq.read_table(f).to_pandas()
    except Exception as e:  # noqa: BLE001 - any reader failure is this file's fault
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ReportError(f"{f}: unreadable Parquet ({why})") from None


def _seed_column(f: Path) -> list[int]:
    import pyarrow.parquet as pq

    try:
        return sorted({int(s) for s in pq.read_table(f, columns=["seed"]).column("seed").to_pylist()})
    except Exception:  # noqa: BLE001 - a stray that cannot be read is refused as a stray
        return []


def _files(root: Path, stages: tuple[str, ...], cfg: dict | None) -> tuple[list[tuple[str, Path, dict | None]], list]:
    """(stage, file, job) of every file to read, and (stage, job) of every missing one."""
    files, missing = [], []
    for stage in stages:
        folder = root / "raw" / stage
        present = sorted(folder.glob("*.parquet")) if folder.is_dir() else []
        if cfg is None:
            files += [(stage, f, None) for f in present]
            continue
        expected = stage_files(cfg, stage)
        for f in present:
            if f.name in expected:
                continue
            if stage in SEED_ROLES:   # a file on a seed its stage may not use says so
                for seed in _seed_column(f):
                    check_seed(cfg, stage, seed, f"{f}: seed")
            names = sorted(expected)
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "") or "none"
            raise ReportError(f"{f}: not one of the files {root / 'config.json'} implies under {folder} ({shown}); "
                              "a copy, a renamed file or one from another config is never read: remove it")
        for name, job in expected.items():
            (files if (folder / name).is_file() else missing).append((stage, folder / name, job))
    files.sort(key=lambda t: t[1])
    return files, missing


def _check_rows(stage: str, f: Path, frame: pd.DataFrame, job: dict | None, cfg: dict | None) -> None:
    """The rows are the job the file's name says, on a seed the stage may use."""
    if cfg is not None and stage in SEED_ROLES and "seed" in frame.columns:
        for seed in sorted({int(s) for s in frame["seed"].unique()}):
            try:
                check_seed(cfg, stage, seed, f"{f}: seed")
            except ConfigError as e:
                raise ReportError(str(e)) from None
    for key in ROW_KEYS:
        if job is None or key not in job or key not in frame.columns:
            continue
        have = sorted({v.item() if hasattr(v, "item") else v for v in frame[key].unique()}, key=str)
        if have != [job[key]]:
            raise ReportError(f"{f}: holds rows of {key} {', '.join(map(str, have))}, but its name says {key} "
                              f"{job[key]} (renamed or copied?); rerun its job")


def check_times(stage: str, f: Path, frame: pd.DataFrame) -> None:
    """The file's schema and physical sanity (the module's docstring); one ReportError line
    naming the file and the column."""
    if stage in UNTIMED_STAGES:
        return
    missing = [c for c in STEP_COLUMNS if c not in frame.columns]
    if missing:
        raise ReportError(f"{f}: no column {', '.join(missing)}: not a complete {stage} file (truncated or "
                          "written by something else); rerun its job")
    for col in (c for c in TIMES if c in frame.columns):
        values = frame[col]
        if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
            raise ReportError(f"{f}: column {col} holds {values.dtype} values, not times in seconds; rerun its job")
        values = values.astype("float64")
        measured = values.notna() if col != "wall_s" else pd.Series(True, index=values.index)
        lo, hi = PLAUSIBLE_S
        bad = measured & ~((values >= lo) & (values <= hi))   # NaN, inf, 0, negative and absurd values
        if bad.any():
            i = bad.idxmax()
            raise ReportError(f"{f}: column {col} row {i} (engine {frame.at[i, 'engine']}, step {frame.at[i, 'step']}) "
                              f"is {float(values[i])!r} s, outside a plausible {lo:g}..{hi:g} s; a damaged file: "
                              "rerun its job")
        _check_spread(f, frame, col, values[measured])


def _check_spread(f: Path, frame: pd.DataFrame, col: str, values: pd.Series) -> None:
    """Each engine's time against the median of the same step (same identity but the engine)."""
    keys = [c for c in IDENTITY if c in frame.columns and c != "engine"]
    if values.empty:
        return
    logs = values.map(math.log10)
    groups = frame.loc[values.index, keys]
    by = logs.groupby([groups[k] for k in keys], dropna=False, sort=False)
    median = by.transform("median")
    off = (logs - median).abs()
    off = off.where(by.transform("size") != 2, 2 * off)   # of two engines, the median is halfway between them
    if off.max() > math.log10(PLAUSIBLE_SPREAD):
        i = off.idxmax()
        raise ReportError(f"{f}: column {col} row {i} (engine {frame.at[i, 'engine']}, step {frame.at[i, 'step']}) "
                          f"is {values[i]:.3g} s, {10 ** off[i]:.3g} times off the same step's other engines "
                          f"(median {10 ** median[i]:.3g} s); a damaged file: rerun its job")


def _check_duplicates(read: list[tuple[str, Path, dict, pd.DataFrame]]) -> None:
    """Two files that hold the same measurement (a copy beside its original) are refused."""
    seen: dict[tuple, Path] = {}
    for stage, f, meta, frame in read:
        cols = [c for c in IDENTITY if c in frame.columns]
        if "engine" not in cols or "step" not in cols:
            continue
        keys = set(frame[cols].drop_duplicates().itertuples(index=False, name=None))
        for key in keys:
            key = (stage, meta.get("engine_set"), *key)
            if key in seen and seen[key] != f:
                raise ReportError(f"{f}: holds the same measurements as {seen[key]} (a copy?); each job's file is "
                                  "read once: remove one")
        for key in keys:
            seen[(stage, meta.get("engine_set"), *key)] = f


def load(root: Path, stages: tuple[str, ...], required: bool = True) -> Raw:
    cfg, frozen_config, frozen_constants = frozen(root)
    files, missing = _files(root, stages, cfg)
    if not files and required:
        raise MissingStage(f"no Parquet under {', '.join(str(root / 'raw' / s) for s in stages)}; run the stage first")
    read = []
    for stage, f, job in files:
        meta, frame = _read(f)
        check_times(stage, f, frame)
        _check_rows(stage, f, frame, job, cfg)
        read.append((stage, f, meta, frame))
    if cfg is None:
        _check_duplicates(read)
    metas = [m for _, _, m, _ in read]
    gpus = sorted({m.get("gpu", "unknown") for m in metas})
    if len(gpus) > 1:
        raise ReportError(f"{root} mixes results from several GPU models ({', '.join(gpus)}); "
                          "report each GPU's results folder separately")
    by_config: dict[str, list[Path]] = {}
    by_constants: dict[str, list[Path]] = {}
    for _, f, m, _ in read:
        by_config.setdefault(m.get("config_hash", "none"), []).append(f)
        if m.get("stage") != "calibrate":
            by_constants.setdefault(m.get("constants_hash", "none"), []).append(f)
    _one(by_config, "config hash", root, frozen_config, "config.json")
    _one(by_constants, "constants hash", root, frozen_constants, "calibration/constants.json")
    frame = pd.concat([fr for _, _, _, fr in read], ignore_index=True) if read else pd.DataFrame()
    raw = Raw(frame, metas, _smoke(root, metas, cfg))
    if set(stages) & set(PER_SEED_STAGES):
        raw.missing_seeds = _missing_from_jobs(missing) if cfg is not None else missing_seeds(frame, set())
    return raw


def _smoke(root: Path, metas: list[dict], cfg: dict | None) -> bool:
    """Whether the tables carry the smoke banner: from the files read, else (a stage
    without files, Nsight off) from the config, else from the calibration file."""
    if metas:
        return any(m.get("profile") == "smoke" for m in metas)
    if cfg is not None:
        return cfg["profile"] == "smoke"
    first = sorted(root.glob("raw/*/*.parquet"))[:1]
    return any(_read(f)[0].get("profile") == "smoke" for f in first)


def _missing_from_jobs(missing: list[tuple[str, Path, dict]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for stage, _, job in missing:
        if stage in PER_SEED_STAGES and "family" in job:
            out.setdefault(f"{stage}: {trace_label(job['family'], int(job['max_active']))}", []).append(job["seed"])
    return {k: sorted(v) for k, v in sorted(out.items())}


def missing_seeds(frame: pd.DataFrame, expected: set[int]) -> dict[str, list[int]]:
    """Row label -> held-out seeds it lacks, over the per-seed stages in `frame`: each
    (stage, family, batch) should have every seed of `expected` (or, when empty, every
    seed any of them has)."""
    if frame.empty:
        return {}
    rows = frame[frame["stage"].isin(PER_SEED_STAGES)]
    expected = expected or {int(s) for s in rows["seed"].unique()}
    out = {}
    for (stage, family, batch), g in rows.groupby(["stage", "family", "max_active"], sort=True, observed=True):
        lack = sorted(expected - {int(s) for s in g["seed"].unique()})
        if lack:
            out[f"{stage}: {trace_label(family, int(batch))}"] = lack
    return out


def seeds_cell(raw: Raw, stage: str, family: str, batch: int, have: int) -> str:
    """The Seeds column: the count, and which are missing when any is."""
    lack = raw.missing_seeds.get(f"{stage}: {trace_label(family, batch)}")
    return f"{have} of {have + len(lack)} (missing {', '.join(map(str, lack))})" if lack else str(have)
