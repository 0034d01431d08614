"""The model-level runners (pkv measure model-step): a Llama-like decoder around each
decode-attention engine, one runner per practice, all over the same weights and cache.

- `PkvGraphRunner`: the whole N-layer step captured once per bucket in one CUDA graph
  around pkv-graph; a step is one prepare() (shared by every layer) and the replay.
- `FlashInferGraphRunner`: FlashInfer's CUDA-graph decode wrapper, plan() on the host
  every step, then the captured step replayed (what vLLM and SGLang do).
- `FlashInferEagerRunner`: FlashInfer's decode wrapper planned per step, layers eager.
- `EngineRunner`: any engine of the table (pkv.engines.table), layers eager.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import FlashInferView, PageAssignment, flashinfer_view
from pkv.core.shape import Shape

RMS_EPS = 1e-5
GPU_ENGINES = ("pkv-graph", "flashinfer-graph", "flashinfer-eager", "adaptive")
CPU_ENGINES = ("pkv-graph", "reference")


@dataclass(frozen=True)
class ModelShape:
    """A Llama-like decoder: hidden = num_qo_heads * head_dim, gated MLP of width `mlp`."""

    name: str
    layers: int
    hidden: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    mlp: int

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.mlp) < 1:
            raise ValueError(f"model shape {self.name}: every size must be >= 1")
        if self.hidden != self.num_qo_heads * self.head_dim:
            raise ValueError(f"model shape {self.name}: hidden {self.hidden} != num_qo_heads x head_dim")

    def attention(self, page_size: int, dtype: str) -> Shape:
        return Shape(self.num_qo_heads, self.num_kv_heads, self.head_dim, page_size, dtype)

    @property
    def qkv(self) -> int:
        return (self.num_qo_heads + 2 * self.num_kv_heads) * self.head_dim


MODEL_SHAPES = {
    "llama-1b": ModelShape("llama-1b", 16, 2048, 32, 8, 64, 8192),      # Llama-3.2-1B-like
    "llama-8b": ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336),    # Llama-3.1-8B-like
    "smoke": ModelShape("smoke", 2, 64, 4, 2, 16, 128),                 # CPU smoke
}
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


# ---------------------------------------------------------------- the model


@dataclass
class Layer:
    ln1: torch.Tensor
    wqkv: torch.Tensor    # [hidden, (Hq + 2 Hkv) d]: q columns first
    wo: torch.Tensor      # [Hq d, hidden]
    ln2: torch.Tensor
    wgu: torch.Tensor     # [hidden, 2 mlp]: gate columns, then up
    wdown: torch.Tensor   # [mlp, hidden]


class DecoderModel:
    """Random-weight decoder stack; attention is a callable, so every engine runs the same layers."""

    def __init__(self, shape: ModelShape, dtype: torch.dtype, device, seed: int):
        self.shape = shape
        gen = torch.Generator(device=device).manual_seed(seed)

        def w(rows: int, cols: int) -> torch.Tensor:
            x = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32)
            return x.mul_(rows ** -0.5).to(dtype)

        def gain() -> torch.Tensor:
            return (1 + 0.1 * torch.randn(shape.hidden, generator=gen, device=device)).to(dtype)

        s = shape
        self.layers = [Layer(gain(), w(s.hidden, s.qkv), w(s.hidden, s.hidden), gain(), w(s.hidden, 2 * s.mlp),
                             w(s.mlp, s.hidden)) for _ in range(s.layers)]
        self.norm = gain()

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """x [rows, hidden] -> final hidden state; attend(q [rows, Hq, d]) -> [rows, Hq, d]."""
        s, rows = self.shape, x.shape[0]
        nq = s.num_qo_heads * s.head_dim
        for layer in self.layers:
            h = F.rms_norm(x, (s.hidden,), layer.ln1, RMS_EPS)
            qkv = h @ layer.wqkv              # k, v computed as a real model does; not appended (module doc)
            q = qkv[:, :nq].reshape(rows, s.num_qo_heads, s.head_dim).contiguous()
            x = torch.addmm(x, attend(q).reshape(rows, nq), layer.wo)
            h = F.rms_norm(x, (s.hidden,), layer.ln2, RMS_EPS)
            gu = h @ layer.wgu
            x = torch.addmm(x, F.silu(gu[:, :s.mlp]) * gu[:, s.mlp:], layer.wdown)
        return F.rms_norm(x, (s.hidden,), self.norm, RMS_EPS)


def step_input(step: StepState, hidden: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed * 1009 + step.step)
    return torch.randn(step.active, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- engines as model steps


class Runner:
    """One engine's model step over static per-bucket inputs `xs` (shared by every runner).

    prepare() is the host work of a step (timed); launch() queues the device work and
    returns the final hidden state (bucket rows for graph runners, B rows otherwise).
    """

    name = "runner"
    launch_kind = "eager"

    def __init__(self, model: DecoderModel, cache: PagedCache, xs: dict[int, torch.Tensor]):
        self.model, self.cache, self.xs = model, cache, xs
        self.route = self.name

    def capture(self, bucket: int, step: StepState) -> None:
        """Build what the bucket needs (a graph for graph runners) and warm it up."""
        self.prepare(step, bucket)
        self.launch(step, bucket)

    def prepare(self, step: StepState, bucket: int) -> None:
        raise NotImplementedError

    def launch(self, step: StepState, bucket: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class EngineRunner(Runner):
    """A pkv.engines engine (prepare(step) -> plan, run(q, plan)), layers eager on the B rows."""

    def __init__(self, name: str, engine, model, cache, xs):
        self.name, self.engine, self.plan = name, engine, None
        super().__init__(model, cache, xs)

    def prepare(self, step, bucket):
        self.plan = self.engine.prepare(step)
        self.route = self.plan.route

    def launch(self, step, bucket):
        return self.model.forward(self.xs[bucket][:step.active], lambda q: self.engine.run(q, self.plan))


class GraphRunner(Runner):
    """The whole N-layer step captured once per bucket in one CUDA graph (eager on a CPU)."""

    launch_kind = "graph"

    def __init__(self, model, cache, xs):
        super().__init__(model, cache, xs)
        self.cuda = cache.kv.is_cuda
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        if not self.cuda:
            self.launch_kind = "eager"

    def attend(self, bucket: int):
        raise NotImplementedError

    def capture(self, bucket, step):
        self.prepare(step, bucket)
        if not self.cuda:
            return
        x, attend = self.xs[bucket], self.attend(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):        # warm-up off the capture, as torch recommends
            self.model.forward(x, attend)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.outs[bucket] = self.model.forward(x, attend)
        self.graphs[bucket] = graph
        torch.cuda.synchronize()

    def launch(self, step, bucket):
        if self.cuda:
            self.graphs[bucket].replay()
            return self.outs[bucket]
        return self.model.forward(self.xs[bucket], self.attend(bucket))

    def close(self):
        self.graphs.clear()
        self.outs.clear()


class PkvGraphRunner(GraphRunner):
    name = "pkv-graph"

    def __init__(self, model, cache, xs, buckets):
        from pkv.engines import make_engine

        super().__init__(model, cache, xs)
        # One engine per bucket: its capacity (and so its CTA shape) is the bucket's.
        self.engines = {b: make_engine("pkv-graph", cache, max_rows=b) for b in buckets}
        self.plans = {}

    def prepare(self, step, bucket):
        self.plans[bucket] = self.engines[bucket].prepare(step, rows=bucket)

    def attend(self, bucket):
        engine = self.engines[bucket]
        return lambda q: engine.run(q, self.plans[bucket])


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
    name = "flashinfer-graph"

    def __init__(self, model, cache, xs, buckets, workspace):
        import flashinfer

        super().__init__(model, cache, xs)
        dev, pages = cache.device, cache.assignment.num_pages + max(buckets)
        self.wrappers = {}
        for b in buckets:
            indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            last = torch.zeros(b, dtype=torch.int32, device=dev)
            indices = torch.zeros(pages, dtype=torch.int32, device=dev)
            self.wrappers[b] = flashinfer.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                workspace, indptr, indices, last, kv_layout="HND", use_tensor_cores=True)
        self.staging = FlashInferStaging(dev, max(buckets), pages)

    def prepare(self, step, bucket):
        wrapper = self.wrappers[bucket]
        _plan(wrapper, self.staging, padded_flashinfer_view(self.cache.assignment, step, bucket), self.cache.shape)
        self.route = f"{self.name}/{_resolved(wrapper)}".rstrip("/")

    def attend(self, bucket):
        wrapper, kv = self.wrappers[bucket], self.cache.kv
        return lambda q: wrapper.run(q, kv)


class FlashInferEagerRunner(Runner):
    name = "flashinfer-eager"

    def __init__(self, model, cache, xs, buckets, workspace):
        import flashinfer

        super().__init__(model, cache, xs)
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True)
        self.staging = FlashInferStaging(cache.device, max(buckets), cache.assignment.num_pages)

    def prepare(self, step, bucket):
        view = flashinfer_view(self.cache.assignment, step.request_ids, step.seq_lens)
        _plan(self.wrapper, self.staging, view, self.cache.shape)
        self.route = f"{self.name}/{_resolved(self.wrapper)}".rstrip("/")

    def launch(self, step, bucket):
        kv = self.cache.kv
        return self.model.forward(self.xs[bucket][:step.active], lambda q: self.wrapper.run(q, kv))


def build_runners(names: list[str], model, cache, xs, buckets, *, constants=None, point: str = "") -> dict[str, Runner]:
    from pkv.engines import make_engine

    wants = [n for n in names if n.startswith("flashinfer")]
    if wants and importlib.util.find_spec("flashinfer") is None:
        raise ValueError(f"engines {wants} need flashinfer (pip install -e '.[gpu]')")

    runners = {}
    for name in names:
        # FlashInfer's recommended 128 MB float workspace, zeroed, one per runner (the graph
        # runner's per-bucket wrappers share it: they never run concurrently).
        workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=cache.device) if name in wants else None
        if name == "pkv-graph":
            runners[name] = PkvGraphRunner(model, cache, xs, buckets)
        elif name == "flashinfer-graph":
            runners[name] = FlashInferGraphRunner(model, cache, xs, buckets, workspace)
        elif name == "flashinfer-eager":
            runners[name] = FlashInferEagerRunner(model, cache, xs, buckets, workspace)
        elif name == "adaptive":
            if constants is None:
                raise ValueError("engine adaptive needs the frozen constants (--constants)")
            runners[name] = EngineRunner(name, make_engine("adaptive", cache, constants=constants, point=point),
                                         model, cache, xs)
        elif name == "reference":
            runners[name] = EngineRunner(name, make_engine("reference", cache), model, cache, xs)
        else:
            raise ValueError(f"unknown model-step engine {name!r}; choose from {GPU_ENGINES + ('reference',)}")
    return runners


