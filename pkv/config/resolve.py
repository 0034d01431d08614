"""The resolved experiment configuration every measuring command reads, and where a run goes.

config.yaml holds the paper configuration and a `smoke:` section of overrides. The
Snakefile coerces command-line strings through the schema (`coerce`), validates, resolves
`profile: auto` once (paper with a GPU, smoke without), deep-merges the smoke overrides
when needed, checks what the schema cannot say (`check_config`) and freezes the result to
`<root>/config.json`; commands read only that file, so its hash is the config hash in
every Parquet file and in calibration/constants.json. Every command refuses a frozen
config that fails those checks, and constants frozen for another config (`check_constants`).

Where a run goes (`run_root`): the committed reference run is `results/`; a paper run on
a machine with a GPU goes to `results/runs/<gpu>-<date>/` (or `results/runs/<run>/` with
`--config run=NAME`) and never writes into `results/`; without a GPU the paper profile
plans against the reference (a fresh clone has nothing to do); `run=reference` targets it
on purpose. The smoke profile always writes `results/smoke/`.

Imports nothing heavy: the Snakefile imports this module at parse time.
"""

from __future__ import annotations

import copy
import datetime
import json
import math
import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

from pkv.config.errors import ConfigError
from pkv.config.seeds import check_seed_roles
from pkv.core.io import atomic_write_text, dict_hash

PROFILES = ("paper", "smoke")
REFERENCE_ROOT = "results"
SMOKE_ROOT = "results/smoke"
RUNS_ROOT = "results/runs"
SMOKE_BANNER = "CPU smoke — not a performance result"
# Keys of config.yaml that say where and what to build, not what is measured: they are
# not part of the frozen config (nor of its hash).
NOT_FROZEN = ("smoke", "run")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
INT_TEXT = re.compile(r"^[+-]?[0-9]+$")
FLOAT_TEXT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$")


# ---------------------------------------------------------------- strict YAML


def strict_yaml(text: str, source: str):
    """YAML as yaml.safe_load reads it, but a key given twice in one mapping is refused
    (file and line), instead of the last one silently winning."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                if key in seen:
                    raise ConfigError(f"{source}:{key_node.start_mark.line + 1}: key {key!r} given twice (first on "
                                      f"line {seen[key] + 1}); one of them would silently be ignored")
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep)

    try:
        _refuse_cycles(yaml.compose(text, Loader=Loader), source)
        return yaml.load(text, Loader=Loader)   # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: not valid YAML ({getattr(e, 'problem', None) or e})") from None


def _refuse_cycles(root, source: str) -> None:
    """Refuse a document that contains itself through an alias (`a: &x [1, *x]`): every
    reader of a config walks it to its leaves, so it would recurse without end."""
    import yaml

    stack = [(root, ())]
    while stack:
        node, ancestors = stack.pop()
        if any(node is a for a in ancestors):
            raise ConfigError(f"{source}:{node.start_mark.line + 1}: a YAML alias refers to the node that contains "
                              "it (the anchor on this line); a config cannot contain itself")
        if isinstance(node, yaml.SequenceNode):
            stack += [(child, (*ancestors, node)) for child in node.value]
        elif isinstance(node, yaml.MappingNode):
            stack += [(child, (*ancestors, node)) for pair in node.value for child in pair]


def read_config_file(path: str | Path) -> dict:
    """A config file (config.yaml, a --configfile) read by strict_yaml."""
    try:
        doc = strict_yaml(Path(path).read_text(), str(path))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if doc is not None and not isinstance(doc, dict):
        raise ConfigError(f"{path}: a config file must be a mapping of keys, got {type(doc).__name__}")
    return doc or {}


# ---------------------------------------------------------------- profile and run folder


def resolve_profile(requested: str, cuda_available: bool) -> str:
    if requested == "auto":
        return "paper" if cuda_available else "smoke"
    if requested not in PROFILES:
        raise ConfigError(f"profile must be auto, paper or smoke, got {requested!r}")
    return requested


@cache
def gpu_name() -> str | None:
    """The first GPU's name from `nvidia-smi` (no torch import), or None without one."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def slug(text: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def run_root(profile: str, run: str, gpu: str | None, today: datetime.date | None = None) -> str:
    """The results folder of this invocation (module docstring)."""
    if profile == "smoke":
        return SMOKE_ROOT
    if run == "reference" or (run == "auto" and gpu is None):
        return REFERENCE_ROOT
    if run == "auto":
        today = today or datetime.datetime.now(datetime.timezone.utc).date()
        return f"{RUNS_ROOT}/{slug(gpu)}-{today.isoformat()}"
    if not RUN_NAME.match(run) or run in ("auto", "reference"):
        raise ConfigError(f"config: run {run!r} must be auto, reference or a folder name of letters, digits, '.', '_', '-'")
    return f"{RUNS_ROOT}/{run}"


