"""The router report (`pkv report --target tables/router_regret.md`, `figures/router_accuracy.png`):
is the router right, and does it pay for itself?

Two outputs, from the Parquet under RESULTS_DIR/raw and the frozen constants:

- tables/router_regret.md — per serving trace (one Parquet file = one trace, one seed):
  the adaptive engine's wall and device throughput against the best fixed route in
  hindsight (the route among the router's candidates with the highest throughput on that
  trace, chosen separately for wall and for device time), the routes it took, and its
  decision time per step (`route_s`, where recorded). The bar: wall >= WALL_BAR x the
  best fixed route; device ratio >= DEVICE_BAR.
- figures/router_accuracy.png — the cost model's estimate T_r against the measured wall
  time of the step, one panel per route: every fixed-route row of the calibration sweep
  and the held-out serving traces (estimate recomputed from the row's counters and the
  constants), plus the router's own recorded estimate of the route it took.

Estimating a FlashInfer row needs the shape's KV heads and bytes per token, which the
Parquet does not carry: they come from RESULTS_DIR/config.json (the frozen config).

Every adaptive engine of a trace gets its own row (`adaptive`, and e.g.
`adaptive:objective=overlapped` labelled "trace · objective=overlapped", with a router
column only then), and pkv-graph is a candidate route where the constants carry its fit.
pkv-graph rows are estimated from their counters (rows without counters are left out); the figure's
router estimates are the serial objective's (an overlapped estimate is device time only,
not comparable with the wall time plotted).
"""

from __future__ import annotations

import io as _io
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from tabulate import tabulate  # noqa: E402

from pkv.config.resolve import SMOKE_BANNER, load_config, point_key, shape_of  # noqa: E402
from pkv.core.io import atomic_write_bytes, atomic_write_text  # noqa: E402
from pkv.engines.table import PKV_KERNEL, ROUTER, baselines, pkv_engines, pkv_routes
from pkv.plan.costmodel import GRAPH, Constants, RouteCost, estimate  # noqa: E402
from pkv.report.load import load  # noqa: E402
from pkv.report.notes import provenance_line  # noqa: E402
from pkv.report.ratios import modal_route, num, objective, routers, trace_label, trace_order  # noqa: E402

WALL_BAR, DEVICE_BAR = 0.97, 0.95
OVERLAPPED_BAR = 0.97      # the overlapped objective's device ratio (its wall ratio has no bar)
FLASHINFER_BAR = 0.98      # and its device throughput over FlashInfer's faster variant


def offered(k: Constants) -> dict[str, str]:
    """The router's PersistentKV routes these constants can cost: name -> route key
    (pkv-graph only with its fit)."""
    return {n: kind for n, kind in pkv_routes().items() if n in pkv_engines() or (kind == GRAPH and k.graph)}


def candidates(frame: pd.DataFrame, k: Constants) -> list[str]:
    """The fixed engines of the router's candidate routes that this frame measured."""
    present = set(frame["engine"])
    return [e for e in (*k.baseline_ctas_per_head, *offered(k)) if e in present]


def _device(rows: pd.DataFrame) -> pd.Series:
    return rows["graph_s"].where(rows["graph_s"].notna(), rows["cuda_s"])


def regret(frame: pd.DataFrame, k: Constants) -> pd.DataFrame:
    """One row per (family, max_active, seed, adaptive engine): the router vs the best fixed
    route in hindsight."""
    out = []
    for (family, batch, seed), g in frame.groupby(["family", "max_active", "seed"], sort=True):
        fixed = {e: g[g["engine"] == e] for e in candidates(g, k)}
        if not fixed:
            continue
        wall = {e: r["active"].sum() / r["wall_s"].sum() for e, r in fixed.items()}
        dev = {e: r["active"].sum() / _device(r).sum(min_count=1) for e, r in fixed.items()}   # NaN: no device time
        best_wall = max(wall, key=wall.get)
        best_dev = max(dev, key=lambda e: (np.isfinite(dev[e]), dev[e] if np.isfinite(dev[e]) else 0.0))
        fi = max((dev[e] for e in fixed if e in k.baseline_ctas_per_head and np.isfinite(dev[e])), default=math.nan)
        for router in routers(g):
            out.append(_regret_row(g[g["engine"] == router], router, family, batch, seed, wall, best_wall, dev,
                                   best_dev, fi))
    return pd.DataFrame(out)


