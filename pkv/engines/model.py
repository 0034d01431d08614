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

A layer's attention gets its window and sinks (ModelShape.window_left, Layer.sinks) and the
step's q_len from every runner that declares them (`Runner.features`); a runner built for a
model step that needs one it lacks raises `Refused` in one line.
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
    # Sliding-window layers: `window` tokens a row attends (Mistral's / Gemma's w; FlashInfer's
    # window_left = w - 1), on every layer but each `global_every`-th (layer i is full-context
    # where (i + 1) % global_every == 0: 2 alternates as gpt-oss does, 6 is Gemma 3's 5 local :
    # 1 global, 0 windows every layer as Mistral does). window 0: no window.
    window: int = 0
    global_every: int = 0
    sinks: bool = False    # attention sinks (gpt-oss): one learned logit per query head, every layer

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.num_qo_heads, self.num_kv_heads, self.head_dim, self.mlp) < 1:
            raise ValueError(f"model shape {self.name}: every size must be >= 1")
        if self.hidden != self.num_qo_heads * self.head_dim:
            raise ValueError(f"model shape {self.name}: hidden {self.hidden} != num_qo_heads x head_dim")
        if self.window < 0 or self.global_every < 0 or (self.global_every and not self.window):
            raise ValueError(f"model shape {self.name}: window >= 1 tokens where global_every is set, both >= 0")

    def window_left(self, layer: int) -> int:
        """Layer `layer`'s FlashInfer window_left: window - 1 on a sliding layer, -1 on a full one."""
        full = not self.window or (self.global_every and (layer + 1) % self.global_every == 0)
        return -1 if full else self.window - 1

    def windows(self) -> list[int]:
        return [self.window_left(i) for i in range(self.layers)]

    def features(self, q_len: int = 1) -> list[str]:
        """What this model step asks of an attention beyond plain GQA decode (the runners' refusals name it)."""
        return [f for f, on in (("window", self.window > 0), ("sinks", self.sinks), ("q_len", q_len > 1)) if on]

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
    # gpt-oss-20b-like: 24 layers of 64 query heads over 8 KV heads at d 64, sinks on every layer,
    # a 128-token window on alternate layers; a dense MLP of 8192 in place of its MoE, hidden
    # 64 x 64 (its own is 2880, projected to 4096 for attention).
    "gpt-oss-20b": ModelShape("gpt-oss-20b", 24, 4096, 64, 8, 64, 8192, window=128, global_every=2, sinks=True),
    # Gemma-3-4B-like: 34 layers, 8 query heads over 4 KV heads at d 256, a 1024-token window on
    # five layers of six (its 5 local : 1 global); hidden 8 x 256 (its own is 2560).
    "gemma3-4b": ModelShape("gemma3-4b", 34, 2048, 8, 4, 256, 10240, window=1024, global_every=6),
    # CPU smoke variants of the two (windows scaled to the smoke traces' 8-512 tokens)
    "smoke-swa-sinks": ModelShape("smoke-swa-sinks", 2, 256, 4, 1, 64, 256, window=8, global_every=2, sinks=True),
    "smoke-swa-d256": ModelShape("smoke-swa-d256", 3, 512, 2, 1, 256, 512, window=16, global_every=3),
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
    sinks: torch.Tensor | None = None   # float32 [Hq]: the layer's attention sinks (ModelShape.sinks)


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
        for layer in self.layers if s.sinks else ():   # drawn last: a shape without sinks keeps its weights
            layer.sinks = torch.randn(s.num_qo_heads, generator=gen, device=device, dtype=torch.float32)

    def forward(self, x: torch.Tensor, attend) -> torch.Tensor:
        """x [rows, hidden] -> final hidden state; attend(i, q [rows, Hq, d]) -> [rows, Hq, d] is layer i's.
        A speculative step's rows are its batch rows' q_len tokens each (row r's at r * q_len ..)."""
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


def step_input(step: StepState, hidden: int, seed: int, dtype: torch.dtype, device, q_len: int = 1) -> torch.Tensor:
    """The step's hidden states: [active * q_len, hidden] (q_len tokens a row)."""
    gen = torch.Generator(device=device).manual_seed(step_seed(seed, step.step))
    return torch.randn(step.active * q_len, hidden, generator=gen, device=device, dtype=torch.float32).to(dtype)


