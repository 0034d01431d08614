"""The resolved experiment configuration every measuring command reads.

config.yaml holds the paper configuration and a `smoke:` section of overrides. The
Snakefile resolves `profile: auto` once (paper with CUDA, smoke without), deep-merges the
smoke overrides when needed and freezes the result to `<root>/config.json`; commands read
only that file, so its hash is the config hash in every Parquet file.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from pkv.io import atomic_write_text, dict_hash
from pkv.shape import Shape

PROFILES = ("paper", "smoke")
ROOTS = {"paper": "results", "smoke": "results/smoke"}
SMOKE_BANNER = "CPU smoke — not a performance result"


def resolve_profile(requested: str, cuda_available: bool) -> str:
    if requested == "auto":
        return "paper" if cuda_available else "smoke"
    if requested not in PROFILES:
        raise ValueError(f"profile must be auto, paper or smoke, got {requested!r}")
    return requested


def deep_merge(base: dict, override: dict) -> dict:
    """`override` over `base`: dicts merge key by key, anything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else copy.deepcopy(value)
    return out


def effective(config: dict, profile: str) -> dict:
    """The configuration a profile runs: smoke overrides merged in, `smoke:` itself dropped."""
    base = {k: v for k, v in config.items() if k != "smoke"}
    merged = deep_merge(base, config.get("smoke", {})) if profile == "smoke" else base
    merged["profile"] = profile
    return merged


def write_config(config: dict, path: str | Path) -> None:
    atomic_write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")


def load_config(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def config_hash(config: dict) -> str:
    return dict_hash(config)


def shape_of(config: dict, num_kv_heads: int | None = None) -> Shape:
    """The configured shape; `num_kv_heads` overrides H_kv (GQA sweep: G = H_qo / H_kv)."""
    s = dict(config["shape"])
    if num_kv_heads is not None:
        s["num_kv_heads"] = num_kv_heads
    return Shape.from_config(s)


def device_of(config: dict) -> str:
    """Smoke always runs on the CPU engines; paper runs on the GPU."""
    return "cpu" if config["profile"] == "smoke" else "cuda"


def point_key(family: str, max_active: int) -> str:
    return f"{family}-b{max_active}"
