"""The report's figures, one function per PNG, from the rows pkv.report.tables loads.

Each figure function returns the PNG's bytes; pkv.report.tables writes them (all or nothing).
Shares its ratios and labels with the tables through pkv.report.ratios (no import of pkv.report.tables).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Callable

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.ticker import MaxNLocator, NullLocator  # noqa: E402

from pkv.config.resolve import SMOKE_BANNER  # noqa: E402
from pkv.core.units import K  # noqa: E402
from pkv.engines import table  # noqa: E402
from pkv.report import ratios as rep  # noqa: E402
from pkv.report.spec import FIGURE_SPECS  # noqa: E402

TIMING_LABELS = {"wall": "wall (synchronized step)", "cuda": "CUDA events", "graph": "CUDA-graph replay"}


# ---------------------------------------------------------------- plain log axes (no "2×10¹" labels)


def plain_number(v: float, _pos=None) -> str:
    """A tick label: 0.5, 2, 40, 1500 (never scientific notation)."""
    return f"{v:.6f}".rstrip("0").rstrip(".") if v < 1e6 else f"{v:,.0f}"


def tokens_label(v: float, _pos=None) -> str:
    """A token-count tick label: 256, 1K, 4K, 1M."""
    if v >= K * K:
        return f"{v / (K * K):.3g}M"
    return f"{v / K:.3g}K" if v >= K else f"{v:.3g}"


def log10_ticks(lo: float, hi: float) -> list[float]:
    """Ticks 1, 2, 5 x 10^k in [lo, hi] (finer where that gives fewer than three)."""
    import math

    ticks: list[float] = []
    for subs in ((1,), (1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 7, 8)):
        k = range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
        ticks = [float(f"{m * 10.0 ** e:.6g}") for e in k for m in subs if lo <= m * 10.0 ** e <= hi]
        if len(ticks) >= 3:
            break
    return ticks if len(ticks) >= 2 else _linear_ticks(lo, hi)


def _linear_ticks(lo: float, hi: float) -> list[float]:
    """A narrow range's ticks (under two of the log ticks fall in it): plain steps."""
    return [float(f"{t:.6g}") for t in MaxNLocator(4).tick_values(lo, hi) if lo <= t <= hi]


def log2_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    """Powers of two in [lo, hi], every 2nd (1K, 4K, 16K, ...) or sparser, at most `most`."""
    import math

    exps = list(range(math.ceil(math.log2(lo)), math.floor(math.log2(hi)) + 1)) or [round(math.log2(lo))]
    stride = 1
    while len([e for e in exps if e % stride == 0]) > most:
        stride *= 2
    ticks = [2.0 ** e for e in exps if e % stride == 0 and lo <= 2.0 ** e <= hi]
    return ticks if len(ticks) >= 2 else _linear_ticks(lo, hi)


