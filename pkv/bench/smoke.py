"""`pkv bench kernels` on the CPU smoke profile: one case per attention the suites hold, its lengths
scaled down, the engines that have a CPU implementation (pkv-graph's task list; no FlashInfer path runs on a
CPU), timed by wall clock. It checks the pipeline end to end and never claims performance:
its rows say `timing = cpu wall` and their time is `cpu_us`, never `graph_us`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from pkv.engines import table

SMOKE = {"scale": 1 / 128, "reps": 1}   # lengths x 1/128 (the smoke traces' scale), one timed call each
GRAPH, CPU_WALL = "cuda-graph replay", "cpu wall"   # a row's `timing`: what its time is


def smoke_cases(cases: list) -> list:
    """The first case of `cases` for each attention (shape, KV dtype, window, sinks, q_len), every
    row's length scaled by SMOKE["scale"] (at least its q_len, so the drafts fit); names, shapes,
    windows, sinks and q_len as they are."""
    def scaled(n: int, q_len: int) -> int:
        return max(q_len, round(n * SMOKE["scale"]))

    first = {}
    for c in cases:
        first.setdefault((c.shape, c.fp8_policy, c.window_left, c.sinks, c.q_len), c)
    return [dataclasses.replace(c, lens=tuple(scaled(n, c.q_len) for n in c.lens)) for c in first.values()]


def cpu_engines(engines: list[str]) -> list[str]:
    """The engine specs of `engines` that run on a CPU cache."""
    return [e for e in engines if table.info(table.parse_spec(e)[0]).cpu]


def cpu_us_per_call(name: str, options: dict, caches, queries, step, reps: int) -> float:
    """Median wall µs of one engine's run() on the CPU (prepare() once, one untimed call first)."""
    from pkv.engines import make_engine

    engine = make_engine(name, caches[0], **options)
    plan = engine.prepare(step)
    engine.run(queries[0], plan)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        engine.run(queries[0], plan)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)
