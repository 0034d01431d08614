"""The model step's runner set (pkv measure model-step): pkv-graph through the public decode
API, the router's runner, and `build_runners`, which makes the runners a config names
from their rows of pkv.engines.table.RUNNERS. pkv-graph's runner lives here, not with the
others, because the public API (pkv.api) sits above pkv.engines in the package's layering.
"""

from __future__ import annotations

import importlib
import importlib.util

from pkv.core.cache import PagedCache
from pkv.engines.model import EngineRunner, GraphRunner, Refused, Runner
from pkv.engines.table import ROUTER, RUNNERS, runners
from pkv.plan.costmodel import GRAPH


class PkvGraphRunner(GraphRunner):
    """pkv-graph through the public API: one DecodeWrapper per bucket (its capacity, and so its
    cut of the work, is the bucket's; its q_len the step's); update() once a step, run(q, layer's
    KV, window_left=, sinks=) per layer, each layer's own window and sinks captured in the graph."""

    takes_buckets = True
    features = ("window", "sinks", "q_len")

    def __init__(self, model, caches, xs, buckets, q_len: int = 1):
        from pkv.api import DecodeWrapper
        from pkv.engines.graph import check_graph_shape

        super().__init__(model, caches, xs, q_len)
        s, c = self.cache.shape, self.cache
        try:
            check_graph_shape(s, c.scales)
        except ValueError as e:     # e.g. an FP8 cache at head_dim 256 (the message names pkv-graph)
            raise Refused(f"{e}: not run") from None
        self.table = c.block_table_host           # [requests, pages]: a step's rows are its request ids
        self.wrappers = {b: DecodeWrapper(b, self.table.shape[1], num_qo_heads=s.num_qo_heads,
                                          num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, page_size=s.page_size,
                                          layout="HND", dtype=s.torch_dtype, kv_fp8=s.fp8, device=c.device,
                                          q_len=q_len)
                         for b in buckets}

    def prepare(self, step, bucket):
        width = -(-int(step.seq_lens.max()) // self.cache.shape.page_size)   # the pages the longest row reads
        self.wrappers[bucket].update(self.table[step.request_ids, :width], step.seq_lens)

    def attend(self, bucket):
        wrapper, kvs, scales, windows, sinks = (self.wrappers[bucket], [c.kv for c in self.caches], self.scales,
                                                self.windows, self.sinks)
        return lambda i, q: wrapper.run(q, kvs[i], **scales[i], window_left=windows[i], sinks=sinks[i])


class AdaptiveRunner(Runner):
    """`adaptive` at model level: the router's decision once a step (host work, timed with
    prepare); a step routed to pkv-graph replays pkv-graph's captured graph of the bucket (the
    same per-bucket graphs as the pkv-graph runner's), any other route runs its engine's plan
    over the layers eagerly (an EngineRunner over the adaptive engine)."""

    @classmethod
    def build(cls, model, caches, xs, buckets, constants=None, point="", q_len=1):
        from pkv.engines import make_engine

        cls.check(model, q_len)    # its host-scheduled routes take no window, sinks or q_len
        if constants is None:
            raise ValueError(f"engine {ROUTER} needs the frozen constants (--constants)")
        return cls(make_engine(ROUTER, caches[0], constants=constants, point=point), model, caches, xs, buckets)

    def __init__(self, engine, model, caches, xs, buckets):
        super().__init__(model, caches, xs)
        self.engine = engine
        self.graph = PkvGraphRunner(model, caches, xs, buckets) if GRAPH in engine.pkv else None
        self.eager = EngineRunner(self.name, engine, model, caches, xs)
        self.current: Runner = self.eager

    @property
    def launch_kind(self) -> str:   # the route of the last prepared step
        return self.current.launch_kind

    def capture(self, bucket, step):
        if self.graph is not None:
            self.graph.capture(bucket, step)
        self.eager.capture(bucket, step)

    def prepare(self, step, bucket):
        route = self.engine.router.decide(step.request_ids, step.seq_lens).route
        if route == GRAPH and self.graph is not None:
            self.graph.prepare(step, bucket)
            self.current, self.route = self.graph, self.graph.name
        else:
            self.eager.prepare(step, bucket)
            self.current, self.route = self.eager, self.eager.route

    def launch(self, step, bucket):
        return self.current.launch(step, bucket)

    def close(self):
        if self.graph is not None:
            self.graph.close()


def build_runners(names: list[str], model, caches: list[PagedCache], xs, buckets, *, constants=None,
                  point: str = "", q_len: int = 1, refused: dict[str, str] | None = None,
                  tag: str = "") -> dict[str, Runner]:
    """The runners `names` (rows of pkv.engines.table.RUNNERS), each made by its row's class for
    steps of `q_len` query tokens a row. A runner that refuses the model step (Refused: a feature
    it lacks) is left out and named in `refused` (as model/name + tag) where given, else raises."""
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise ValueError(f"unknown model-step engine {unknown[0]!r}; choose from {runners()}")
    for package in sorted({RUNNERS[n].package for n in names} - {""}):
        wants = [n for n in names if RUNNERS[n].package == package]
        if importlib.util.find_spec(package) is None:
            raise ValueError(f"engines {wants} need {package} (pip install -e '.[gpu]')")
    out = {}
    for name in names:
        module, _, cls = RUNNERS[name].runner.partition(":")
        try:
            out[name] = getattr(importlib.import_module(module), cls).build(model, caches, xs, buckets, constants,
                                                                            point, q_len=q_len)
        except Refused as e:
            if refused is None:
                raise
            refused.setdefault(f"{model.shape.name}/{name}{tag}", str(e))
    return out