def plain_log_axis(axis, lo: float, hi: float, base: int = 10) -> None:
    """Log scale on `axis` (ax.xaxis / ax.yaxis) over [lo, hi], major ticks with plain labels
    (tokens_label on base 2), no minor ticks."""
    from matplotlib.ticker import FixedLocator, FuncFormatter

    ax = axis.axes
    (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log", base=base)
    (ax.set_xlim if axis is ax.xaxis else ax.set_ylim)(lo, hi)
    axis.set_major_locator(FixedLocator(log2_ticks(lo, hi) if base == 2 else log10_ticks(lo, hi)))
    axis.set_major_formatter(FuncFormatter(tokens_label if base == 2 else plain_number))
    axis.set_minor_locator(NullLocator())


def _baseline_name(frame: pd.DataFrame) -> str:
    base = rep.baselines(frame)
    return "FP32 reference (FlashInfer stand-in)" if base == [table.REFERENCE] else "faster FlashInfer variant"


def _layout(fig, ax_title: str, smoke: bool):
    fig.suptitle(ax_title + (f"\n{SMOKE_BANNER}" if smoke else ""), fontsize=11)
    fig.tight_layout()
    return fig


def _finish(fig, ax_title: str, smoke: bool) -> bytes:
    _layout(fig, ax_title, smoke)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def _long_ratios(frame: pd.DataFrame, keys: list[str], engine: str) -> pd.DataFrame:
    r = rep.ratios(frame, keys)
    r = r[r["engine"] == engine]
    long = r.melt(id_vars=keys, value_vars=[f"{t}_ratio" for t in ("wall", "cuda", "graph")], var_name="timing",
                  value_name="ratio").dropna(subset=["ratio"])
    long["timing"] = long["timing"].str.removesuffix("_ratio").map(TIMING_LABELS)
    return long


def serving_ratios(frame: pd.DataFrame, smoke: bool) -> bytes:
    fig = serving_ratios_figure(frame, smoke)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def serving_engines(frame: pd.DataFrame) -> list[str]:
    """The engines the serving-ratio figure plots: every router (pkv.report.ratios.routers,
    the plain `adaptive` first), then the plan-free kernel (pkv-graph) where the run has it."""
    present = set(frame["engine"])
    return [*(rep.routers(frame) or [table.ROUTER]), *[e for e in (table.PKV_KERNEL,) if e in present]]


def _engine_label(engine: str) -> str:
    """A panel's name: `adaptive route`, `adaptive route · objective=overlapped`, `pkv-graph`."""
    return rep.router_label("adaptive route", engine) if table.is_router(engine) else engine


def serving_ratios_figure(frame: pd.DataFrame, smoke: bool):
    """The laid-out (not yet saved) serving-ratio figure; tests check it for overlaps. One
    panel per engine of serving_engines (stacked, shared axes), bars per trace and timing."""
    engines = serving_engines(frame)
    order = [rep.trace_label(f, b) for f, b in rep.trace_order(frame)]
    parts = {e: _long_ratios(frame, ["family", "max_active", "seed"], e) for e in engines}
    timings = [t for t in TIMING_LABELS.values() if any((p["timing"] == t).any() for p in parts.values())]
    # Two-line tick labels ("Homogeneous" over "B8") never overlap; the legend sits above
    # the top panel, clear of the bars; each panel's y label names its engine.
    fig, axes = plt.subplots(len(engines), 1, figsize=(max(8, 1.1 * len(order) + 1), 1.8 + 3.0 * len(engines)),
                             squeeze=False, sharex=True, sharey=True)
    for ax, engine in zip(axes[:, 0], engines):
        long = parts[engine]
        long["trace"] = [rep.trace_label(f, b) for f, b in zip(long["family"], long["max_active"])]
        if long.empty:
            ax.text(0.5, 0.5, f"{engine}: not in this run", ha="center", va="center", transform=ax.transAxes)
        else:
            sns.barplot(long, x="trace", y="ratio", hue="timing", order=order, hue_order=timings, errorbar="sd",
                        capsize=0.15, ax=ax)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="parity (1.0)")
        ax.set_xticks(range(len(order)), [label.replace(" ", "\n") for label in order])
        ax.set_xlabel("trace family, max active requests")
        name = _engine_label(engine).replace(" · ", "\n· ")
        ax.set_ylabel(f"{name}\ndecode-token throughput ratio (×)", fontsize=9)
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    handles, labels = [], []
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    axes[0, 0].legend(handles, labels, title="timing (error bars: std over seeds)", fontsize=8, title_fontsize=8,
                      ncols=4, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    names = ["adaptive route" if len(engines) - (table.PKV_KERNEL in engines) == 1 else "adaptive routes",
             *[e for e in engines if e == table.PKV_KERNEL]]
    title = " and ".join(names)
    return _layout(fig, f"{title[0].upper()}{title[1:]} over the {_baseline_name(frame)}, held-out seeds", smoke)


def latency_vs_context(frame: pd.DataFrame, smoke: bool) -> bytes:
    """Left: median latency per call over context (log axes, plain labels); right: the
    faster FlashInfer variant's latency over each other engine's (> 1: faster), where the
    near-equal latencies of the left panel separate."""
    f = frame.copy()
    f["device_ms"] = f["graph_s"].fillna(f["cuda_s"]).fillna(f["wall_s"]) * 1e3
    med = f.groupby(["engine", "split", "max_len"], sort=True, observed=True)["device_ms"].median().reset_index()
    # PersistentKV at its best split per context (auto split), every other engine as is.
    best = med.loc[med.groupby(["engine", "max_len"], observed=True)["device_ms"].idxmin()].copy()
    base = rep.baselines(frame)
    fastest = best[best["engine"].isin(base)].groupby("max_len", observed=True)["device_ms"].min()
    best["speedup"] = best["max_len"].map(fastest) / best["device_ms"]
    best["engine"] = [e + " (auto split)" if table.persistentkv(e) else e for e in best["engine"]]
    timing = ("CUDA-graph replay" if f["graph_s"].notna().any() else "CUDA events" if f["cuda_s"].notna().any()
              else "wall")
    engines = sorted(best["engine"].unique())
    palette = dict(zip(engines, sns.color_palette(n_colors=len(engines))))
    markers = dict(zip(engines, "os^DvP*Xp"))
    contexts = sorted(best["max_len"].unique())
    fig, (ax, rx) = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    for e in engines:
        g = best[best["engine"] == e].sort_values("max_len")
        ax.plot(g["max_len"], g["device_ms"], marker=markers[e], color=palette[e], label=e)
        if e not in base:
            rx.plot(g["max_len"], g["speedup"], marker=markers[e], color=palette[e], label=e)
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [tokens_label(c) for c in contexts])
    ax.xaxis.set_minor_locator(NullLocator())
    ms = best["device_ms"].dropna()
    plain_log_axis(ax.yaxis, ms.min() / 1.2, ms.max() * 1.2)
    for a in (ax, rx):
        a.set_xlabel("context length (tokens)")
    ax.set_ylabel(f"latency per call, median (ms, {timing})")
    rx.axhline(1.0, color="black", linestyle="--", linewidth=1)
    rx.set_ylim(bottom=0)
    rx.set_ylabel("its latency ÷ the engine's (×, > 1: faster)")
    ax.set_title("latency per call", fontsize=10)
    rx.set_title(f"over the {_baseline_name(frame)}", fontsize=10)
    rx.legend(*ax.get_legend_handles_labels(), title="engine", fontsize=8, title_fontsize=8, loc="upper left",
              bbox_to_anchor=(1.02, 1.0), frameon=False)
    return _finish(fig, "Isolated decode attention, B=1, 50% holes", smoke)


