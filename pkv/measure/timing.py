"""One timing module for the measuring side: the L2 policy, device synchronization and
the three timings of a decode step (paper §3.9), used by pkv.measure.loop (every stage) and
pkv.measure.calibrate.

- wall_s: the host clock (`HostClock`, time.perf_counter) around prepare() + run() +
  synchronize (serving-facing);
- cuda_s: CUDA events around the queued run() work (device diagnostic);
- graph_s: device time of one CUDA-graph replay of run(), L2 flushed first (no host
  overhead at all).

The model-level step times whole decoder steps with `StepClock` (serial and pipelined).
Benchmarks (pkv bench kernels / splits) time many calls with `events_us` and
`graph_us_per_call` instead: inputs rotated beyond the L2 rather than flushed. Every
host-clock span, here and in pkv bench host / splits (host path) and pkv.measure.calibrate
(copy bandwidth, launch overhead), is a `HostClock`; the caller places its synchronizations.

L2 policy: before every timed step and every replay, a buffer of L2_FLUSH_BYTES is
zeroed (cold L2 for every engine alike). On the CPU, cuda_s and graph_s are NaN.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from typing import Callable, Sequence

import torch

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.engines import Engine

L2_FLUSH_BYTES = 256 << 20   # > 2x the L2 of any current GPU


def sync(device: str | torch.device) -> None:
    """Wait for queued device work (no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class HostClock:
    """The host clock of one timed span: time.perf_counter() stamped at construction and at
    each mark(), nothing else between the caller's own calls (synchronize where the span
    needs it, e.g. with `sync`, before the mark). Read the phases after the last mark:
    phases() (seconds between consecutive stamps), total() (first stamp to last); stop() is
    mark() + total()."""

    __slots__ = ("stamps",)

    def __init__(self):
        self.stamps = [time.perf_counter()]

    def mark(self) -> None:
        self.stamps.append(time.perf_counter())

    def stop(self) -> float:
        self.mark()
        return self.total()

    def total(self) -> float:
        return self.stamps[-1] - self.stamps[0]

    def phases(self) -> list[float]:
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


class Timer:
    """Wall, CUDA-event and CUDA-graph timing of prepare() + `layers` x (run() + tail).

    One prepare() a step serves every layer; layer i runs run(q, plan, caches[i]): its own
    KV over the engine's page table (Engine.layer). `layers` > 1 needs those caches (no
    layer rereads another's KV); with one layer, the engine reads its own cache."""

    def __init__(self, cuda: bool, graph: bool, layers: int, tail: Callable[[torch.Tensor], torch.Tensor] | None,
                 caches: Sequence[PagedCache] | None = None):
        if caches is None and layers > 1:
            raise ValueError(f"{layers} layers need one KV cache each (caches=...)")
        if caches is not None and len(caches) != layers:
            raise ValueError(f"{layers} layers, {len(caches)} KV caches")
        self.cuda, self.graph, self.layers, self.tail = cuda, graph and cuda, layers, tail
        self.caches: list[PagedCache | None] = list(caches) if caches is not None else [None]
        self.graph_failed: set[str] = set()
        if self.cuda:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def _body(self, engine: Engine, q: torch.Tensor, plan) -> torch.Tensor:
        for cache in self.caches:
            out = engine.run(q, plan, cache)
            if self.tail is not None:
                self.tail(out)
        return out

    def timed(self, engine: Engine, state: StepState, q: torch.Tensor):
        """(plan, wall_s, cuda_s) of one step; the engine's per-step validation is off here
        (it ran in the untimed correctness pass), for every engine alike."""
        engine.validate = False
        if self.cuda:
            self.flush.zero_()
            torch.cuda.synchronize()
        clock = HostClock()
        plan = engine.prepare(state)
        if self.cuda:
            self.start.record()
        self._body(engine, q, plan)
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
        wall = clock.stop()
        engine.validate = True
        return plan, wall, self.start.elapsed_time(self.end) / 1e3 if self.cuda else math.nan

    def graph_time(self, label: str, engine: Engine, q: torch.Tensor, plan, replays: int = 3) -> float:
        """Median device time of `replays` replays of the captured run(); NaN if capture fails."""
        if not self.graph or label in self.graph_failed:
            return math.nan
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self._body(engine, q, plan)   # warm-up off the capture, as torch recommends
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                self._body(engine, q, plan)
        except RuntimeError as e:
            # An engine whose run() cannot be captured still gets wall and event times.
            print(f"graph capture of {label} failed, graph_s = NaN: {e}", file=sys.stderr)
            self.graph_failed.add(label)
            torch.cuda.synchronize()
            return math.nan
        times = []
        for _ in range(replays):
            self.flush.zero_()
            self.start.record()
            graph.replay()
            self.end.record()
            torch.cuda.synchronize()
            times.append(self.start.elapsed_time(self.end) / 1e3)
        return statistics.median(times)

class StepClock:
    """The model-level step's two timings (pkv.measure.model_step) of a runner that has
    prepare(step, bucket) and launch(step, bucket): one synchronized step (wall, host
    prepare, CUDA events around the launch; L2 flushed first), and a run of steps back to
    back with no synchronization between them (pipelined wall)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        if cuda:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
            self.ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def serial(self, runner, step: StepState, bucket: int):
        """(output, wall_s, prepare_s, device_s) of one synchronized step, L2 flushed first."""
        if self.cuda:
            self.flush.zero_()
            torch.cuda.synchronize()
        clock = HostClock()
        runner.prepare(step, bucket)
        clock.mark()
        if self.cuda:
            self.ev[0].record()
        out = runner.launch(step, bucket)
        if self.cuda:
            self.ev[1].record()
            torch.cuda.synchronize()
        wall = clock.stop()
        device = self.ev[0].elapsed_time(self.ev[1]) / 1e3 if self.cuda else math.nan
        return out, wall, clock.phases()[0], device

    def pipelined(self, runner, steps: list[StepState], buckets: list[int]) -> float:
        """Wall time of all steps back to back, no synchronization between them."""
        self.sync()
        clock = HostClock()
        for step, bucket in zip(steps, buckets):
            runner.prepare(step, bucket)
            runner.launch(step, bucket)
        self.sync()
        return clock.stop()


def events_us(fn: Callable[[], object]) -> float:
    """Device µs of the work `fn` queues, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def graph_us_per_call(calls: list, reps: int) -> float:
    """Median device µs per call of one CUDA graph that runs every (engine, plan, q) of
    `calls` once, over `reps` replays. Warm the engines up first; a capture that fails raises."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for engine, plan, q in calls:
            engine.run(q, plan)
    graph.replay()
    torch.cuda.synchronize()
    return statistics.median(events_us(graph.replay) for _ in range(reps)) / len(calls)
