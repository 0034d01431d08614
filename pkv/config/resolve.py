"""The resolved experiment configuration every measuring command reads, and where a run goes:
the one import of the config's pieces, each in a module of its own role.

config.yaml holds the paper configuration and a `smoke:` section of overrides. The
Snakefile reads config files strictly (pkv.config.yaml_files), types command-line
strings and validates by the schema (pkv.config.schema), resolves `profile: auto` and
the results folder (pkv.config.runs), merges the profile's section and the command
line's values (pkv.config.merge), checks what the schema cannot say
(pkv.config.checks) and freezes the result to `<root>/config.json`; commands read only
that file (pkv.config.frozen), so its hash is the config hash in every Parquet file and
in calibration/constants.json. pkv.config.access holds the small readings of a config the
measuring code shares.

Imports nothing heavy: the Snakefile imports this module at parse time.
"""

from __future__ import annotations

from pkv.config.access import device_of, point_key, shape_of
from pkv.config.checks import check_config
from pkv.config.errors import ConfigError
from pkv.config.frozen import check_constants, config_hash, load_config, write_config
from pkv.config.merge import NOT_FROZEN, deep_merge, differences, effective
from pkv.config.runs import (
                             PROFILES,
                             REFERENCE_ROOT,
                             RUN_NAME,
                             RUNS_ROOT,
                             SMOKE_BANNER,
                             SMOKE_ROOT,
                             gpu_name,
                             resolve_profile,
                             run_root,
                             slug,
)
from pkv.config.schema import SCHEMA_PATH, coerce, load_schema, validate_config
from pkv.config.yaml_files import read_config_file, strict_yaml

__all__ = ["NOT_FROZEN", "PROFILES", "REFERENCE_ROOT", "RUNS_ROOT", "RUN_NAME", "SCHEMA_PATH", "SMOKE_BANNER",
           "SMOKE_ROOT", "ConfigError", "check_config", "check_constants", "coerce", "config_hash",
           "deep_merge", "device_of", "differences", "effective", "gpu_name", "load_config", "load_schema",
           "point_key", "read_config_file", "resolve_profile", "run_root", "shape_of", "slug", "strict_yaml",
           "validate_config", "write_config"]