def split_sensitivity(frame: pd.DataFrame, smoke: bool) -> bytes:
    sens = frame[frame["stage"] == "split_sensitivity"]
    b4 = frame[frame["stage"] == "b4_sweep"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, rows, engine, title in ((axes[0], sens, table.ROUTER, "cost-model policy at forced split (ablation seed)"),
                                    (axes[1], b4, table.WORKQUEUE, "B4 workqueue sweep (std over seeds)")):
        long = _long_ratios(rows, ["family", "max_active", "seed", "split"], engine)
        long = long[long["timing"] == TIMING_LABELS["wall"]]
        long["trace"] = [rep.trace_label(f, b) for f, b in zip(long["family"], long["max_active"])]
        sns.lineplot(long, x="split", y="ratio", hue="trace", marker="o", errorbar="sd", ax=ax)
        ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("sequence splits per row (longest row)")
        ax.set_ylabel(f"wall throughput ratio over the\n{_baseline_name(frame)} (×)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        ax.legend(title="trace", fontsize=8, title_fontsize=8)
    return _finish(fig, "Split-count sensitivity", smoke)


def launches_per_step(frame: pd.DataFrame, smoke: bool) -> bytes:
    f = frame.copy()
    f["trace"] = [rep.trace_label(fa, b) for fa, b in zip(f["family"], f["max_active"])]
    order = [rep.trace_label(fa, b) for fa, b in rep.trace_order(f)]
    fig, ax = plt.subplots(figsize=(max(8.0, 1.2 * len(order) + 1), 4.4))
    sns.barplot(f, x="trace", y="launches", hue="engine", order=order, hue_order=sorted(f["engine"].unique()),
                errorbar=None, ax=ax)
    ax.set_xticks(range(len(order)), [label.replace(" ", "\n") for label in order])   # two lines: no overlap
    ax.set_xlabel("trace family, max active requests")
    ax.set_ylabel("kernel launches per decode step (mean)")
    ax.legend(title="engine", fontsize=8, title_fontsize=8, ncols=min(4, f["engine"].nunique()), loc="lower center",
              bbox_to_anchor=(0.5, 1.0), frameon=False)   # above the axes, clear of the bars
    return _finish(fig, "Launch fan-out per decode step (held-out seeds)", smoke)


def coverage(frame: pd.DataFrame, smoke: bool) -> bytes:
    parts = []
    for stage in ("serve", "gqa_sweep"):
        s = frame[frame["stage"] == stage]
        if s.empty:
            continue
        r = rep.ratios(s, ["family", "max_active", "group", "seed"])
        r["regime"] = [rep.trace_label(f, b) + (f", G={g}" if stage == "gqa_sweep" else "")
                       for f, b, g in zip(r["family"], r["max_active"], r["group"])]
        parts.append(r.groupby(["regime", "engine"], observed=True)["wall_ratio"].mean().reset_index())
    grid = pd.concat(parts).pivot(index="regime", columns="engine", values="wall_ratio").sort_index()
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * grid.shape[1], 1.2 + 0.45 * grid.shape[0]))
    sns.heatmap(grid, annot=True, fmt=".2f", center=1.0, cmap="RdBu", cbar_kws={"label": "wall throughput ratio (×)"},
                ax=ax)
    ax.grid(False)
    ax.tick_params(axis="x", labelrotation=30)
    for t in ax.get_xticklabels():
        t.set_horizontalalignment("right")
    ax.set_xlabel("engine")
    ax.set_ylabel("regime (trace, max active, GQA group)")
    return _finish(fig, f"Coverage: wall throughput over the {_baseline_name(frame)}", smoke)


