"""The config schema (workflow/schemas/config.schema.yaml): loading it with the names only
the code's tables know, typing command-line strings by it, and validating a config
against it in one line per failure. Imports nothing heavy (jsonschema when validating)."""

from __future__ import annotations

import math
import re
from functools import cache
from pathlib import Path

from pkv.config.errors import ConfigError
from pkv.config.yaml_files import read_config_file

INT_TEXT = re.compile(r"^[+-]?[0-9]+$")
FLOAT_TEXT = re.compile(r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$")


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


@cache
def _schema_file() -> dict:
    return read_config_file(SCHEMA_PATH)


def schema_default(definition: str, key: str):
    """The schema's `default:` of an optional key: `key` of the object `$defs.<definition>`
    ("sections.shape", "trace_size"). The one place a value the config may leave out is
    written; the typed view (pkv.config.typed) takes its field defaults from here."""
    node = _schema_file()["$defs"]
    for part in definition.split("."):
        node = node[part]
    prop = node["properties"][key]
    if "default" not in prop:
        raise KeyError(f"{SCHEMA_PATH}: {definition}.{key} has no default")
    return prop["default"]


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
