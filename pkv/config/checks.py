"""What the JSON schema cannot say about a config: the held-out seeds kept from calibration,
every point a stage uses a calibrated serving point, no engine named twice, the features
suite's engines ones that take its features. Imports nothing heavy."""

from __future__ import annotations

from pkv.config.errors import ConfigError
from pkv.config.seeds import check_seed_roles
from pkv.engines.table import PKV_KERNEL, feature_kernels


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
    named = [("baselines", cfg["baselines"]), *((f"engine_sets.{n}", s) for n, s in cfg["engine_sets"].items())]
    if "feature_kernels" in cfg:
        specs = cfg["feature_kernels"]["engines"]
        named.append(("feature_kernels.engines", specs))
        lacking = [s for s in specs if s.partition(":")[0] not in feature_kernels()]
        if lacking:
            raise ConfigError(f"{source}: feature_kernels.engines names {lacking[0]!r}, which takes no sliding window, "
                              f"sinks or q_len; those that do: {', '.join(feature_kernels())}")
        if PKV_KERNEL not in specs:
            raise ConfigError(f"{source}: feature_kernels.engines must name {PKV_KERNEL} (each row of its table is "
                              "PersistentKV's kernel against the FlashInfer paths beside it)")
    for key, specs in named:
        if len(set(specs)) != len(specs):
            raise ConfigError(f"{source}: {key} names an engine twice")
