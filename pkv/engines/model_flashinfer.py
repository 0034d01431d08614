"""FlashInfer's practices as model-step runners (pkv.engines.model): its CUDA-graph decode
wrapper with plan() on the host every step and the captured N-layer step replayed (what vLLM
and SGLang do), its eager wrapper planned per step, and its plan-free XQA decode
(pkv.engines.xqa) with the N-layer step captured once per bucket. Every layer reads its own
KV tensor with the step's one plan (XQA: the step's one upload of lengths and block-table rows).
"""

from __future__ import annotations

import numpy as np
import torch

from pkv.core.harness import StepState
from pkv.core.paging import FlashInferView, PageAssignment, flashinfer_view
from pkv.core.shape import Shape
from pkv.engines.common import pdl_supported
from pkv.engines.flashinfer import workspace as new_workspace
from pkv.engines.model import GraphRunner, Runner
from pkv.engines.table import the


def padded_flashinfer_view(assignment: PageAssignment, step: StepState, rows: int, pad_page: int = 0) -> FlashInferView:
    """FlashInfer's view of the step's rows, then `rows - B` padding rows of one token on `pad_page`."""
    view = flashinfer_view(assignment, step.request_ids, step.seq_lens)
    pad = rows - step.active
    if pad < 0:
        raise ValueError(f"a step of {step.active} rows cannot be padded to {rows}")
    indptr = np.concatenate([view.indptr, view.indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)])
    indices = np.concatenate([view.indices, np.full(pad, pad_page, dtype=np.int32)])
    last = np.concatenate([view.last_page_len, np.ones(pad, dtype=np.int32)])
    return FlashInferView(indptr.astype(np.int32), indices.astype(np.int32), last.astype(np.int32))



class FlashInferStaging:
    """Pinned host buffers for indptr / last_page_len / indices and a device copy of the
    indices, two of each, so that plan()'s copies are asynchronous (FlashInfer copies host
    indices synchronously).

    load() for step t + 1 waits until step t's plan() copies have run: plan() also stages
    its schedule through one pinned buffer of its own, which the next plan() overwrites.
    So the host prepares step t + 1 while the GPU runs step t, never further ahead.
    """

    def __init__(self, device, max_rows: int, max_pages: int):
        n = 2 * max_rows + 1 + max_pages
        self.host = [torch.zeros(n, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self.dev = [torch.zeros(max_pages, dtype=torch.int32, device=device) for _ in range(2)]
        self.done = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def load(self, view: FlashInferView) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        k = self.turn
        self.done[k ^ 1].synchronize()   # the previous plan's copies (and so every earlier one) ran
        b, n = len(view.last_page_len), len(view.indices)
        buf = self.host[k]
        a = buf.numpy()
        a[:b + 1] = view.indptr
        a[b + 1:2 * b + 1] = view.last_page_len
        a[2 * b + 1:2 * b + 1 + n] = view.indices
        indices = self.dev[k][:n]
        indices.copy_(buf[2 * b + 1:2 * b + 1 + n], non_blocking=True)
        return buf[:b + 1], indices, buf[b + 1:2 * b + 1]

    def release(self) -> None:
        """After plan(): the buffers of this turn are free once the queued copies ran."""
        self.done[self.turn].record()
        self.turn ^= 1


def _plan(wrapper, staging: FlashInferStaging, view: FlashInferView, s: Shape) -> None:
    indptr, indices, last = staging.load(view)
    from pkv.engines.flashinfer import plan

    plan(wrapper, s, indptr, indices, last)
    staging.release()


def _resolved(wrapper) -> str:
    """The backend FlashInfer's plan() resolved to (fa2, fa3, cudnn), where it says."""
    try:
        return str(getattr(wrapper, "resolved_backend", "") or "")
    except Exception:  # noqa: BLE001 - a label only
        return ""


class FlashInferGraphRunner(GraphRunner):
    takes_buckets = True

    def __init__(self, model, caches, xs, buckets):
        import flashinfer

        super().__init__(model, caches, xs)
        dev, pages = self.cache.device, self.cache.assignment.num_pages + max(buckets)
        workspace = new_workspace(dev)   # one per runner: its per-bucket wrappers never run concurrently
        self.wrappers = {}
        for b in buckets:
            indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            last = torch.zeros(b, dtype=torch.int32, device=dev)
            indices = torch.zeros(pages, dtype=torch.int32, device=dev)
            self.wrappers[b] = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                workspace, indptr, indices, last, kv_layout="HND", use_tensor_cores=True)
        self.staging = FlashInferStaging(dev, max(buckets), pages)
        self.pdl = pdl_supported(dev)   # FlashInfer's decode launches with PDL where the GPU has it

    def prepare(self, step, bucket):
        wrapper = self.wrappers[bucket]
        _plan(wrapper, self.staging, padded_flashinfer_view(self.cache.assignment, step, bucket), self.cache.shape)
        self.route = f"{self.name}/{_resolved(wrapper)}".rstrip("/")

    def attend(self, bucket):
        wrapper, kvs, scales, pdl = self.wrappers[bucket], [c.kv for c in self.caches], self.scales, self.pdl
        return lambda i, q: wrapper.run(q, kvs[i], **scales[i], enable_pdl=pdl)


class FlashInferEagerRunner(Runner):
    takes_buckets = True

    def __init__(self, model, caches, xs, buckets):
        import flashinfer

        super().__init__(model, caches, xs)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(new_workspace(self.cache.device), "HND",
                                                                     use_tensor_cores=True)
        self.staging = FlashInferStaging(self.cache.device, max(buckets), self.cache.assignment.num_pages)
        self.pdl = pdl_supported(self.cache.device)

    def prepare(self, step, bucket):
        view = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        _plan(self.wrapper, self.staging, view, self.cache.shape)
        self.route = f"{self.name}/{_resolved(self.wrapper)}".rstrip("/")

    def launch(self, step, bucket):
        kvs, scales = [c.kv for c in self.caches], self.scales
        return self.model.forward(self.xs[bucket][:step.active],
                                  lambda i, q: self.wrapper.run(q, kvs[i], **scales[i], enable_pdl=self.pdl))


class XqaGraphRunner(GraphRunner):
    """FlashInfer's plan-free XQA decode, the N-layer step captured once per bucket: a step is
    the engine's prepare() at the bucket's rows (one pinned upload of lengths and request ids,
    one gather of block-table rows into fixed addresses, shared by every layer) and one replay.
    No plan() on the host."""

    takes_buckets = True

    def __init__(self, model, caches, xs, buckets):
        from pkv.engines.xqa import XqaEngine

        super().__init__(model, caches, xs)
        self.engine = XqaEngine(self.cache, max_rows=max(buckets), validate=False)
        self.engine.name = the(kind="xqa")   # its steps' plans carry the engine row's name
        self.plans: dict[int, object] = {}

    def prepare(self, step, bucket):
        self.plans[bucket] = self.engine.prepare(step, rows=bucket)

    def attend(self, bucket):
        engine, plan, caches = self.engine, self.plans[bucket], self.caches
        return lambda i, q: engine.run(q, plan, caches[i])