def nsight(frame: pd.DataFrame, smoke: bool) -> bytes:
    fig, (t_ax, bw_ax) = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    if frame.empty:
        for ax in (t_ax, bw_ax):
            ax.set_axis_off()
        t_ax.text(0.0, 0.5, "no Nsight Compute capture in this results folder (nsight: false)", fontsize=11)
        return _finish(fig, "Nsight Compute counters per kernel", smoke)
    order = sorted(frame["kernel"].unique())
    sns.barplot(frame, y="kernel", x="time_us", order=order, errorbar="sd", capsize=0.15, ax=t_ax)
    t_ax.set_xlabel("time per invocation (µs)")
    t_ax.set_ylabel("kernel")
    sns.barplot(frame, y="kernel", x="dram_read_gbps", order=order, errorbar="sd", capsize=0.15, ax=bw_ax)
    roofline = float(frame["roofline_gbps"].iloc[0])
    bw_ax.axvline(roofline, color="black", linestyle="--", linewidth=1, label=f"read roofline β = {roofline:.0f} GB/s")
    bw_ax.set_xlabel("DRAM read bandwidth (GB/s)")
    bw_ax.set_ylabel("")
    bw_ax.legend(loc="lower right", fontsize=8)
    return _finish(fig, "Nsight Compute counters per kernel (error bars: std over invocations)", smoke)


@dataclass(frozen=True)
class Figure:
    stages: tuple[str, ...]
    draw: Callable[[pd.DataFrame, bool], bytes]
    required: bool = True  # False: drawn (saying so) when the stage has no Parquet


_DRAW = {"serving_ratios": serving_ratios, "latency_vs_context": latency_vs_context,
         "split_sensitivity": split_sensitivity, "launches_per_step": launches_per_step, "coverage": coverage,
         "nsight": nsight}
FIGURES = {name: Figure(spec.stages, _DRAW[name], spec.required) for name, spec in FIGURE_SPECS.items()
           if not spec.render}


def draw(name: str, frame: pd.DataFrame, smoke: bool) -> bytes:
    """The PNG bytes of figure `name`, in this module's theme (set for the call only: the
    other figures of the same `pkv report` keep matplotlib's defaults)."""
    with matplotlib.rc_context():
        sns.set_theme(style="whitegrid", context="paper")
        return FIGURES[name].draw(frame, smoke)
