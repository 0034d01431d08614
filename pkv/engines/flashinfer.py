"""FlashInfer's paged decode (CUDA-core, tensor-core) and its persistent BatchAttention,
over the same kv tensor (layout HND) as every other engine."""

from __future__ import annotations

import numpy as np
import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import flashinfer_view
from pkv.core.validate import check_kv
from pkv.engines.base import Engine, Plan
from pkv.engines.common import check_queries, num_sms, pdl_supported
from pkv.engines.table import info

WORKSPACE_BYTES = 128 << 20   # FlashInfer's recommended float workspace (128 MB)


def workspace(device) -> torch.Tensor:
    """A zeroed FlashInfer float workspace: one per engine or model-step runner."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def plan(wrapper, shape, indptr, indices, last_page_len, *, seq_lens=None, qo_indptr=None, window_left: int = -1,
         q_len: int = 1) -> None:
    """FlashInfer's plan() for one decode step, the one call of it in the project (the
    engine's prepare(), the host benchmark's raw plan() and the model step's graph path).

    A decode wrapper takes (indptr, page ids, last_page_len); the persistent BatchAttention
    (`qo_indptr` given) takes the query ranges and the rows' lengths instead of last_page_len.
    window_left and q_len (FlashInfer's q_len_per_req: causal drafts) go to the decode's plan;
    the defaults plan what the decode planned before they existed (no keyword passed)."""
    s = shape
    dt, kvt = s.torch_dtype, s.kv_torch_dtype
    if qo_indptr is not None:
        wrapper.plan(qo_indptr, indptr, indices, seq_lens, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.head_dim,
                     s.page_size, causal=False, q_data_type=dt, kv_data_type=kvt)
    else:
        features = {}
        if window_left >= 0:
            features["window_left"] = window_left
        if q_len > 1:
            features["q_len_per_req"] = q_len
        wrapper.plan(indptr, indices, last_page_len, s.num_qo_heads, s.num_kv_heads, s.head_dim, s.page_size,
                     q_data_type=dt, kv_data_type=kvt, **features)


class FlashInferEngine(Engine):
    """FlashInfer's paged decode over the same kv tensor (layout HND), planned once per step.

    Lean adapter: prepare() is FlashInfer's own plan() on arrays a serving engine already
    holds. Kept across steps, built once per engine (= per trace): the wrapper and its
    workspace, the `qo_indptr` range. The step's FlashInfer view (host indptr and
    last_page_len, page ids on the device) is built once per step and memoized on the
    StepState; the measurement loop builds it in its untimed correctness pass, so the
    timed prepare() is plan() plus a lookup. That is generous to FlashInfer (a serving
    engine pays a gather kernel per step for the page ids; PersistentKV reads the block
    table through request ids and has no such step): `pkv bench host` reports the view's
    cost beside it.

    window_left and q_len go to plan(). It takes no sinks: FlashInfer's planned decode drops
    them on SM 9.0, so its table rows leave the option out and the registry refuses it
    (pkv.engines.table.PLANNED_DROPS_SINKS).
    """

    VIEW_MEMO = 4   # steps whose views stay cached (the correctness pass, then the timed pass)

    def __init__(self, cache: PagedCache, name: str, validate: bool = True, window_left: int = -1, q_len: int = 1):
        super().__init__(cache, validate)
        check_queries(q_len, window_left, None, cache.shape.num_qo_heads, name)
        if info(name).kind == "persistent" and (window_left >= 0 or q_len > 1):
            raise ValueError(f"{name}: this adapter passes no window or q_len to BatchAttention")
        self.window_left, self.q_len = window_left, q_len
        check_kv(cache.kv, cache.shape)
        if cache.scales is not None and cache.scales.policy != "tensor":
            raise ValueError(f"{name}: FlashInfer reads an FP8 cache with tensor scales only, "
                             f"not the {cache.scales.policy!r} policy")
        try:
            import flashinfer
        except ImportError as e:
            raise ValueError(f"engine {name!r} needs flashinfer ({e})") from e
        self.name = name
        self.num_sms = num_sms(cache.device)
        self._workspace = workspace(cache.device)
        self._qo_indptr = torch.arange(cache.assignment.num_requests + 1, dtype=torch.int32)
        self._views: dict[int, tuple] = {}
        self.persistent = info(name).kind == "persistent"   # BatchAttention: its plan takes a qo_indptr
        # The decode wrappers launch with PDL where the GPU has it (named, not left to FlashInfer's
        # default); BatchAttention has no such option.
        self.launch = {} if self.persistent else {"enable_pdl": pdl_supported(cache.device)}
        if self.persistent:
            self.wrapper = flashinfer.BatchAttention(kv_layout="HND", device=str(cache.device))
        else:
            self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "HND", use_tensor_cores=info(name).tensor_cores)

    def view(self, step: StepState) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(host indptr, device page ids, host last_page_len, host seq_lens) of `step`."""
        hit = self._views.get(id(step))
        if hit is not None and hit[0] is step:
            return hit[1]
        v = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        arrays = (torch.from_numpy(v.indptr), torch.from_numpy(v.indices).to(self.cache.device),
                  torch.from_numpy(v.last_page_len), torch.from_numpy(np.asarray(step.seq_lens, dtype=np.int32)))
        if len(self._views) >= self.VIEW_MEMO:
            self._views.pop(next(iter(self._views)))
        self._views[id(step)] = (step, arrays)
        return arrays

    def prepare(self, step: StepState) -> Plan:
        self.check_step(step)
        indptr, indices, last, lens = self.view(step)
        # The persistent kernel's plan reads host indptr/lengths and device page ids.
        qo = self._qo_indptr[:step.active + 1] if self.persistent else None
        plan(self.wrapper, self.cache.shape, indptr, indices, last, seq_lens=lens, qo_indptr=qo,
             window_left=self.window_left, q_len=self.q_len)
        return Plan(step, self.name, 1, None)

    def run(self, q: torch.Tensor, plan: Plan, layer: PagedCache | None = None) -> torch.Tensor:
        self.check_query(q, plan)
        c = self.layer(layer)
        # FP8: one K and one V scale per tensor, FlashInfer's convention.
        scales = {} if c.scales is None else {"k_scale": c.scales.k_scale, "v_scale": c.scales.v_scale}
        out = self.wrapper.run(q, c.kv, **scales, **self.launch)
        return out[0] if isinstance(out, tuple) else out


def build(name, info, cache, policy=None, **options):
    from pkv.engines.registry import check_options, no_policy

    no_policy(name, policy)
    check_options(name, options, info.options)
    return FlashInferEngine(cache, name, **options)
