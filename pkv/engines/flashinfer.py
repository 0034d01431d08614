"""FlashInfer's paged decode (CUDA-core, tensor-core) and its persistent BatchAttention,
over the same kv tensor (layout HND) as every other engine."""

from __future__ import annotations

import numpy as np
import torch

from pkv.cache import PagedCache
from pkv.engines.base import Engine, Plan
from pkv.engines.common import num_sms
from pkv.harness import StepState
from pkv.paging import flashinfer_view
from pkv.validate import check_kv


class FlashInferEngine(Engine):
    """FlashInfer's paged decode over the same kv tensor (layout HND), planned once per step."""

    def __init__(self, cache: PagedCache, name: str):
        super().__init__(cache)
        check_kv(cache.kv, cache.shape)
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(f"engine {name!r} needs flashinfer ({e})") from e
        self.name = name
        self.num_sms = num_sms(cache.device)
        self._workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=cache.device)
        if name == "flashinfer-persistent":
            self.wrapper = flashinfer.BatchAttention(kv_layout="HND", device=str(cache.device))
        else:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_tensor_cores=name == "flashinfer-tc")

    def prepare(self, step: StepState) -> Plan:
        self.check_step(step)
        s = self.cache.shape
        view = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        indptr, indices, last = (torch.from_numpy(a) for a in (view.indptr, view.indices, view.last_page_len))
        dt = s.torch_dtype
        if self.name == "flashinfer-persistent":
            # Host indptr/lengths (its plan reads them on the host), device page ids.
            qo_indptr = torch.arange(step.active + 1, dtype=torch.int32)
            lens = torch.from_numpy(np.asarray(step.seq_lens, dtype=np.int32))
            self.wrapper.plan(qo_indptr, indptr, indices.to(self.cache.device), lens, s.num_qo_heads,
                              s.num_kv_heads, s.head_dim, s.head_dim, s.page_size, causal=False,
                              q_data_type=dt, kv_data_type=dt)
        else:
            self.wrapper.plan(indptr, indices, last, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size,
                              q_data_type=dt, kv_data_type=dt)
        return Plan(step, self.name, 1, None)

    def run(self, q: torch.Tensor, plan: Plan) -> torch.Tensor:
        self.check_query(q, plan)
        out = self.wrapper.run(q, self.cache.kv)
        return out[0] if isinstance(out, tuple) else out
