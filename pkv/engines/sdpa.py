"""The framework baseline: gather each row's pages into contiguous K,V, then torch SDPA."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.validate import check_kv
from pkv.engines.base import Engine, Plan
from pkv.engines.common import PinnedStaging


@dataclass
class RepackPlan(Plan):
    pages: list[torch.Tensor] = field(default_factory=list)
    lens: list[int] = field(default_factory=list)


class SdpaRepackEngine(Engine):
    """Gather each row's pages into contiguous K,V, then torch SDPA (the framework baseline)."""

    def __init__(self, cache: PagedCache, validate: bool = True):
        super().__init__(cache, validate)
        check_kv(cache.kv, cache.shape)
        self._staging = PinnedStaging(cache.device)

    def prepare(self, step: StepState) -> RepackPlan:
        self.check_step(step)
        p = self.cache.shape.page_size
        used = -(-np.asarray(step.seq_lens, dtype=np.int64) // p)
        table = self.cache.block_table_host[step.request_ids]
        parts = [table[i, :u] for i, u in enumerate(used)]
        flat = self._staging.upload(parts).long()
        offs = np.concatenate([[0], np.cumsum(used)])
        pages = [flat[int(offs[i]):int(offs[i + 1])] for i in range(len(used))]
        return RepackPlan(step, self.name, 2 * len(used), None, pages, [int(x) for x in step.seq_lens])

    def run(self, q: torch.Tensor, plan: RepackPlan, layer: PagedCache | None = None) -> torch.Tensor:
        self.check_query(q, plan)
        s, cache = self.cache.shape, self.layer(layer)
        out = torch.empty_like(q)
        for i, (pages, n) in enumerate(zip(plan.pages, plan.lens)):
            kv = cache.kv.index_select(0, pages)  # [n_pages, 2, H, P, D]
            kv = kv.permute(1, 2, 0, 3, 4).reshape(2, s.num_kv_heads, -1, s.head_dim)[:, :, :n]
            o = torch.nn.functional.scaled_dot_product_attention(
                q[i, :, None, :][None], kv[0][None], kv[1][None], scale=1.0 / math.sqrt(s.head_dim), enable_gqa=True)
            out[i] = o[0, :, 0]
        return out


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import check_options, no_policy

    no_policy(name, policy)
    check_options(name, options, info.options)
    return SdpaRepackEngine(cache, **options)
