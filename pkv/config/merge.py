"""The configuration a profile runs: config.yaml's keys, its `smoke:` section merged over
them for the smoke profile, and what the command line sets over both; and where two
configs differ. Imports nothing heavy."""

from __future__ import annotations

import copy

# Keys of config.yaml that say where and what to build, not what is measured: they are
# not part of the frozen config (nor of its hash).
NOT_FROZEN = ("smoke", "run")


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`: dicts merge key by key, anything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if both else copy.deepcopy(value)
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


def differences(a, b, prefix: str = "") -> list[str]:
    """Dotted keys where two configs differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            out += differences(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key) if key in a and key in b \
                else [f"{prefix}.{key}" if prefix else key]
        return out
    return [] if a == b else [prefix or "(whole config)"]