def _regret_row(ad: pd.DataFrame, router: str, family: str, batch: int, seed: int, wall: dict, best_wall: str,
                dev: dict, best_dev: str, fi_dev: float) -> dict:
    tokens = ad["active"].sum()
    ad_wall = tokens / ad["wall_s"].sum()
    ad_dev = tokens / _device(ad).sum(min_count=1)
    route_us = ad["route_s"] * 1e6 if "route_s" in ad else pd.Series(dtype=float)
    return {
        "family": family, "max_active": int(batch), "seed": int(seed), "router": router, "steps": len(ad),
        "routes": modal_route(ad["route"]),
        "adaptive_wall_tok_s": ad_wall, "best_wall_route": best_wall, "best_wall_tok_s": wall[best_wall],
        "wall_regret": ad_wall / wall[best_wall],
        "adaptive_device_tok_s": ad_dev, "best_device_route": best_dev, "best_device_tok_s": dev[best_dev],
        "device_regret": ad_dev / dev[best_dev], "device_over_flashinfer": ad_dev / fi_dev,
        "route_us_median": float(route_us.median()) if route_us.notna().any() else math.nan,
        "route_us_max": float(route_us.max()) if route_us.notna().any() else math.nan,
    }


def _bars(router: str) -> tuple[float, float, float]:
    """(wall, device, over FlashInfer) bars of a router's rows: the overlapped objective is judged
    on device time only, against the best fixed route and FlashInfer's faster variant."""
    if objective(router) == "overlapped":
        return -math.inf, OVERLAPPED_BAR, FLASHINFER_BAR
    return WALL_BAR, DEVICE_BAR, -math.inf


def _miss(x: float, bar: float) -> str:
    return " ✗" if np.isfinite(x) and x < bar else ""


def regret_markdown(table: pd.DataFrame, smoke: bool, graph: bool = False, source: str = "", margin: str = "") -> str:
    """The table; `graph`: pkv-graph is among the candidates (constants with its fit); `source`:
    the provenance of the files it was computed from (pkv.report.notes.provenance_line);
    `margin`: a sentence on the overlapped objective's margin (margin_sentence)."""
    lines = ["# Router regret: adaptive vs the best fixed route in hindsight", ""]
    if smoke:
        lines += [f"**{SMOKE_BANNER}**", ""]
    pkv = "the pkv bucket, workqueue and graph routes" if graph else "the pkv bucket and workqueue routes"
    lines += [
        "Per serving trace and seed: decode-token throughput (Σ active / Σ time) of `adaptive` over that of the "
        "best fixed candidate route on the same trace, chosen in hindsight separately for wall time and for device "
        "time (CUDA-graph replay; CUDA events where no replay). Candidates: the router's FlashInfer baselines and "
        f"{pkv}. Bar: wall ratio ≥ {WALL_BAR}, device ratio ≥ "
        f"{DEVICE_BAR}. Router µs: host time of the per-step decision (`route_s`; – where not recorded).",
        "",
    ]
    if table.empty:
        return "\n".join(lines + ["No serving trace with an adaptive engine.", ""])
    several = set(table["router"]) != {ROUTER}
    if several:
        lines[-2] += (" One row per adaptive engine: the serial objective's bar is the wall ratio, the overlapped "
                      f"objective's the device ratio (≥ {OVERLAPPED_BAR}) and its device throughput over FlashInfer's "
                      f"faster variant (device × FlashInfer, ≥ {FLASHINFER_BAR}); ✗ marks only the row's own bars."
                      + (f" {margin}" if margin else ""))
    rows = []
    order = {fb: i for i, fb in enumerate(trace_order(table))}
    table = table.assign(_o=[order[(f, b)] for f, b in zip(table["family"], table["max_active"])],
                         _r=[r != ROUTER for r in table["router"]])
    for r in table.sort_values(["_o", "seed", "_r", "router"]).itertuples():
        wall_bar, device_bar, fi_bar = _bars(r.router)
        rows.append([trace_label(r.family, r.max_active), r.seed, *([r.router] if several else []), r.routes,
                     f"{r.best_wall_route}", num(r.wall_regret, ".3f") + _miss(r.wall_regret, wall_bar),
                     f"{r.best_device_route}" if np.isfinite(r.device_regret) else "–",
                     num(r.device_regret, ".3f") + _miss(r.device_regret, device_bar),
                     num(r.device_over_flashinfer, ".3f") + _miss(r.device_over_flashinfer, fi_bar),
                     num(r.route_us_median, ".1f"), num(r.route_us_max, ".1f")])
    lines.append(tabulate(rows, headers=["trace", "seed", *(["router"] if several else []), "routes taken",
                                         "best fixed (wall)", "wall ratio", "best fixed (device)", "device ratio",
                                         "device × FlashInfer", "router µs median", "router µs max"],
                          tablefmt="github"))
    lines.append("")
    for router, t in table.groupby("router", sort=False):
        wall_bar, device_bar, fi_bar = _bars(router)
        dev, fi = t["device_regret"].dropna(), t["device_over_flashinfer"].dropna()
        parts = []
        if np.isfinite(wall_bar):
            parts.append(f"Wall bar met on {int((t['wall_regret'] >= wall_bar).sum())} of {len(t)} traces "
                         f"(min {t['wall_regret'].min():.3f})")
        if not dev.empty:
            label = "device bar" if parts else f"Device bar (≥ {device_bar})"   # alone: name its bar
            parts.append(f"{label} on {int((dev >= device_bar).sum())} of {len(dev)} (min {dev.min():.3f})")
        if np.isfinite(fi_bar) and not fi.empty:
            parts.append(f"FlashInfer bar (≥ {fi_bar}) on {int((fi >= fi_bar).sum())} of {len(fi)} "
                         f"(min {fi.min():.3f})")
        lines += [(f"`{router}`: " if several else "") + "; ".join(parts) + "."]
    lines += [""] + ([f"Source: {source}.", ""] if source else [])
    return "\n".join(lines)


