"""The kernel sweep's features rows, from their Parquet alone (`pkv bench kernels --suites features`).

One row per case (a gpt-oss-like shape with sinks, sliding and full; a Gemma-3-like sliding
shape; speculative rows of q_len 2-8): its features, pkv-graph's time and fraction of the read
roofline, the fastest FlashInfer path that ran the case and its time, the ratio (that path ÷
pkv-graph, > 1: PersistentKV faster) and which of the two won. A FlashInfer path whose row
holds an error refused the case's features (or failed on it) and is no candidate; a row that
no FlashInfer path ran has no baseline, says so, and is never counted as a win.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from pkv.config.resolve import SMOKE_BANNER
from pkv.core import io
from pkv.engines.table import PKV_KERNEL, flashinfer
from pkv.report.kernels import pools_note
from pkv.report.ratios import num

ENGINE = PKV_KERNEL
NO_BASELINE = "no baseline"   # the winner cell of a row that no FlashInfer path ran


def load(path: str | Path) -> tuple[pd.DataFrame, dict]:
    return io.read_parquet_checked(path, {"case", "engine", "graph_us", "window_left", "q_len", "sinks", "error"},
                                   "features kernel benchmark",
                                   " (run `pkv bench kernels --suites features` on a GPU)")


def time_column(frame: pd.DataFrame) -> str:
    """The rows' time: device time by CUDA-graph replay, or on the CPU smoke profile its wall time."""
    return "cpu_us" if "cpu_us" in frame and frame["cpu_us"].notna().any() else "graph_us"


def _is_flashinfer(label: str) -> bool:
    return label.partition(":")[0] in flashinfer()


def _window(window_left: int) -> str:
    """A window as the tokens a query attends (FlashInfer's window_left + 1, its own included)."""
    return "full" if window_left < 0 else str(int(window_left) + 1)


def winner(pkv_us: float, path: str, path_us: float) -> str:
    """Who won a row: pkv-graph, the FlashInfer path, a tie, or no baseline (no FlashInfer path
    ran) — a row without a baseline is never a win; nor one where pkv-graph did not run."""
    if not path:
        return NO_BASELINE
    if math.isnan(pkv_us):
        return f"{path} ({ENGINE} did not run)"
    return ENGINE if pkv_us < path_us else path if path_us < pkv_us else "tie"


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per case, in the sweep's order: features, pkv-graph, the fastest FlashInfer path
    that ran it (`path`, "" where none did), the ratio, the winner, the paths that refused."""
    col = time_column(frame)
    ran = frame[col].notna() & (frame["error"].fillna("") == "")
    rows = []
    for case, g in frame.groupby("case", sort=False):
        first, ok = g.iloc[0], ran[g.index]
        mine = g[(g.engine == ENGINE) & ok]
        fi = g[g.engine.map(_is_flashinfer)]
        cands = fi[ok[fi.index]]
        best = cands.loc[cands[col].idxmin()] if len(cands) else None
        pkv_us = float(mine[col].iloc[0]) if len(mine) else math.nan
        path, path_us = (best.engine, float(best[col])) if best is not None else ("", math.nan)
        roofline = float(mine["frac_of_roofline"].iloc[0]) if len(mine) and "frac_of_roofline" in g else math.nan
        rows.append({"case": case, "window": _window(first.window_left), "sinks": bool(first.sinks),
                     "q_len": int(first.q_len), "pkv_us": pkv_us, "roofline": roofline,
                     "path": path, "path_us": path_us, "ratio": path_us / pkv_us if path else math.nan,
                     "winner": winner(pkv_us, path, path_us),
                     "refused": sorted(fi.engine[~ok[fi.index]])})
    return pd.DataFrame(rows)


def bar_lines(s: pd.DataFrame) -> list[str]:
    """The features rows' bar, as measured: pkv-graph at >= 1.0 of the fastest FlashInfer path that
    has the feature, over the rows that have such a path."""
    based = s[s.path != ""]
    met = based[based.ratio >= 1.0]
    lines = [f"- pkv-graph at ≥ 1.0 of the fastest FlashInfer path with the row's features: **{len(met)} of "
             f"{len(based)}** rows that have one (bar: all)."]
    if based.ratio.notna().any():
        low = based.loc[based.ratio.idxmin()]
        lines.append(f"- Lowest ratio: {low.ratio:.3f} ({low.case}, against {low.path}).")
    if based.empty:
        lines.append(f"- No FlashInfer path ran any of the {len(s)} rows: none has a baseline, none is a win.")
    elif len(based) < len(s):
        lines.append(f"- No FlashInfer path ran {len(s) - len(based)} of {len(s)} rows (no baseline, not a win): "
                     + ", ".join(s[s.path == ""].case) + ".")
    return lines


def table(frame: pd.DataFrame, meta: dict) -> str:
    s = summary(frame)
    cpu = time_column(frame) == "cpu_us"
    smoke = meta.get("profile") == "smoke" or cpu
    timing = ("CPU wall time per call of the engines' CPU implementations (smoke: no FlashInfer path runs on a "
              "CPU)" if cpu else
              "median device time per call by CUDA-graph replay, KV copies rotated beyond the L2" + pools_note(meta))
    scale = meta.get("length_scale")
    head = ["case", "window", "sinks", "q_len", f"{ENGINE} µs", "% roofline", "fastest FlashInfer path",
            "its µs", "ratio", "won by", "refused"]
    lines = [
        "# Decode kernels with sliding windows, sinks and q_len: pkv-graph against FlashInfer",
        "",
        *([f"> **{SMOKE_BANNER}.**", ""] if smoke else []),
        f"Command: `{meta.get('command', '?')}`  ",
        f"GPU: {meta.get('gpu', '?')} ({meta.get('sm_count', '?')} SMs), driver {meta.get('driver', '?')}, "
        f"CUDA {meta.get('cuda', '?')}, torch {meta.get('torch', '?')}, FlashInfer {meta.get('flashinfer', '?')}, "
        f"commit {meta.get('git_commit', '?')}  ",
        f"Read roofline {num(float(meta.get('roofline_gbps', 'nan')), '.0f')} GB/s. µs = {timing}; % roofline = "
        "useful K+V bytes (a sliding row's window) / time / roofline. Candidates: every FlashInfer path of the "
        "run that ran the row's features (a path whose row holds an error refused them: `refused`); ratio = the "
        "fastest of them ÷ pkv-graph (> 1: PersistentKV faster); window = tokens a query attends "
        "(window_left + 1); the shapes are in the case names (pkv.bench.kernels.features)."
        + (f" Every row's lengths × {scale} (the names keep the paper's)." if scale else ""),
        "",
        "## Bar, as measured",
        "",
        *bar_lines(s),
        "",
        "| " + " | ".join(head) + " |",
        "|---|---|---|---:|" + "---:|" * 2 + "---|---:|---:|---|---|",
    ]
    for r in s.itertuples(index=False):
        cells = [r.case, r.window, "yes" if r.sinks else "no", str(r.q_len), num(r.pkv_us, ".1f"),
                 num(100 * r.roofline, ".1f"), r.path or "none ran", num(r.path_us, ".1f"), num(r.ratio),
                 r.winner, ", ".join(r.refused) or "–"]
        lines.append("| " + " | ".join(cells) + " |")
    others = sorted(set(frame.engine) - {ENGINE} - {e for e in frame.engine if _is_flashinfer(e)})
    if others:
        lines += ["", "Also measured in the same run (Parquet `engine` column): " + ", ".join(others) + "."]
    return "\n".join(lines) + "\n"
