"""The attention shape every engine, trace and table shares.

Torch-free (the cost model and the report read shapes without loading torch): a dtype is
its name and byte size here; `torch_dtype` imports torch on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of each query / KV dtype, by the name torch gives it.
DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
# What the KV cache stores: `auto` = the query's dtype; `fp8` = e4m3 bytes plus scales (pkv.core.fp8).
KV_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class Shape:
    """Grouped-query decode attention shape with a paged KV cache.

    `group` query heads share one KV head; the KV cache is
    `kv[num_pages, 2, num_kv_heads, page_size, head_dim]` (FlashInfer's HND layout), in
    `dtype` or, with `kv_dtype="fp8"`, in float8_e4m3fn (queries and outputs stay `dtype`).
    """

    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "float16"
    kv_dtype: str = "auto"

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
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.kv_dtype == "fp8" and self.dtype == "float32":
            raise ValueError("an FP8 KV cache takes float16 or bfloat16 queries, not float32")

    @property
    def group(self) -> int:
        return self.num_qo_heads // self.num_kv_heads

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype]

    @property
    def fp8(self) -> bool:
        return self.kv_dtype == "fp8"

    @property
    def kv_torch_dtype(self):
        import torch

        return torch.float8_e4m3fn if self.fp8 else self.torch_dtype

    @property
    def kv_itemsize(self) -> int:
        return 1 if self.fp8 else self.itemsize

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all KV heads (scales not counted)."""
        return self.num_kv_heads * self.kv_bytes_per_head_token

    @property
    def kv_bytes_per_head_token(self) -> int:
        """Bytes of K and V one token occupies in one KV head: what one task reads per token."""
        return 2 * self.head_dim * self.kv_itemsize

    @classmethod
    def from_config(cls, cfg: dict) -> "Shape":
        return cls(**{k: cfg[k] for k in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "dtype", "kv_dtype")
                      if k in cfg})