def estimates(frame: pd.DataFrame, k: Constants, kv_bytes_per_token: int, num_kv_heads: int) -> pd.DataFrame:
    """Fixed-route rows with the model's T_r recomputed from their counters (the router's
    closed-form counts equal the schedule's counters) and the constants at their point."""
    routes = offered(k)
    rows = frame[frame["engine"].isin([*k.baseline_ctas_per_head, *routes])]
    rows = rows[~rows["engine"].isin(list(routes)) | rows["decode_ctas"].notna()]   # route rows need counters
    est = []
    for r in rows.itertuples():
        point = point_key(r.family, int(r.max_active))
        kp = k.at(point) if point in k.operating_points else k
        if r.engine in routes:
            task = getattr(r, "task_kv_bytes", 0.0)          # rows without the counter: no such term
            cost = RouteCost(routes[r.engine], float(r.useful_kv_bytes), float(r.decode_ctas), int(r.launches),
                             float(r.merge_bytes), task_bytes=0.0 if pd.isna(task) else float(task))
        else:
            cost = RouteCost(r.engine, float(r.total_tokens * kv_bytes_per_token),
                             r.active * num_kv_heads * k.baseline_ctas_per_head[r.engine], 1, 0.0, int(r.active))
        est.append(estimate(cost, kp))
    out = rows[["stage", "engine", "family", "max_active", "seed", "step", "wall_s", "cuda_s"]].copy()
    out["estimate_s"] = est
    out["route"] = out["engine"]
    out["source"] = np.where(out["stage"] == "calibrate", "calibration seed (fixed route)", "held-out (fixed route)")
    return out


def chosen(frame: pd.DataFrame) -> pd.DataFrame:
    """The router's own estimate of the route it took, per held-out step (serial objective:
    the estimate of the wall time plotted)."""
    serial = [e for e in routers(frame) if objective(e) == "serial"] if not frame.empty else []
    ad = frame[frame["engine"].isin(serial) & frame["estimate_s"].notna()].copy()
    ad["route"] = ad["route"].str.split("/").str[0]
    ad["source"] = "held-out (router's estimate, route taken)"
    return ad[["stage", "route", "family", "max_active", "seed", "step", "wall_s", "cuda_s", "estimate_s", "source"]]


COLORS = {"calibration seed (fixed route)": "tab:gray", "held-out (fixed route)": "tab:blue",
          "held-out (router's estimate, route taken)": "tab:red"}


