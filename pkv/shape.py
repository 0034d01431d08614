"""The attention shape every engine, trace and table shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class Shape:
    """Grouped-query decode attention shape with a paged KV cache.

    `group` query heads share one KV head; the KV cache is
    `kv[num_pages, 2, num_kv_heads, page_size, head_dim]` (FlashInfer's HND layout).
    """

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Shape.{name} must be a positive integer, got {value!r}")
        if self.num_qo_heads % self.num_kv_heads:
            raise ValueError(
                f"num_qo_heads ({self.num_qo_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all KV heads."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        return cls(**{k: cfg[k] for k in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype") if k in cfg})
