"""The typed config (pkv.config.typed): its fields are exactly the schema's keys, its defaults
the schema's, it loads the committed reference run's frozen config and the smoke config,
gives the dict back with the schema's defaults filled in, and refuses an unknown or a
missing key by its path."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import yaml

from pkv.config import typed
from pkv.config.resolve import ConfigError, effective, load_schema, resolve_profile
from pkv.config.typed import Config
from worktree import REPO

SCHEMA = load_schema()
CONFIG = yaml.safe_load((REPO / "config.yaml").read_text())


def _resolve(node: dict) -> dict:
    while "$ref" in node:
        target = SCHEMA
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _dataclass_of(kind):
    """The dataclass a field holds (itself, in a tuple, or Optional), else None."""
    for arg in (kind, *typing.get_args(kind)):
        if dataclasses.is_dataclass(arg):
            return arg
        inner = [a for a in typing.get_args(arg) if dataclasses.is_dataclass(a)]
        if inner:
            return inner[0]
    return None


def _mismatches(cls, node: dict, where: str) -> list[str]:
    node = _resolve(node)
    props = node.get("properties", {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    out = [f"{where}: {k} in the schema, not in {cls.__name__}" for k in props if k not in fields]
    out += [f"{where}: {k} in {cls.__name__}, not in the schema" for k in fields if k not in props]
    hints = typing.get_type_hints(cls)
    for name in set(props) & set(fields):
        sub = _resolve(props[name])
        # A default is written once, in the schema: a field defaults to it, or to None (absent = off).
        default = fields[name].default
        want = tuple(sub["default"]) if isinstance(sub.get("default"), list) else sub.get("default")
        if "default" in sub and default != want:   # a list default is the field's tuple
            out.append(f"{where}.{name}: the schema's default {sub['default']!r}, the field's {default!r}")
        if "default" not in sub and default not in (dataclasses.MISSING, None):
            out.append(f"{where}.{name}: a default {default!r} in {cls.__name__}, none in the schema")
        inner = _dataclass_of(hints[name])
        if sub.get("type") == "array" and isinstance(sub.get("items"), dict):
            sub = _resolve(sub["items"])
        if "properties" in sub:
            if inner is None:
                out.append(f"{where}.{name}: an object in the schema, not a dataclass")
            else:
                out += _mismatches(inner, sub, f"{where}.{name}")
        elif inner is not None and sub.get("type") != "object":
            out.append(f"{where}.{name}: a dataclass, not an object in the schema")
    return out


def _with_defaults(value, node: dict):
    """`value` with every `default:` of the schema filled in where the key is absent."""
    node = _resolve(node)
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_with_defaults(v, node["items"]) for v in value]
    if not isinstance(value, dict) or "properties" not in node:
        return value
    out = {k: _with_defaults(v, node["properties"][k]) if k in node["properties"] else v for k, v in value.items()}
    for key, sub in node["properties"].items():
        if key not in out and "default" in _resolve(sub):
            out[key] = _resolve(sub)["default"]
    return out


def test_fields_cover_every_schema_key_exactly():
    top = {k: v for k, v in SCHEMA["properties"].items() if k not in ("smoke", "run")}
    assert _mismatches(Config, {"properties": top}, "config") == []


@pytest.mark.parametrize("source", ["reference", "smoke", "paper"])
def test_loads_the_frozen_configs_and_gives_the_dict_back_with_the_schemas_defaults(source):
    if source == "reference":
        cfg = json.loads((REPO / "results" / "config.json").read_text())
    else:
        cfg = effective(CONFIG, resolve_profile(source, False))
    t = Config.from_dict(cfg)
    # The dict back, with the schema's default for a key it leaves out (the values used).
    kv_default = SCHEMA["$defs"]["sections"]["shape"]["properties"]["kv_dtype"]["default"]
    assert "kv_dtype" not in cfg["shape"] and t.shape.kv_dtype == kv_default
    assert t.to_dict() == _with_defaults(cfg, {"properties": SCHEMA["properties"]})
    assert t.to_dict() != cfg   # the committed configs leave some out
    fp8 = Config.from_dict({**cfg, "shape": {**cfg["shape"], "kv_dtype": "fp8"}})
    assert fp8.shape.kv_dtype == "fp8" and fp8.to_dict()["shape"]["kv_dtype"] == "fp8"
    assert t.seeds.calibration == cfg["seeds"]["calibration"] and t.traces["zipf"] == t.traces.zipf
    assert t.engine_sets["main"] == tuple(cfg["engine_sets"]["main"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.measure.max_steps = 1   # type: ignore[misc]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["measure"].update(max_step=4), "config: measure.max_step: unknown key (the typed config Measure has"),
    (lambda c: c["ablations"]["gqa_sweep"].update(engine=["x"]), "config: ablations.gqa_sweep.engine: unknown key"),
    (lambda c: c["policy"]["margins"][0].update(margn=1.0), r"config: policy.margins[0].margn: unknown key"),
    (lambda c: c.update(extra=1), "config: extra: unknown key"),
    (lambda c: c["seeds"].pop("ablation"), "config: seeds.ablation: missing key"),
])
def test_an_unknown_or_missing_key_is_refused_by_its_path(edit, message):
    cfg = effective(CONFIG, "smoke")
    edit(cfg)
    with pytest.raises(ConfigError) as e:
        Config.from_dict(cfg)
    assert str(e.value).startswith(message)


def test_the_stages_read_the_config_through_it():
    # Each migrated module reads no config key by string (the typed view refuses wrong ones).
    import re

    for rel in ("pkv/measure/stages.py", "pkv/measure/calibrate.py"):
        text = (REPO / rel).read_text()
        assert not re.search(r"cfg\[\"", text), rel
    assert typed.Config.of(typed.Config.from_dict(effective(CONFIG, "smoke"))).profile == "smoke"


def test_a_partial_kv_fp8_section_is_named_and_a_smoke_patch_of_it_is_fine():
    """ablations.kv_fp8 is required and whole (no default in code); the smoke section may change a few of
    its keys (deep-merged over the paper's)."""
    import copy

    import yaml

    from pkv.config.resolve import ConfigError, effective, load_schema, validate_config

    raw = yaml.safe_load(open("config.yaml"))
    whole = {"family": "bimodal", "max_active": 8, "max_steps": 32, "policy": "tensor", "engines": ["pkv-graph"]}
    cfg = copy.deepcopy(raw)
    cfg["ablations"]["kv_fp8"] = dict(whole)
    cfg["smoke"]["ablations"]["kv_fp8"] = {"max_steps": 4, "engines": ["reference", "pkv-graph"]}
    validate_config(cfg, load_schema())
    assert Config.from_dict(effective(cfg, "smoke")).ablations.kv_fp8.engines == ("reference", "pkv-graph")
    del cfg["ablations"]["kv_fp8"]["family"]
    with pytest.raises(ConfigError, match=r"^config: ablations\.kv_fp8\.family: missing key$"):
        Config.from_dict(effective(cfg, "paper"))
    # Its step count too: no fallback to measure.max_steps in code.
    cfg["ablations"]["kv_fp8"] = {k: v for k, v in whole.items() if k != "max_steps"}
    with pytest.raises(ConfigError, match=r"^config: ablations\.kv_fp8\.max_steps: missing key$"):
        Config.from_dict(effective(cfg, "paper"))


def test_the_trace_families_come_from_their_table(monkeypatch):
    """traces.<family> in the schema (all required) and in the typed config are the family
    table's rows; a family added there is a key the schema takes, with no schema edit."""
    from pkv.config import resolve
    from pkv.core import families

    assert list(SCHEMA["$defs"]["sections"]["traces"]["properties"]) == list(families.FAMILIES)
    assert SCHEMA["properties"]["traces"]["required"] == list(families.FAMILIES)
    assert [f.name for f in dataclasses.fields(typed.Traces)] == list(families.FAMILIES)
    monkeypatch.setitem(families.FAMILIES, "newfam", families.Family("a test family", "uniform"))
    schema = resolve.load_schema()
    assert "newfam" in schema["$defs"]["sections"]["traces"]["properties"]
    assert "newfam" in schema["properties"]["traces"]["required"] and "newfam" in schema["$defs"]["family"]["enum"]
