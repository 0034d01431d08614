"""The kernel benchmark's table and figure, from its Parquet alone (`pkv bench kernels`).

Table: one row per case, the PersistentKV (`pkv-graph`) device time, its fraction of
the read roofline, the three FlashInfer variants and the ratio (faster FlashInfer ÷
pkv-graph); summary lines give the B1 fit (fixed µs + bytes / β) for each engine and the
bars of the kernel issue as measured. Figure: the ratio over (batch, context) for the
homogeneous grid.
"""

from __future__ import annotations

import argparse
import io as _io
import math
from pathlib import Path

import numpy as np
import pandas as pd

from pkv.core import io
from pkv.core.units import K
from pkv.engines.table import PKV_KERNEL, flashinfer
from pkv.report.ratios import names_path

ENGINE = PKV_KERNEL


def pools_note(meta: dict) -> str:
    """How the run allocated its KV copies, as its metadata says (`pkv bench kernels`)."""
    if meta.get("kv_pools") == "arena-fp8":
        return " (16-bit and FP8 pools carved from one buffer allocated once, as a serving engine allocates its pool)"
    if meta.get("kv_pools") == "arena":   # older runs: each FP8 copy allocated with its case
        return " (16-bit pools carved from one buffer allocated once, as a serving engine allocates its pool)"
    return ""


def load(path: str | Path) -> tuple[pd.DataFrame, dict]:
    return io.read_parquet_checked(path, {"case", "engine", "graph_us", "bytes", "family", "batch", "max_len"},
                                   "kernel benchmark", " (run `pkv bench kernels` on a GPU)")


def fit_b1(frame: pd.DataFrame, engine: str, lo: int = 4 * K, hi: int = 128 * K) -> tuple[float, float]:
    """Least-squares fixed µs and β (GB/s) of B1 homogeneous rows with lo <= context <= hi."""
    r = frame[(frame.engine == engine) & (frame.family == "homogeneous") & (frame.batch == 1)
              & (frame.max_len >= lo) & (frame.max_len <= hi)].dropna(subset=["graph_us"])
    if len(r) < 2:
        return math.nan, math.nan
    slope, intercept = np.polyfit(r.bytes.to_numpy(float), r.graph_us.to_numpy(float), 1)
    return float(intercept), float(1e-3 / slope)   # bytes/µs -> GB/s


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case: pkv-graph, each FlashInfer variant, the best one, the ratio."""
    wide = frame.pivot_table(index="case", columns="engine", values="graph_us", sort=False)
    first = frame.drop_duplicates("case").set_index("case")
    out = pd.DataFrame({"family": first.family, "bytes": first.bytes})
    out[ENGINE] = wide.get(ENGINE)
    g = frame[frame.engine == ENGINE].set_index("case")
    out["frac_of_roofline"] = g.frac_of_roofline
    fi = [e for e in flashinfer() if e in wide]
    for e in fi:
        out[e] = wide[e]
    out["best_flashinfer"] = wide[fi].min(axis=1)
    out["best_path"] = wide[fi].apply(lambda r: r.idxmin() if r.notna().any() else "—", axis=1)
    out["ratio"] = out.best_flashinfer / out[ENGINE]
    return out


def bars(frame: pd.DataFrame, s: pd.DataFrame) -> list[str]:
    """The kernel issue's bars, each as measured (no pass/fail rounding)."""
    def ratio(case: str) -> str:
        return f"{s.ratio[case]:.3f}" if case in s.index else "n/a"

    fixed, beta = fit_b1(frame, ENGINE)
    h = s[s.family == "homogeneous"]
    first = frame.drop_duplicates("case").set_index("case")
    short = h[(first.batch[h.index] >= 16) & (first.max_len[h.index] <= 2 * K)]
    ragged = s[s.family == "ragged"]
    small = [c for c in ("B1 1K", "B1 2K", "B1 4K", "B1 8K", "B2 1K", "B2 2K", "B4 1K", "B4 2K") if c in s.index]
    big = [c for c in ("B8 64K", "B8 128K") if c in s.index]
    lines = [   # the kernel bars, each as measured
        f"- Fixed cost per call (B1 fit, 4K–128K): **{fixed:.1f} µs** + bytes / {beta:.0f} GB/s (bar ≤ 8 µs).",
        "- B1 1K–8K and B2–B4 ≤ 2K: ratio " + " / ".join(f"{c} {ratio(c)}" for c in small) + " (bar 1.10).",
        "- Large batch at the HBM limit: " + ", ".join(f"{c} at {s.frac_of_roofline[c]:.1%} of roofline" for c in big)
        + " (bar 95 %).",
        f"- Batch ≥ 16, context ≤ 2K: ratio {short.ratio.min():.3f}–{short.ratio.max():.3f}.",
        f"- Ragged mixes: ratio {ragged.ratio.min():.3f}–{ragged.ratio.max():.3f}.",
        f"- Lowest ratio of any row: {s.ratio.min():.3f} ({s.ratio.idxmin()}) (bar 0.98); "
        f"{int((s.ratio < 0.98).sum())} of {int(s.ratio.notna().sum())} rows below 0.98.",
    ]
    for name in (e for e in flashinfer() if e in set(frame.engine)):
        f, b = fit_b1(frame, name)
        lines.append(f"- {name} B1 fit: {f:.1f} µs + bytes / {b:.0f} GB/s.")
    return lines