def accuracy_figure(points: pd.DataFrame, smoke: bool) -> bytes:
    from pkv.report.figures import plain_log_axis

    routes = [r for r in (*baselines(), *sorted(pkv_routes())) if r in set(points["route"])]
    routes += sorted(set(points["route"]) - set(routes))
    ncols = min(2, max(1, len(routes)))
    nrows = max(1, -(-len(routes) // ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 4.0 * nrows + 0.6), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[len(routes):]:
        ax.set_visible(False)
    for ax, route in zip(flat, routes):
        g = points[points["route"] == route]
        g = g[(g["estimate_s"] > 0) & (g["wall_s"] > 0)]   # log axes: a zero estimate has no place on them
        if g.empty:
            ax.set_visible(False)
            continue
        for source, color in COLORS.items():
            s = g[g["source"] == source]
            if not s.empty:
                ax.scatter(s["estimate_s"] * 1e3, s["wall_s"] * 1e3, s=6, alpha=0.5, color=color, label=source)
        lo = min(g["estimate_s"].min(), g["wall_s"].min()) * 1e3 * 0.8
        hi = max(g["estimate_s"].max(), g["wall_s"].max()) * 1e3 * 1.25
        ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, linestyle="--")
        for axis in (ax.xaxis, ax.yaxis):   # 1, 2, 5 x 10^k, plain labels, as few as read clearly
            plain_log_axis(axis, lo, hi)
        err = np.log(g["estimate_s"] / g["wall_s"])
        ax.set_title(f"{route}\nmedian est/meas {np.exp(err.median()):.2f}, "
                     f"rms log err {np.sqrt((err ** 2).mean()):.2f}",
                     fontsize=9)
        ax.set_xlabel("estimate T_r (ms)")
        ax.set_ylabel("measured wall (ms)")
    handles, labels = flat[0].get_legend_handles_labels()
    for ax in flat[1:len(routes)]:
        h, lab = ax.get_legend_handles_labels()
        for hh, ll in zip(h, lab):
            if ll not in labels:
                handles.append(hh)
                labels.append(ll)
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, markerscale=3)
    fig.suptitle("Cost model: estimate vs measured step time per route" + (f"\n{SMOKE_BANNER}" if smoke else ""),
                 fontsize=11)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def regret_md(root: Path, constants: Path | None = None) -> str:
    """tables/router_regret.md of the results folder `root`."""
    root = Path(root)
    k = Constants.load(constants or root / "calibration" / "constants.json")
    serve = load(root, ("serve",))
    return regret_markdown(regret(serve.frame, k), serve.smoke, graph=PKV_KERNEL in candidates(serve.frame, k),
                           source=provenance_line(serve),
                           margin=margin_sentence(json.loads((constants or root / "calibration" / "constants.json")
                                                             .read_text())))


def margin_sentence(constants: dict) -> str:
    """Where the overlapped objective's margin came from: fitted at calibration
    (pkv.measure.overlapped_margin), the config's, or the serial margins; and, where the
    constants carry them, the span of the points' device scales."""
    return _margin_source(constants) + _scale_sentence(constants)


def _margin_source(constants: dict) -> str:
    fit = constants.get("overlapped_margin_fit")
    if fit:
        return (f"Its margin, {fit['margin']:.2f}, was fitted at calibration on seed "
                f"{constants.get('calibration_seed')} "
                f"(the router replayed over that seed's steps: worst point {fit['worst']:.3f} "
                "of its best fixed route).")
    rows = constants.get("overlapped_margins")
    if rows:
        return ("Its margins (the config's): "
                + ", ".join(f"{m['margin']} up to {m['max_active']} rows" for m in rows) + ".")
    return "It promotes by the serial objective's margins."


def _scale_sentence(constants: dict) -> str:
    scales = [v for op in constants.get("operating_points", {}).values()
              for v in (op.get("device_scale") or {}).values()]
    if not scales:
        return ""
    return (f" Each route's device estimate at a serving point is scaled by its measured / estimated time on the "
            f"calibration seed {constants.get('calibration_seed')} ({min(scales):.3f}-{max(scales):.3f}).")


def accuracy_png(root: Path, constants: Path | None = None) -> bytes:
    """figures/router_accuracy.png of the results folder `root`."""
    root = Path(root)
    k = Constants.load(constants or root / "calibration" / "constants.json")
    serve = load(root, ("serve",))
    shape = shape_of(load_config(root / "config.json"))
    calib = load(root, ("calibrate",), required=False)
    frames = [f for f in (calib.frame, serve.frame) if not f.empty]
    points = pd.concat([estimates(pd.concat(frames, ignore_index=True), k, shape.kv_bytes_per_token,
                                  shape.num_kv_heads), chosen(serve.frame)], ignore_index=True)
    return accuracy_figure(points, serve.smoke)


def build(root: Path, out: Path | None = None, constants: Path | None = None,
          only: tuple[str, ...] = ("table", "figure")) -> list[Path]:
    """Write router_regret.md and/or router_accuracy.png under `out` (default: `root`)."""
    out = Path(out) if out else Path(root)
    written = []
    if "table" in only:
        written.append(out / "tables" / "router_regret.md")
        atomic_write_text(written[-1], regret_md(root, constants))
    if "figure" in only:
        written.append(out / "figures" / "router_accuracy.png")
        atomic_write_bytes(written[-1], accuracy_png(root, constants))
    return written
