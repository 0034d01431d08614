"""The one paged KV tensor every engine reads, with its page assignment."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from pkv.core.fp8 import KvScales, dequantize, quantize
from pkv.core.paging import PageAssignment
from pkv.core.shape import Shape


@dataclass(frozen=True)
class PagedCache:
    """kv[num_pages, 2, H_kv, page_size, D] plus the block table of every request.

    `block_table` (on the KV device) and `block_table_host` hold the same int32 rows,
    one per trace request, so a step's rows are one index away. An FP8 cache
    (`shape.kv_dtype == "fp8"`) holds e4m3 bytes and the `scales` that read them back.
    """

    shape: Shape
    assignment: PageAssignment
    kv: torch.Tensor
    block_table: torch.Tensor
    block_table_host: np.ndarray
    scales: KvScales | None = None

    def __post_init__(self) -> None:
        if (self.scales is not None) != self.shape.fp8:
            raise ValueError("an FP8 cache needs its scales, and only an FP8 cache has them")

    @classmethod
    def random(cls, shape: Shape, assignment: PageAssignment, device: str | torch.device = "cpu", seed: int = 0,
               fp8_policy: str = "tensor", out: torch.Tensor | None = None,
               out8: torch.Tensor | None = None) -> "PagedCache":
        """Standard-normal K and V in `shape.dtype`; an FP8 shape quantizes them with `fp8_policy`.

        `out` (a [num_pages, 2, H_kv, P, D] tensor of the 16-bit dtype, e.g. a view of a
        benchmark's KV pool) is filled in place instead of allocating, generated in that dtype
        (no FP32 copy of the pool): the same distribution, other values than without it. An FP8
        shape quantizes into `out8` (e4m3, same dims) where given."""
        if assignment.page_size != shape.page_size:
            raise ValueError(f"assignment page size {assignment.page_size} != shape page size {shape.page_size}")
        dims = (assignment.num_pages, 2, shape.num_kv_heads, shape.page_size, shape.head_dim)
        if out is None:
            gen = torch.Generator(device=device).manual_seed(seed)
            kv = torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(shape.torch_dtype)
        elif tuple(out.shape) != dims or out.dtype != shape.torch_dtype:
            raise ValueError(f"out must be {list(dims)} {shape.torch_dtype}, got {list(out.shape)} {out.dtype}")
        else:
            device = out.device
            kv = out.normal_(generator=torch.Generator(device=device).manual_seed(seed))
        table = assignment.block_table()
        cache = cls(replace(shape, kv_dtype="auto"), assignment, kv, torch.as_tensor(table, device=device), table)
        return cache.quantized(fp8_policy, out=out8) if shape.fp8 else cache

    def quantized(self, policy: str = "tensor", out: torch.Tensor | None = None) -> "PagedCache":
        """This 16-bit cache in FP8 e4m3 (pkv.core.fp8.quantize, into `out` where given), same
        pages and block table."""
        if self.shape.fp8:
            raise ValueError("the cache is FP8 already")
        kv8, scales = quantize(self.kv, policy, out=out)
        return PagedCache(replace(self.shape, kv_dtype="fp8"), self.assignment, kv8, self.block_table,
                          self.block_table_host, scales.to(self.device))

    def values(self) -> torch.Tensor:
        """The cache as numbers torch can compute with: kv itself, or an FP8 cache dequantized to FP32."""
        return dequantize(self.kv, self.scales) if self.shape.fp8 else self.kv

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def query(self, batch: int, seed: int) -> torch.Tensor:
        """Fresh random queries [batch, H_qo, D] in the cache's dtype and device."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = self.shape
        q = torch.randn(batch, s.num_qo_heads, s.head_dim, generator=gen, device=self.device, dtype=torch.float32)
        return q.to(s.torch_dtype)
