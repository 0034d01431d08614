"""The one paged KV tensor every engine reads, with its page assignment."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pkv.paging import PageAssignment
from pkv.shape import Shape


@dataclass(frozen=True)
class PagedCache:
    """kv[num_pages, 2, H_kv, page_size, D] plus the block table of every request.

    `block_table` (on the KV device) and `block_table_host` hold the same int32 rows,
    one per trace request, so a step's rows are one index away.
    """

    shape: Shape
    assignment: PageAssignment
    kv: torch.Tensor
    block_table: torch.Tensor
    block_table_host: np.ndarray

    @classmethod
    def random(cls, shape: Shape, assignment: PageAssignment, device: str | torch.device = "cpu", seed: int = 0) -> "PagedCache":
        if assignment.page_size != shape.page_size:
            raise ValueError(f"assignment page size {assignment.page_size} != shape page size {shape.page_size}")
        gen = torch.Generator(device=device).manual_seed(seed)
        dims = (assignment.num_pages, 2, shape.num_kv_heads, shape.page_size, shape.head_dim)
        kv = torch.randn(dims, generator=gen, device=device, dtype=torch.float32).to(shape.torch_dtype)
        table = assignment.block_table()
        return cls(shape, assignment, kv, torch.as_tensor(table, device=device), table)

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def query(self, batch: int, seed: int) -> torch.Tensor:
        """Fresh random queries [batch, H_qo, D] in the cache's dtype and device."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        s = self.shape
        q = torch.randn(batch, s.num_qo_heads, s.head_dim, generator=gen, device=self.device, dtype=torch.float32)
        return q.to(s.torch_dtype)
