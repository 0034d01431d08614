"""`pkv bench BENCH`: the benchmarks outside the serving loop, one module of pkv.bench each."""

from __future__ import annotations

import importlib

# bench name -> the module whose add_command(bench_subparsers) adds it
BENCHES = {
    "kernels": "pkv.bench.kernels",       # pkv-graph against FlashInfer over the serving range, device time
    "splits": "pkv.bench.splits",         # the host-planned schedules at their best split per case
    "host": "pkv.bench.host",             # the host path per engine and batch
    "fp8-accuracy": "pkv.bench.fp8_accuracy",   # error of FP8 caches per scale policy
}


def add_commands(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_command(bench)
