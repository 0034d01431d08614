"""results/tables/host_path.md from the host benchmark's Parquet (pkv bench host, rule
bench_host): medians per engine and batch beside FlashInfer's raw plan(), and the bar."""

from __future__ import annotations

import math

import pandas as pd

from pkv.bench.bars import BAR_FACTOR, BAR_US
from pkv.config.resolve import SMOKE_BANNER


def _us(x) -> str:
    return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def _route(r) -> str:
    exact = getattr(r, "route_exact_us", math.nan)
    return _us(r.route_us) + (f" ({_us(exact)})" if isinstance(exact, float) and not math.isnan(exact) else "")


def markdown(frame: pd.DataFrame, meta: dict) -> str:
    """results/tables/host_path.md from the Parquet's rows and metadata."""
    smoke = [f"> **{SMOKE_BANNER}.**", ""] if meta.get("profile") == "smoke" else []
    lines = [
        "# Host path per decode step",
        "",
        *smoke,
        f"Command: `{meta.get('command', '')}`  ",
        f"GPU: {meta.get('gpu', 'none')}, torch {meta.get('torch', '')}, FlashInfer {meta.get('flashinfer', '')}, "
        f"commit {meta.get('git_commit', '')}, constants {meta.get('constants_hash', 'none')}  ",
        "Medians over consecutive decode steps of one active set (each row one token longer a step), timed as "
        "pkv.measure times them: validation off, FlashInfer's per-step view built in the untimed pass. "
        "prepare = the engine's per-step host work; launch = run() until it returns; wall = prepare + run + "
        "synchronize; route = the router's decision (in brackets: the same decisions uncached, i.e. a cache miss). "
        "Raw plan() = FlashInfer's wrapper.plan() called directly on "
        "the same prebuilt arrays; view = building those arrays for one step (off the timed path). "
        f"Bar: prepare <= {BAR_FACTOR:.2f} x raw plan() + {BAR_US:.0f} us.",
        "",
        "| batch | engine | route | prepare µs | launch µs | wall µs | route µs (uncached) | raw plan() µs | view µs | "
        "prepare / raw | meets bar |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in frame.itertuples():
        if isinstance(r.error, str) and r.error:
            lines.append(f"| {r.batch} | {r.engine} | not run: {r.error[:70]} | | | | | | | | |")
            continue
        ratio = r.prepare_us / r.raw_plan_us if r.raw_plan_us > 0 else math.nan   # NaN where no raw plan
        bar = "" if pd.isna(r.meets_bar) else ("yes" if r.meets_bar else "**no**")
        lines.append(f"| {r.batch} | {r.engine} | {r.route} | {_us(r.prepare_us)} | {_us(r.launch_us)} | "
                     f"{_us(r.wall_us)} | {_route(r)} | {_us(r.raw_plan_us)} | {_us(r.view_us)} | "
                     f"{'' if math.isnan(ratio) else f'{ratio:.2f}'} | {bar} |")
    return "\n".join(lines) + "\n"