def table(frame: pd.DataFrame, meta: dict) -> str:
    s = summary(frame)
    fi = [e for e in flashinfer() if e in s]
    named = names_path(fi)
    head = ["case", f"{ENGINE} µs", "% roofline", *[f"{e} µs" for e in fi], *(["fastest FlashInfer"] if named else []),
            "ratio"]
    lines = [
        "# Decode kernels: PersistentKV pkv-graph against FlashInfer (device time)",
        "",
        f"Command: `{meta.get('command', '?')}`  ",
        f"GPU: {meta.get('gpu', '?')} ({meta.get('sm_count', '?')} SMs), driver {meta.get('driver', '?')}, "
        f"CUDA {meta.get('cuda', '?')}, torch {meta.get('torch', '?')}, FlashInfer {meta.get('flashinfer', '?')}, "
        f"commit {meta.get('git_commit', '?')}  ",
        f"Read roofline {float(meta.get('roofline_gbps', 'nan')):.0f} GB/s. µs = median device time per call by "
        f"CUDA-graph replay, KV copies rotated beyond the L2{pools_note(meta)}; % roofline = useful K+V bytes / "
        "time / roofline; "
        "ratio = faster FlashInfer variant ÷ pkv-graph (> 1: PersistentKV faster). Shape unless named: "
        "Hq 32, Hkv 8, d 128, fp16, page 16, 50 % holes.",
        "",
        "## Bars, as measured",
        "",
        *bars(frame, s),
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for case, r in s.iterrows():
        cells = [case, f"{r[ENGINE]:.1f}", f"{100 * r.frac_of_roofline:.1f}",
                 *[("—" if pd.isna(r[e]) else f"{r[e]:.1f}") for e in fi], *([r.best_path] if named else []),
                 f"{r.ratio:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    others = sorted(set(frame.engine) - {ENGINE, *flashinfer()})
    if others:
        lines += ["", "Also measured in the same run (Parquet `engine` column): " + ", ".join(others) + "."]
    return "\n".join(lines) + "\n"


def figure(frame: pd.DataFrame) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    s = summary(frame)
    first = frame.drop_duplicates("case").set_index("case")
    h = s[s.family == "homogeneous"].join(first[["batch", "max_len"]])
    grid = h.pivot_table(index="batch", columns="max_len", values="ratio").sort_index(ascending=False)
    grid.columns = [f"{c // K}K" for c in grid.columns]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    sns.heatmap(grid, annot=True, fmt=".2f", cmap="RdBu", center=1.0, vmin=0.7, vmax=1.3, ax=ax,
                cbar_kws={"label": "faster FlashInfer ÷ pkv-graph"})
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("batch")
    ax.set_title("Device-time ratio over (batch, context)\n> 1: PersistentKV (pkv-graph) is faster", fontsize=10)
    fig.tight_layout()
    buf = _io.BytesIO()
    fig.savefig(buf, format="png", dpi=120, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pkv.report.kernels", description=__doc__,
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("parquet", help="the kernel benchmark's Parquet")
    ap.add_argument("--table", default="results/tables/kernels.md")
    ap.add_argument("--figure", default="results/figures/kernel_ratio.png")
    args = ap.parse_args(argv)
    frame, meta = load(args.parquet)
    text = table(frame, meta)          # both built before either is written
    png = figure(frame)
    io.atomic_write_bytes(args.figure, png)
    io.atomic_write_text(args.table, text)
    print(f"wrote {args.table} and {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
