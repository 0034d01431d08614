"""The frozen files of a run: `<root>/config.json`, which every command reads (its hash is
the config hash in every Parquet file and in calibration/constants.json), and the
constants calibration froze for it. Every command refuses a frozen config that fails the
schema or check_config, and constants frozen for another config. Imports nothing heavy."""

from __future__ import annotations

import json
from pathlib import Path

from pkv.config.checks import check_config
from pkv.config.errors import ConfigError
from pkv.config.schema import SCHEMA_PATH, load_schema, validate_config
from pkv.core.io import atomic_write_text, dict_hash


def write_config(config: dict, path: str | Path) -> None:
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def read_json(path: str | Path, what: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text(), object_pairs_hook=_unique_keys)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {what}") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a {what}") from None
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError, a repeated key
        raise ConfigError(f"{path}: not a valid {what} ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what} ({e.strerror})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a valid {what} (expected a JSON object)")
    return doc


def load_config(path: str | Path) -> dict:
    """The frozen config.json, checked (check_config) before anything runs."""
    cfg = read_json(path, "frozen config")
    if SCHEMA_PATH.is_file():   # beside a checkout (always, for the pipeline's jobs)
        validate_config(cfg, load_schema(), str(path))
    try:
        check_config(cfg, str(path))
    except KeyError as e:
        raise ConfigError(f"{path}: missing key {e} (not a frozen config of this version?)") from None
    return cfg


def config_hash(config: dict) -> str:
    return dict_hash(config)


def check_constants(cfg: dict, constants_path: str | Path) -> dict:
    """The constants file's content, if it was frozen by calibrating on exactly `cfg`."""
    constants = read_json(constants_path, "constants file")
    want, got = config_hash(cfg), constants.get("config_hash", "none")
    if got != want:
        raise ConfigError(f"{constants_path}: frozen for config hash {got}, but this config's hash is {want}; "
                          "recalibrate (snakemake reruns calibrate_device when the config changes)")
    return constants
