"""The model-level runners (pkv measure model-step): a Llama-like decoder around each
decode-attention engine, one runner per practice, all over the same weights and the same
per-layer KV caches (`caches[i]` is layer i's own KV tensor; every layer shares one page
table and the step's lengths, as in a real model).

The runners a config names are the rows of pkv.engines.table.RUNNERS, each naming its class
(`Class.build` makes it).

- `PkvGraphRunner` (pkv.measure.model_runners: the public API sits above engines): the
  API's DecodeWrapper per bucket; a step is one `update()` (block table rows and lengths,
  shared by every layer) and the replay of one CUDA graph holding the whole N-layer step,
  each layer's `run(q, caches[i].kv)`.
- `FlashInferGraphRunner`, `FlashInferEagerRunner` (pkv.engines.model_flashinfer):
  FlashInfer's CUDA-graph path (plan() every step, replay) and its eager wrapper.
- `EngineRunner`: any engine of the table (pkv.engines.table), built on layer 0's cache and
  prepared once per step; every layer runs that plan on its own cache
  (`run(q, plan, caches[i])`), layers eager.
- `ReferenceRunner`: the FP32 attention of each layer over its own cache (CPU baseline).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState, step_seed
from pkv.core.shape import Shape
from pkv.engines.table import RUNNERS, runners

RMS_EPS = 1e-5
# The runner sets, from the one table of runners (pkv.engines.table.RUNNERS).
GPU_ENGINES = runners("gpu")      # the paper profile's
CPU_ENGINES = runners("cpu")      # the smoke profile's
FP8_RUNNERS = runners("fp8")      # the FP8 pass runs these and names the others


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
    of_layers: int = 0     # a model of more layers simulated by `layers` of them (memory); 0: none

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

    def layer_weight_bytes(self, itemsize: int) -> int:
        """One layer's weights (DecoderModel's Layer: QKV, output, gate-up, down, two gains)."""
        h = self.hidden
        return itemsize * (h * self.qkv + h * h + h * 2 * self.mlp + self.mlp * h + 2 * h)


MODEL_SHAPES = {
    "llama-1b": ModelShape("llama-1b", 16, 2048, 32, 8, 64, 8192),      # Llama-3.2-1B-like
    "llama-8b": ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336),    # Llama-3.1-8B-like
    # Llama-3.1-70B-like (GQA-8): 24 of its 80 layers, since 80 layers of fp16 weights
    # (1.71 GB each) and per-layer KV do not fit one H200 (docs/graph-decode.md, "Memory").
    "llama-70b": ModelShape("llama-70b", 24, 8192, 64, 8, 128, 28672, of_layers=80),
    "smoke": ModelShape("smoke", 2, 256, 4, 1, 64, 256),                # CPU smoke, GQA-4 (pkv-graph's d 64)
    "smoke-gqa8": ModelShape("smoke-gqa8", 2, 512, 8, 1, 64, 512),      # CPU smoke, GQA-8
}


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
        """x [rows, hidden] -> final hidden state; attend(i, q [rows, Hq, d]) -> [rows, Hq, d] is layer i's."""
        s, rows = self.shape, x.shape[0]
        nq = s.num_qo_heads * s.head_dim
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,), layer.ln1, RMS_EPS)
            qkv = h @ layer.wqkv              # k, v computed as a real model does; not appended (module doc)
            q = qkv[:, :nq].reshape(rows, s.num_qo_heads, s.head_dim).contiguous()
            x = torch.addmm(x, attend(i, q).reshape(rows, nq), layer.wo)
            h = F.rms_norm(x, (s.hidden,), layer.ln2, RMS_EPS)
            gu = h @ layer.wgu
            x = torch.addmm(x, F.silu(gu[:, :s.mlp]) * gu[:, s.mlp:], layer.wdown)
        return F.rms_norm(x, (s.hidden,), self.norm, RMS_EPS)


