"""Small readings of a config the measuring code shares: the shape, the device, a point's key."""

from __future__ import annotations


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
