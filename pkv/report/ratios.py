"""Throughput ratios, labels and cell formats the tables and figures share (pkv.report.tables and
pkv.report.figures both import this; neither imports the other at module level).

An engine's decode-token throughput is sum(active) / sum(time) over a job's steps, per
timing (wall, CUDA events, CUDA-graph replay); its ratio is over the faster FlashInfer
variant's for the same keys and timing.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from pkv.core.families import FAMILIES
from pkv.engines import table

TIMINGS = {"wall": "wall_s", "cuda": "cuda_s", "graph": "graph_s"}
FAMILY_ORDER = (*FAMILIES, "external")


def baselines(frame: pd.DataFrame) -> list[str]:
    present = [b for b in table.baselines() if b in set(frame["engine"])]
    return present or [table.REFERENCE]


def throughputs(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """tok/s per (keys, engine) for each timing; NaN where a timing was not taken."""
    g = frame.groupby([*keys, "engine"], sort=True, observed=True)
    out = g["active"].sum().to_frame("tokens")
    out["steps"] = g.size()
    for name, col in TIMINGS.items():
        total = g[col].agg(lambda s: s.to_numpy().sum())   # NaN if any step lacks this timing
        out[f"{name}_tps"] = out["tokens"] / total
        out[f"{name}_ms"] = total / out["steps"] * 1e3
    return out.reset_index()


def ratios(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per (keys, engine): throughput ratio over the fastest baseline per timing (every
    FlashInfer decode path measured in the same job: table.baselines()), and in `{timing}_base`
    the baseline that was the fastest."""
    t = throughputs(frame, keys)
    base = baselines(frame)
    b = t[t["engine"].isin(base)]
    g = b.groupby(keys, sort=True, observed=True)
    best = g[[f"{n}_tps" for n in TIMINGS]].max()
    t = t.join(best.add_suffix("_base"), on=keys)
    for name in TIMINGS:
        t[f"{name}_ratio"] = t[f"{name}_tps"] / t[f"{name}_tps_base"]
        won = b.dropna(subset=[f"{name}_tps"])
        winner = won.loc[won.groupby(keys, sort=True, observed=True)[f"{name}_tps"].idxmax()].set_index(keys)["engine"]
        t = t.join(winner.rename(f"{name}_base"), on=keys)
    return t


def names_path(engines) -> bool:
    """Whether a table names the fastest FlashInfer path of each row: where the plan-free XQA
    ran beside the planned variants (a run before it keeps its committed columns)."""
    present = set(engines)
    return any(b in present for b in table.baselines() if b not in table.planned())


def base_path(rows: pd.DataFrame, timings: tuple[str, ...] = ("wall", "cuda")) -> str:
    """Which baseline was the fastest for a table row's ratios (rows of ratios(), one per seed),
    per timing: "flashinfer-tc / flashinfer-xqa" (wall / CUDA), a split over seeds as
    "flashinfer-tc 3/5, flashinfer-xqa 2/5"."""
    cells = []
    for name in timings:
        counts = rows[f"{name}_base"].dropna().value_counts()
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        total = int(counts.sum())
        cells.append("–" if not ranked else ranked[0][0] if len(ranked) == 1
                     else ", ".join(f"{e} {c}/{total}" for e, c in ranked))
    return " / ".join(cells)


def routers(frame: pd.DataFrame) -> list[str]:
    """The router engines' labels in `frame` ("adaptive", "adaptive:objective=overlapped",
    ...; the table's family "adaptive"), the plain spec first."""
    labels = {e for e in frame["engine"].unique() if table.is_router(e)}
    return sorted(labels, key=lambda e: (":" in e, e))


def objective(router: str) -> str:
    """The objective of an adaptive engine's label (serial unless it says otherwise)."""
    return table.parse_spec(router)[1].get("objective", "serial")


def router_label(label: str, router: str) -> str:
    """A row label for `router`: `label` as it is for the plain adaptive engine (the committed
    tables' rows), `label · objective=overlapped` for another spec."""
    return label if router == table.ROUTER else f"{label} · {router.partition(':')[2]}"


def trace_label(family: str, max_active: int) -> str:
    return f"{family.capitalize()} B{max_active}"


def trace_order(frame: pd.DataFrame) -> list[tuple[str, int]]:
    pairs = frame[["family", "max_active"]].drop_duplicates().itertuples(index=False)
    return sorted(((f, int(b)) for f, b in pairs),
                  key=lambda p: (p[1] != 1, FAMILY_ORDER.index(p[0]) if p[0] in FAMILY_ORDER else 99, p[1]))


# ---------------------------------------------------------------- cell formatting


def num(x: float, spec: str = ".3f") -> str:
    return "–" if x is None or not np.isfinite(x) else format(x, spec)


def mean_sd(values: pd.Series, spec: str = ".3f") -> str:
    v = values.dropna()
    if v.empty:
        return "–"
    if len(v) == 1:
        return format(v.iloc[0], spec)
    return f"{format(v.mean(), spec)}±{format(v.std(ddof=1), spec)}"


def modal_route(routes: pd.Series) -> str:
    """The route most steps took (and its share when not all did)."""
    counts = routes.value_counts()
    top = counts[counts == counts.max()].index.min()
    share = counts.max() / counts.sum()
    return top if share == 1 else f"{top} ({share:.0%} of steps)"
