"""Device-time decomposition of one B1 step (on the GPU, from the repo root: PYTHONPATH=. python3 scripts/gpu_check_diag.py).

For B1 at 32K and 64K: per-call graph time with 1 call vs several calls per graph,
decode-only (the merge dropped) vs decode + merge, fused, and FlashInfer tensor-core,
to place the fixed per-step overhead. Prints one table.
"""

import statistics

import torch

from pkv.bench.splits import Case, Workload, read_roofline
from pkv.engines import make_engine
from pkv.plan.schedule import SplitPolicy
from pkv.measure.timing import events_us


def graph_us(fns, reps=30):
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    return statistics.median(events_us(g.replay) for _ in range(reps)) / len(fns)


def decode_only(engine, plan, q):
    def f():
        out = torch.empty_like(q)
        for a in plan.args:
            engine.ops.decode(q, engine.cache.kv, engine.cache.block_table, plan.meta, out, plan.partial,
                              plan.counters_buf if a.mode == 2 else engine._empty_i32, **a.kernel)
    return f


def main():
    print(read_roofline())
    for n in (8, 32, 64):
        work = Workload(Case(1, n * 1024, 4), 4)
        for name, splits in (("pkv-masked", 16), ("pkv-masked", 24), ("pkv-fused", 24), ("flashinfer-tc", None)):
            engines = [make_engine(name, c, policy=SplitPolicy(splits)) if splits else make_engine(name, c)
                       for c in work.caches]
            plans = [e.prepare(work.step) for e in engines]
            calls = [lambda e=e, p=p, q=q: e.run(q, p) for e, p, q in zip(engines, plans, work.queries)]
            row = {"one": graph_us(calls[:1]), "four": graph_us(calls)}
            if name == "pkv-masked":
                row["decode_only"] = graph_us([decode_only(e, p, q) for e, p, q in zip(engines, plans, work.queries)])
            print(f"B1 {n}K {name} s={splits}: " + "  ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)


main()