# ---------------------------------------------------------------- engines as model steps


def kv_args(cache: PagedCache) -> dict:
    """The per-call FP8 scale arguments of one layer's cache (tensor scales), or none."""
    if cache.scales is None:
        return {}
    if cache.scales.policy != "tensor":
        raise ValueError("the model step reads FP8 caches with tensor scales (FlashInfer's convention)")
    return {"k_scale": cache.scales.k_scale, "v_scale": cache.scales.v_scale}


class Refused(ValueError):
    """A runner that cannot run a model step (a feature it lacks, a shape it is not built for):
    raised in one line when it is built; the stage records it as not run (model_runners.build_runners)."""


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

    # What it passes to each layer's attention beyond plain decode (ModelShape.features): "window"
    # (the layer's window_left), "sinks" (the layer's sinks), "q_len" (speculative rows). A model
    # step asking for one it lacks is refused when built (Refused), never run without it.
    features: tuple[str, ...] = ()

    def __init__(self, model: DecoderModel, caches: list[PagedCache], xs: dict[int, torch.Tensor], q_len: int = 1):
        if len(caches) != model.shape.layers:
            raise ValueError(f"{model.shape.name}: {model.shape.layers} layers, {len(caches)} KV caches")
        self.check(model, q_len)
        self.model, self.caches, self.xs, self.q_len = model, caches, xs, q_len
        self.cache = caches[0]        # the page table, shape and device every layer shares
        self.scales = [kv_args(c) for c in caches]
        self.windows = model.shape.windows()               # layer i's window_left (-1: full context)
        self.sinks = [layer.sinks for layer in model.layers]
        self.route = self.name

    @classmethod
    def check(cls, model: DecoderModel, q_len: int = 1) -> None:
        """Refused (one line) unless this runner passes every feature the model step needs."""
        missing = [f for f in model.shape.features(q_len) if f not in cls.features]
        if missing:
            raise Refused(f"{cls.name}: passes no {' or '.join(missing)} to its attention "
                          f"({model.shape.name}{f', q_len {q_len}' if q_len > 1 else ''}): not run")

    def tokens(self, step: StepState) -> int:
        """The step's query tokens: its rows x q_len."""
        return step.active * self.q_len

    takes_buckets = False   # whether __init__ also takes the buckets (a wrapper or graph per bucket)

    @classmethod
    def build(cls, model: DecoderModel, caches: list[PagedCache], xs: dict[int, torch.Tensor], buckets: list[int],
              constants=None, point: str = "", q_len: int = 1) -> "Runner":
        """The runner of a RUNNERS row (pkv.measure.model_runners.build_runners calls it); this
        default needs the model, caches and inputs (xs[b]: b x q_len rows), and the buckets where
        `takes_buckets`."""
        if cls.takes_buckets:
            return cls(model, caches, xs, buckets, q_len=q_len)
        return cls(model, caches, xs, q_len=q_len)

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
        return self.model.forward(self.xs[bucket][:self.tokens(step)],
                                  lambda i, q: self.engine.run(q, self.plan, caches[i]))


class ReferenceRunner(Runner):
    """Each layer's FP32 attention over its own cache (dequantized when FP8), on the B rows, with
    the layer's window and sinks and the step's q_len."""

    features = ("window", "sinks", "q_len")

    def prepare(self, step, bucket):
        self.rows = (self.cache.block_table[torch.as_tensor(step.request_ids)],
                     torch.as_tensor(np.asarray(step.seq_lens, dtype=np.int32)))

    def launch(self, step, bucket):
        from pkv.kernels.reference import attention_reference

        values, windows, sinks, q_len = [c.values() for c in self.caches], self.windows, self.sinks, self.q_len
        return self.model.forward(self.xs[bucket][:self.tokens(step)],
                                  lambda i, q: attention_reference(q, values[i], *self.rows, q_len=q_len,
                                                                   window_left=windows[i], sinks=sinks[i]).to(q.dtype))


class GraphRunner(Runner):
    """The whole N-layer step captured once per bucket in one CUDA graph (eager on a CPU)."""

    launch_kind = "graph"

    def __init__(self, model, caches, xs, q_len: int = 1):
        super().__init__(model, caches, xs, q_len)
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