def step_input(step: StepState, hidden: int, seed: int, dtype: torch.dtype, device) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(step_seed(seed, step.step))
    return torch.randn(step.active, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- engines as model steps


def kv_args(cache: PagedCache) -> dict:
    """The per-call FP8 scale arguments of one layer's cache (tensor scales), or none."""
    if cache.scales is None:
        return {}
    if cache.scales.policy != "tensor":
        raise ValueError("the model step reads FP8 caches with tensor scales (FlashInfer's convention)")
    return {"k_scale": cache.scales.k_scale, "v_scale": cache.scales.v_scale}


class Runner:
    """One engine's model step over static per-bucket inputs `xs` (shared by every runner)
    and the per-layer caches `caches` (one page table and shape, each layer its own KV).

    prepare() is the host work of a step (timed); launch() queues the device work and
    returns the final hidden state (bucket rows for graph runners, B rows otherwise).
    """

    name = "runner"          # a class of a RUNNERS row is named by that row (__init_subclass__)
    launch_kind = "eager"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        path = f"{cls.__module__}:{cls.__qualname__}"
        cls.name = next((n for n, r in RUNNERS.items() if r.runner == path), cls.name)

    def __init__(self, model: DecoderModel, caches: list[PagedCache], xs: dict[int, torch.Tensor]):
        if len(caches) != model.shape.layers:
            raise ValueError(f"{model.shape.name}: {model.shape.layers} layers, {len(caches)} KV caches")
        self.model, self.caches, self.xs = model, caches, xs
        self.cache = caches[0]        # the page table, shape and device every layer shares
        self.scales = [kv_args(c) for c in caches]
        self.route = self.name

    takes_buckets = False   # whether __init__ also takes the buckets (a wrapper or graph per bucket)

    @classmethod
    def build(cls, model: DecoderModel, caches: list[PagedCache], xs: dict[int, torch.Tensor], buckets: list[int],
              constants=None, point: str = "") -> "Runner":
        """The runner of a RUNNERS row (pkv.measure.model_runners.build_runners calls it); this
        default needs the model, caches and inputs, and the buckets where `takes_buckets`."""
        return cls(model, caches, xs, buckets) if cls.takes_buckets else cls(model, caches, xs)

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
    """A pkv.engines engine (prepare(step) -> plan, run(q, plan, layer)) over layer 0's cache,
    layers eager on the B rows: one prepare() a step (the route, the metadata upload), and its
    plan run by every layer on that layer's own KV."""

    def __init__(self, name: str, engine, model, caches, xs):
        self.name, self.engine, self.plan = name, engine, None
        super().__init__(model, caches, xs)

    def prepare(self, step, bucket):
        self.plan = self.engine.prepare(step)
        self.route = self.plan.route

    def launch(self, step, bucket):
        caches = self.caches
        return self.model.forward(self.xs[bucket][:step.active],
                                  lambda i, q: self.engine.run(q, self.plan, caches[i]))


class ReferenceRunner(Runner):
    """Each layer's FP32 attention over its own cache (dequantized when FP8), on the B rows."""

    def prepare(self, step, bucket):
        self.rows = (self.cache.block_table[torch.as_tensor(step.request_ids)],
                     torch.as_tensor(np.asarray(step.seq_lens, dtype=np.int32)))

    def launch(self, step, bucket):
        from pkv.kernels.reference import attention_reference

        values = [c.values() for c in self.caches]
        return self.model.forward(self.xs[bucket][:step.active],
                                  lambda i, q: attention_reference(q, values[i], *self.rows).to(q.dtype))


class GraphRunner(Runner):
    """The whole N-layer step captured once per bucket in one CUDA graph (eager on a CPU)."""

    launch_kind = "graph"

    def __init__(self, model, caches, xs):
        super().__init__(model, caches, xs)
        self.cuda = self.cache.kv.is_cuda
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outs: dict[int, torch.Tensor] = {}
        if not self.cuda:
            self.launch_kind = "eager"

    def attend(self, bucket: int):
        """attend(i, q): layer i's attention in this bucket (what the graph captures)."""
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