# ---------------------------------------------------------------- resolving and checking


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`: dicts merge key by key, anything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else copy.deepcopy(value)
    return out


def effective(config: dict, profile: str, overrides: dict | None = None) -> dict:
    """The configuration a profile runs: smoke overrides merged in, `smoke:` and `run` dropped.

    `overrides` are the values given on the command line (`--config`, and --configfile
    files other than config.yaml): they win over the profile's section too, so that
    `--config 'measure={max_steps: 4}'` means 4 steps on the smoke profile as well.
    """
    base = copy.deepcopy({k: v for k, v in config.items() if k not in NOT_FROZEN})
    merged = deep_merge(base, config.get("smoke", {})) if profile == "smoke" else base
    if overrides:
        merged = deep_merge(merged, {k: v for k, v in overrides.items() if k not in NOT_FROZEN})
    merged["profile"] = profile
    return merged


def _resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        node = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = {**node, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def coerce(value, schema: dict, root: dict | None = None):
    """`value` with strings turned into the integers, numbers and booleans the schema asks
    for ("4" -> 4, "1e-3" -> 0.001, "0.5" -> 0.5, "true"/"True" -> True).

    Snakemake parses a nested `--config key={a: 4}` without types (every leaf a string);
    this gives it the types the same text would have in config.yaml. Dicts and lists
    are changed in place (and returned); anything the schema does not type is left alone.
    """
    root = schema if root is None else root
    s = _resolve(schema, root)
    if isinstance(value, dict):
        props, extra = s.get("properties", {}), s.get("additionalProperties")
        for key in list(value):
            sub = props.get(key, extra if isinstance(extra, dict) else None)
            if sub is not None:
                value[key] = coerce(value[key], sub, root)
        return value
    if isinstance(value, list):
        if isinstance(s.get("items"), dict):
            value[:] = [coerce(v, s["items"], root) for v in value]
        return value
    if not isinstance(value, str):
        return value
    kind = s.get("type")
    if kind is None and s.get("enum") and all(isinstance(e, int) and not isinstance(e, bool) for e in s["enum"]):
        kind = "integer"
    text = value.strip()
    if kind in ("integer", "number") and INT_TEXT.match(text):
        return int(text)
    if kind == "number" and FLOAT_TEXT.match(text):
        return float(text)
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    return value


SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"


def load_schema(path: str | Path = SCHEMA_PATH) -> dict:
    """The config schema, with the names only the code's tables know filled in: the engine
    specs and the model-step runners (pkv.engines.table) and the trace families
    (pkv.core.families), so a new engine, runner or family needs no schema edit."""
    from pkv.core.families import FAMILIES
    from pkv.engines.table import runners, spec_pattern

    schema = read_config_file(path)
    schema["$defs"]["engine"]["pattern"] = spec_pattern()
    schema["$defs"]["family"]["enum"] = list(FAMILIES)
    # Every family has its trace sizes under traces.<family> (all required, no other key).
    schema["$defs"]["sections"]["traces"]["properties"] = {f: {"$ref": "#/$defs/trace_size"} for f in FAMILIES}
    schema["properties"]["traces"]["required"] = list(FAMILIES)
    schema["$defs"]["sections"]["model_step"]["properties"]["engines"]["items"]["enum"] = list(runners())
    return schema


def _not_finite(value, path: tuple = ()) -> tuple | None:
    """The path of the first NaN or infinite number in `value`, if any (JSON schema's
    minimum/maximum let NaN through: every comparison with it is false)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        found = _not_finite(sub, (*path, key))
        if found is not None:
            return found
    return None


@cache
def _validator_class():
    import jsonschema

    # An integer is a Python int, never a float that happens to be integral (20260623.0):
    # JSON schema would accept it, then a job would fail on it with a traceback.
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)


def validate_config(cfg: dict, schema: dict, source: str = "config") -> None:
    """JSON-schema validation with one line per failure: source, the key's dotted path
    and the schema's message ("'nsigth' was unexpected", "-1.0 is less than ..."); NaN
    and infinities are refused first, naming the key."""
    import jsonschema

    bad = _not_finite(cfg)
    if bad is not None:
        where = ".".join(str(p) for p in bad)
        raise ConfigError(f"{source}: {where}: {_dig(cfg, bad)} is not a finite number")
    error = jsonschema.exceptions.best_match(_validator_class()(schema).iter_errors(cfg))
    if error is not None:
        where = ".".join(str(p) for p in error.absolute_path) or "(top level)"
        raise ConfigError(f"{source}: {where}: {error.message}")


def _dig(cfg, path: tuple):
    for key in path:
        cfg = cfg[key]
    return cfg


def _points_used(cfg: dict) -> list[tuple[str, dict]]:
    a = cfg["ablations"]
    used = [(f"ablations.split_sensitivity.points[{i}]", p) for i, p in enumerate(a["split_sensitivity"]["points"])]
    used += [(f"ablations.{n}", a[n]) for n in ("b4_sweep", "gqa_sweep", "raggedness", "implementation", "kv_fp8")
             if n in a]
    used += [("mlp_proxy", cfg["mlp_proxy"]), ("external.operating_point", cfg["external"]["operating_point"]),
             ("nsight_capture", cfg["nsight_capture"])]
    return used


def check_config(cfg: dict, source: str = "config") -> None:
    """What the JSON schema cannot say; raises ConfigError (one line, naming the key)."""
    check_seed_roles(cfg, source)
    serving = {(p["family"], p["max_active"]) for p in cfg["serving"]}
    for key, p in _points_used(cfg):
        if (p["family"], p["max_active"]) not in serving:
            raise ConfigError(f"{source}: {key} uses ({p['family']}, max_active {p['max_active']}), which is not a "
                              "`serving` point, so calibration freezes no split for it")
    for key, specs in [("baselines", cfg["baselines"])] + [(f"engine_sets.{n}", s) for n, s in cfg["engine_sets"].items()]:
        if len(set(specs)) != len(specs):
            raise ConfigError(f"{source}: {key} names an engine twice")


def differences(a, b, prefix: str = "") -> list[str]:
    """Dotted keys where two configs differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key) if key in a and key in b \
                else [f"{prefix}.{key}" if prefix else key]
        return out
    return [] if a == b else [prefix or "(whole config)"]


# ---------------------------------------------------------------- the frozen files


def write_config(config: dict, path: str | Path) -> None:
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice in one object")
        out[key] = value
    return out


def _read_json(path: str | Path, what: str) -> dict:
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
    cfg = _read_json(path, "frozen config")
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
    constants = _read_json(constants_path, "constants file")
    want, got = config_hash(cfg), constants.get("config_hash", "none")
    if got != want:
        raise ConfigError(f"{constants_path}: frozen for config hash {got}, but this config's hash is {want}; "
                          "recalibrate (snakemake reruns calibrate_device when the config changes)")
    return constants


def shape_of(config: dict, num_kv_heads: int | None = None):
    """The configured shape; `num_kv_heads` overrides H_kv (GQA sweep: G = H_qo / H_kv)."""
    from pkv.core.shape import Shape

    s = dict(config["shape"])
    if num_kv_heads is not None:
        s["num_kv_heads"] = num_kv_heads
    return Shape.from_config(s)


def device_of(config) -> str:
    """Smoke always runs on the CPU engines; paper runs on the GPU (a config dict or its
    typed view, pkv.config.typed.Config)."""
    profile = config["profile"] if isinstance(config, dict) else config.profile
    return "cpu" if profile == "smoke" else "cuda"


def point_key(family: str, max_active: int) -> str:
    return f"{family}-b{max_active}"
