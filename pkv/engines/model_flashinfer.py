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
from pkv.engines.model import GraphRunner, Refused, Runner
from pkv.engines.table import the


def padded_flashinfer_view(assignment: PageAssignment, step: StepState, rows: int, pad_page: int = 0,
                           pad_tokens: int = 1) -> FlashInferView:
    """FlashInfer's view of the step's rows, then `rows - B` padding rows of `pad_tokens` tokens
    (a speculative step's q_len) on `pad_page`."""
    view = flashinfer_view(assignment, step.request_ids, step.seq_lens)
    pad = rows - step.active
    if pad < 0:
        raise ValueError(f"a step of {step.active} rows cannot be padded to {rows}")
    indptr = np.concatenate([view.indptr, view.indptr[-1] + np.arange(1, pad + 1, dtype=np.int32)])
    indices = np.concatenate([view.indices, np.full(pad, pad_page, dtype=np.int32)])
    last = np.concatenate([view.last_page_len, np.full(pad, pad_tokens, dtype=np.int32)])
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


def _plan(wrapper, staging: FlashInferStaging, view: FlashInferView, s: Shape, window_left: int, q_len: int) -> None:
    indptr, indices, last = staging.load(view)
    from pkv.engines.flashinfer import plan

    plan(wrapper, s, indptr, indices, last, window_left=window_left, q_len=q_len)
    staging.release()


def _resolved(wrapper) -> str:
    """The backend FlashInfer's plan() resolved to (fa2, fa3, cudnn), where it says."""
    try:
        return str(getattr(wrapper, "resolved_backend", "") or "")
    except Exception:  # noqa: BLE001 - a label only
        return ""


# A FlashInfer decode wrapper's plan() holds one window_left. A model whose layers differ (a
# sliding window on some, full context on others) gets one wrapper per distinct window (per
# bucket for the graph path), each with its own workspace and staging (two plans must not share
# a schedule buffer), all planned every step: what SGLang does for its sliding and full layers.
# Each layer runs the wrapper of its window; q_len goes to every plan. The planned decode drops
# attention sinks on SM 9.0 (pkv.engines.table.PLANNED_DROPS_SINKS), so neither runner declares
# them: a sink model's step refuses both (Runner.check), and XqaGraphRunner runs it.
PLANNED_FEATURES = ("window", "q_len")


class FlashInferGraphRunner(GraphRunner):
    takes_buckets = True
    features = PLANNED_FEATURES

    def __init__(self, model, caches, xs, buckets, q_len: int = 1):
        import flashinfer

        super().__init__(model, caches, xs, q_len)
        dev, pages = self.cache.device, self.cache.assignment.num_pages + max(buckets)
        self.distinct = sorted(set(self.windows))
        self.wrappers: dict[int, dict[int, object]] = {b: {} for b in buckets}
        for w in self.distinct:
            workspace = new_workspace(dev)   # per window: its per-bucket wrappers never run concurrently
            for b in buckets:
                indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
                last = torch.zeros(b, dtype=torch.int32, device=dev)
                indices = torch.zeros(pages, dtype=torch.int32, device=dev)
                self.wrappers[b][w] = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                    workspace, indptr, indices, last, kv_layout="HND", use_tensor_cores=True)
        self.staging = {w: FlashInferStaging(dev, max(buckets), pages) for w in self.distinct}
        self.pdl = pdl_supported(dev)   # FlashInfer's decode launches with PDL where the GPU has it

    def prepare(self, step, bucket):
        view = padded_flashinfer_view(self.cache.assignment, step, bucket, pad_tokens=self.q_len)
        for w, wrapper in self.wrappers[bucket].items():
            _plan(wrapper, self.staging[w], view, self.cache.shape, w, self.q_len)
        self.route = f"{self.name}/{_resolved(wrapper)}".rstrip("/")

    def attend(self, bucket):
        wrappers, kvs, scales, pdl, windows = (self.wrappers[bucket], [c.kv for c in self.caches], self.scales,
                                               self.pdl, self.windows)
        return lambda i, q: wrappers[windows[i]].run(q, kvs[i], **scales[i], enable_pdl=pdl)


class FlashInferEagerRunner(Runner):
    takes_buckets = True
    features = PLANNED_FEATURES

    def __init__(self, model, caches, xs, buckets, q_len: int = 1):
        import flashinfer

        super().__init__(model, caches, xs, q_len)
        dev = self.cache.device
        self.wrappers = {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(new_workspace(dev), "HND",
                                                                          use_tensor_cores=True)
                         for w in sorted(set(self.windows))}
        self.staging = {w: FlashInferStaging(dev, max(buckets), self.cache.assignment.num_pages)
                        for w in self.wrappers}
        self.pdl = pdl_supported(dev)

    def prepare(self, step, bucket):
        view = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        for w, wrapper in self.wrappers.items():
            _plan(wrapper, self.staging[w], view, self.cache.shape, w, self.q_len)
        self.route = f"{self.name}/{_resolved(wrapper)}".rstrip("/")

    def launch(self, step, bucket):
        kvs, scales, windows = [c.kv for c in self.caches], self.scales, self.windows
        return self.model.forward(self.xs[bucket][:self.tokens(step)],
                                  lambda i, q: self.wrappers[windows[i]].run(q, kvs[i], **scales[i],
                                                                             enable_pdl=self.pdl))


class XqaGraphRunner(GraphRunner):
    """FlashInfer's plan-free XQA decode, the N-layer step captured once per bucket: a step is
    the engine's prepare() at the bucket's rows (one pinned upload of lengths and request ids,
    one gather of block-table rows into fixed addresses, shared by every layer) and one replay.
    No plan() on the host. XQA's window is its compiled module's and the engine's: one engine
    per distinct window (each prepared every step), each layer run with its own sinks."""

    takes_buckets = True
    features = ("window", "sinks", "q_len")

    def __init__(self, model, caches, xs, buckets, q_len: int = 1):
        from pkv.engines.xqa import XqaEngine, check_xqa_shape

        super().__init__(model, caches, xs, q_len)
        try:
            check_xqa_shape(self.cache.shape, self.cache.scales)
        except ValueError as e:
            raise Refused(f"{self.name}: {e}: not run") from None
        first = {w: self.sinks[self.windows.index(w)] for w in sorted(set(self.windows))}
        self.engines = {w: XqaEngine(self.cache, max_rows=max(buckets), validate=False, window_left=w,
                                     q_len=q_len, sinks=t) for w, t in first.items()}
        for engine in self.engines.values():
            engine.name = the(kind="xqa")   # its steps' plans carry the engine row's name
        self.plans: dict[int, dict[int, object]] = {}

    def prepare(self, step, bucket):
        self.plans[bucket] = {w: e.prepare(step, rows=bucket) for w, e in self.engines.items()}

    def attend(self, bucket):
        engines, plans, caches, windows, sinks = self.engines, self.plans[bucket], self.caches, self.windows, self.sinks
        return lambda i, q: engines[windows[i]].run(q, plans[windows[i]], caches[i], sinks=sinks[i])
