"""`pkv report RESULTS_DIR`: every table and figure from the Parquet under RESULTS_DIR/raw.

Reads Parquet only (never a GPU, never the config). Tables are Markdown, plus LaTeX for
the paper's tables, and are deterministic: the same Parquet gives the same bytes.
Ratios are per job (one Parquet file = one trace, one seed): an engine's decode-token
throughput, sum(active) / sum(time), over the faster FlashInfer variant's for the same
timing (wall, CUDA events, CUDA-graph replay); mean and sample std are over seeds.
A results folder whose files name more than one GPU model is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from tabulate import tabulate

from pkv.io import atomic_write_text, read_meta
from pkv.measure_config import SMOKE_BANNER
from pkv.nsight import table5
from pkv import report_figures

FLASHINFER = ("flashinfer", "flashinfer-tc")
TIMINGS = {"wall": "wall_s", "cuda": "cuda_s", "graph": "graph_s"}
FAMILY_ORDER = ("bucketed", "homogeneous", "bimodal", "uniform", "zipf", "external")


@dataclass
class Raw:
    """The rows and per-file metadata of the stages a target reads."""

    frame: pd.DataFrame
    metas: list[dict]
    smoke: bool


class MissingStage(ValueError):
    """A target's stage has not been measured in this results folder."""


def load(root: Path, stages: tuple[str, ...], required: bool = True) -> Raw:
    files = sorted(f for s in stages for f in (root / "raw" / s).glob("*.parquet"))
    if not files and required:
        raise MissingStage(f"no Parquet under {', '.join(str(root / 'raw' / s) for s in stages)}; run the stage first")
    metas = [read_meta(f) for f in files]
    gpus = sorted({m.get("gpu", "unknown") for m in metas})
    if len(gpus) > 1:
        raise ValueError(f"{root} mixes results from several GPU models ({', '.join(gpus)}); "
                         "report each GPU's results folder separately")
    frames = [pq.read_table(f).to_pandas() for f in files]
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    # A stage without files (Nsight off) takes the profile from the folder's other files.
    profiles = metas or [read_meta(f) for f in sorted(root.glob("raw/*/*.parquet"))[:1]]
    return Raw(frame, metas, any(m.get("profile") == "smoke" for m in profiles))


# ---------------------------------------------------------------- ratios


def baselines(frame: pd.DataFrame) -> list[str]:
    present = [b for b in FLASHINFER if b in set(frame["engine"])]
    return present or ["reference"]


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
    """Per (keys, engine): throughput ratio over the faster baseline per timing."""
    t = throughputs(frame, keys)
    base = baselines(frame)
    best = t[t["engine"].isin(base)].groupby(keys, sort=True, observed=True)[[f"{n}_tps" for n in TIMINGS]].max()
    t = t.join(best.add_suffix("_base"), on=keys)
    for name in TIMINGS:
        t[f"{name}_ratio"] = t[f"{name}_tps"] / t[f"{name}_tps_base"]
    return t


# ---------------------------------------------------------------- formatting


def num(x: float, spec: str = ".3f") -> str:
    return "–" if x is None or not np.isfinite(x) else format(x, spec)


def mean_sd(values: pd.Series, spec: str = ".3f") -> str:
    v = values.dropna()
    if v.empty:
        return "–"
    if len(v) == 1:
        return format(v.iloc[0], spec)
    return f"{format(v.mean(), spec)}±{format(v.std(ddof=1), spec)}"


def trace_label(family: str, max_active: int) -> str:
    return f"{family.capitalize()} B{max_active}"


def trace_order(frame: pd.DataFrame) -> list[tuple[str, int]]:
    pairs = frame[["family", "max_active"]].drop_duplicates().itertuples(index=False)
    return sorted(((f, int(b)) for f, b in pairs), key=lambda p: (p[1] != 1, FAMILY_ORDER.index(p[0]) if p[0] in FAMILY_ORDER else 99, p[1]))


def modal_route(routes: pd.Series) -> str:
    counts = routes.value_counts()
    top = counts[counts == counts.max()].index.min()
    share = counts.max() / counts.sum()
    return top if share == 1 else f"{top} ({share:.0%} of steps)"


# ---------------------------------------------------------------- tables


@dataclass(frozen=True)
class Table:
    title: str
    caption: str
    stages: tuple[str, ...]
    build: Callable[[Raw], pd.DataFrame]
    latex: bool = False
    required: bool = True


def t_serving(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["family", "max_active", "seed"])
    rows = []
    for family, batch in trace_order(f):
        sel = (r["family"] == family) & (r["max_active"] == batch) & (r["engine"] == "adaptive")
        steps = f[(f["family"] == family) & (f["max_active"] == batch) & (f["engine"] == "adaptive")]
        rows.append({
            "Trace / mode": trace_label(family, batch), "Selected route": modal_route(steps["route"]),
            "CUDA tok/s ratio": mean_sd(r.loc[sel, "cuda_ratio"]), "Graph ratio": mean_sd(r.loc[sel, "graph_ratio"]),
            "Wall tok/s ratio": mean_sd(r.loc[sel, "wall_ratio"]),
            "Wall ratio min": num(r.loc[sel, "wall_ratio"].min()),
            "Max |e|": num(steps["max_abs_err"].max(), ".3e"), "Mean |e|": num(steps["mean_abs_err"].mean(), ".3e"),
            "Seeds": str(r.loc[sel, "seed"].nunique()),
        })
    return pd.DataFrame(rows)


def t_counters(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    rows = []
    for family, batch in trace_order(f):
        sub = f[(f["family"] == family) & (f["max_active"] == batch)]
        for engine, g in sub.groupby("engine", sort=True, observed=True):
            rows.append({
                "Trace": trace_label(family, batch), "Engine": engine, "Launches/step": num(g["launches"].mean(), ".2f"),
                "Decode CTA work/SM": num(g["cta_work_per_sm"].mean(), ".1f"),
                "Useful KV MB": num(g["total_tokens"].mean() * _kv_bytes_per_token(g) / 1e6, ".1f"),
                "Merge MB": num(g["merge_bytes"].mean() / 1e6, ".2f"),
                "Merge launches": num(g["merge_launches"].mean(), ".2f"),
            })
    return pd.DataFrame(rows)


def _kv_bytes_per_token(g: pd.DataFrame) -> float:
    """Useful KV bytes per token, from rows whose engine reports counters (else NaN)."""
    known = g.dropna(subset=["useful_kv_bytes"])
    return float((known["useful_kv_bytes"] / known["total_tokens"]).median()) if len(known) else np.nan


def t_isolated(raw: Raw) -> pd.DataFrame:
    f = raw.frame.copy()
    f["context"] = f["max_len"]
    f["device_s"] = f["graph_s"].fillna(f["cuda_s"]).fillna(f["wall_s"])
    med = f.groupby(["engine", "split", "context"], sort=True, observed=True)["device_s"].median().reset_index()
    rows = []
    contexts = sorted(med["context"].unique())
    for engine, g in med.groupby("engine", sort=True, observed=True):
        if engine.startswith("pkv-"):
            # Auto split: the best split of the grid per context (the paper's autotuned row).
            best = g.loc[g.groupby("context")["device_s"].idxmin()].set_index("context")
            row = {"Method": f"{engine}, auto split"}
            row.update({f"{c // 1024}K ms" if c >= 1024 else f"{c} ms": f"{num(best.loc[c, 'device_s'] * 1e3, '.4f')} (s{int(best.loc[c, 'split'])})" for c in contexts})
        else:
            g = g.set_index("context")
            row = {"Method": engine}
            row.update({f"{c // 1024}K ms" if c >= 1024 else f"{c} ms": num(g.loc[c, "device_s"] * 1e3, ".4f") for c in contexts})
        rows.append(row)
    return pd.DataFrame(rows)


def t_mlp_proxy(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    t = ratios(f, ["seed", "layers"])
    base = baselines(f)
    rows = []
    for layers, g in t.groupby("layers", sort=True):
        # The faster baseline by mean wall throughput over seeds represents FlashInfer.
        b = g[g["engine"].isin(base)].groupby("engine")["wall_tps"].mean().idxmax()
        for engine, label in ((b, f"{b} + MLP tail"), ("adaptive", "Adaptive route + MLP tail")):
            e = g[g["engine"] == engine]
            rows.append({"Layers": str(layers), "Engine": label, "CUDA tok/s": mean_sd(e["cuda_tps"], ".1f"),
                         "CUDA ms/step": mean_sd(e["cuda_ms"]), "Wall tok/s": mean_sd(e["wall_tps"], ".1f"),
                         "Wall ms/step": mean_sd(e["wall_ms"])})
        a = g[g["engine"] == "adaptive"]
        rows.append({"Layers": str(layers), "Engine": "Ratio", "CUDA tok/s": mean_sd(a["cuda_ratio"]) + "×",
                     "CUDA ms/step": "–", "Wall tok/s": mean_sd(a["wall_ratio"]) + "×", "Wall ms/step": "–"})
    return pd.DataFrame(rows)


def t_split_sensitivity(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["family", "max_active", "seed", "split"])
    rows = []
    for family, batch in trace_order(f):
        a = r[(r["family"] == family) & (r["max_active"] == batch) & (r["engine"] == "adaptive")].sort_values("split")
        rows.append({"Trace": trace_label(family, batch), "Split counts": " / ".join(str(int(s)) for s in a["split"]),
                     "CUDA tok/s ratio": " / ".join(num(x) for x in a["cuda_ratio"]),
                     "Wall tok/s ratio": " / ".join(num(x) for x in a["wall_ratio"]),
                     "Seed": str(int(a["seed"].iloc[0]))})
    return pd.DataFrame(rows)


def t_b4_sweep(raw: Raw) -> pd.DataFrame:
    r = ratios(raw.frame, ["family", "max_active", "seed", "split"])
    r = r[r["engine"] == "pkv-workqueue"]
    rows = []
    for split, g in r.groupby("split", sort=True):
        rows.append({"Split": str(int(split)), "Wall ratio": mean_sd(g["wall_ratio"]), "Wall min": num(g["wall_ratio"].min()),
                     "Wall max": num(g["wall_ratio"].max()), "CUDA ratio": mean_sd(g["cuda_ratio"]),
                     "Graph ratio": mean_sd(g["graph_ratio"]), "Seeds": str(g["seed"].nunique())})
    return pd.DataFrame(rows)


def t_gqa_sweep(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["group", "seed"])
    kv_heads = {int(m["group"]): m["num_kv_heads"] for m in raw.metas}
    rows = []
    for group, g in r.groupby("group", sort=True):
        steps = f[(f["group"] == group) & (f["engine"] == "adaptive")]
        a = g[g["engine"] == "adaptive"]
        ungated = g[g["engine"] == "pkv-workqueue"]
        rows.append({"G": str(int(group)), "H_kv": kv_heads[int(group)], "Selected route": modal_route(steps["route"]),
                     "CUDA tok/s ratio": num(a["cuda_ratio"].mean()), "Wall tok/s ratio": num(a["wall_ratio"].mean()),
                     "Ungated workqueue wall ratio": num(ungated["wall_ratio"].mean())})
    return pd.DataFrame(rows)


def _per_engine_ablation(raw: Raw, reference: str) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["seed"])
    ref = r[r["engine"] == reference].set_index("seed")
    rows = []
    for engine, g in r.groupby("engine", sort=True):
        steps = f[f["engine"] == engine]
        rows.append({"Engine": engine, "Launches/step": num(steps["launches"].mean(), ".2f"),
                     "Empty CTAs/step": num(steps["empty_ctas"].mean(), ".1f"),
                     "Read KV MB/step": num(steps["read_kv_bytes"].mean() / 1e6, ".2f"),
                     "Wall ms/step": num(g["wall_ms"].mean(), ".4f"), "CUDA ms/step": num(g["cuda_ms"].mean(), ".4f"),
                     "Graph ms/step": num(g["graph_ms"].mean(), ".4f"),
                     "Wall ratio vs FlashInfer": num(g["wall_ratio"].mean()),
                     "CUDA ratio vs FlashInfer": num(g["cuda_ratio"].mean()),
                     f"Wall vs {reference}": num((g.set_index("seed")["wall_tps"] / ref["wall_tps"]).mean())})
    return pd.DataFrame(rows)


def t_raggedness(raw: Raw) -> pd.DataFrame:
    return _per_engine_ablation(raw, "pkv-workqueue")


def t_ablations(raw: Raw) -> pd.DataFrame:
    return _per_engine_ablation(raw, "pkv-workqueue")


def t_external(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["seed"])
    rows = []
    for engine, g in r.groupby("engine", sort=True):
        steps = f[f["engine"] == engine]
        rows.append({"Engine": engine, "Route": modal_route(steps["route"]), "CUDA tok/s ratio": num(g["cuda_ratio"].mean()),
                     "Wall tok/s ratio": num(g["wall_ratio"].mean()), "Max |e|": num(steps["max_abs_err"].max(), ".3e"),
                     "Steps": str(int(g["steps"].sum()))})
    return pd.DataFrame(rows)


def t_nsight(raw: Raw) -> pd.DataFrame:
    if raw.frame.empty:
        return pd.DataFrame({"Kernel": ["(no parsed Nsight Compute capture in this results folder)"]})
    t = table5(raw.frame, float(raw.frame["roofline_gbps"].iloc[0]))
    for col, fmt in (("Time ms", ".4f"), ("SM thr. %", ".2f"), ("Mem. thr. %", ".2f"), ("DRAM GB/s", ".1f"),
                     ("DRAM / roofline", ".3f"), ("L2 hit %", ".2f")):
        t[col] = t[col].map(lambda v: num(v, fmt))
    return t.astype(str)


def t_coverage(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    rows = []
    for stage, keys in (("serve", ["family", "max_active", "seed"]), ("gqa_sweep", ["family", "max_active", "group", "seed"]),
                        ("mlp_proxy", ["family", "max_active", "layers", "seed"]), ("external", ["family", "max_active", "seed"])):
        s = f[f["stage"] == stage]
        if s.empty:
            continue
        r = ratios(s, keys)
        a = r[r["engine"] == "adaptive"]
        for key, g in a.groupby(keys[:-1], sort=True):
            key = dict(zip(keys[:-1], key if isinstance(key, tuple) else (key,)))
            steps = s[(s["engine"] == "adaptive")
                      & np.logical_and.reduce([s[k] == v for k, v in key.items()])]
            regime = trace_label(key["family"], key["max_active"])
            if stage == "gqa_sweep":
                regime += f", G={key['group']}"
            elif stage == "mlp_proxy":
                regime += f", attention + MLP, {key['layers']} layer(s)"
            elif stage == "external":
                regime = f"External trace, B{key['max_active']}"
            rows.append({"Regime": regime, "Route": modal_route(steps["route"]),
                         "Evidence": f"{stage}: {g['seed'].nunique()} seed(s)",
                         "Wall ratio": mean_sd(g["wall_ratio"]), "Status": status(g["wall_ratio"], steps["route"])})
    return pd.DataFrame(rows)


def status(wall_ratio: pd.Series, routes: pd.Series) -> str:
    lo = wall_ratio.min()
    if not np.isfinite(lo):
        return "Not measured"
    if lo > 1.0:
        return "Positive"
    if routes.isin(["reference", *FLASHINFER]).all():
        return "Baseline route (no regression)" if lo >= 0.97 else "Baseline route, slower than baseline"
    return "Mixed" if wall_ratio.mean() >= 1.0 else "Regression"


TABLES = {
    "isolated": Table("Table 1: isolated native-paged decode attention, B=1, 50% holes",
                      "Median device time per call (CUDA-graph replay; CUDA events, else wall time where not measured). "
                      "PersistentKV rows take the best split of the calibration grid (split in parentheses).",
                      ("isolated",), t_isolated, latex=True),
    "serving": Table("Table 2: calibrated cost-model serving results (held-out seeds)",
                     "Adaptive route over the faster FlashInfer variant per seed and timing; mean±std over seeds. "
                     "Errors are against the correctness baseline after FP32 conversion.",
                     ("serve",), t_serving, latex=True),
    "mlp_proxy": Table("Table 3: model-level proxy, attention + gated MLP tail",
                       "Layers > 1 share one plan per step. Mean±std over seeds.", ("mlp_proxy",), t_mlp_proxy, latex=True),
    "counters": Table("Table 4: scheduler-derived structural counters",
                      "Means per decode step over every held-out seed; baselines report no schedule counters (–).",
                      ("serve",), t_counters, latex=True),
    "nsight": Table("Table 5: Nsight Compute hardware counters",
                    "Per kernel, means over captured invocations; DRAM / roofline is read bandwidth over the calibrated beta.",
                    ("nsight_kernels",), t_nsight, latex=True, required=False),
    "coverage": Table("Table 6: evidence and coverage map",
                      "Status: Positive when every seed's wall ratio > 1; baseline routes are no-regression cases.",
                      ("serve", "gqa_sweep", "mlp_proxy", "external"), t_coverage, latex=True),
    "split_sensitivity": Table("Table 7: split-count sensitivity",
                               "Cost-model policy at the frozen split and its neighbours over the faster FlashInfer variant.",
                               ("split_sensitivity",), t_split_sensitivity, latex=True),
    "gqa_sweep": Table("Table 8: serving GQA/MQA sweep", "Adaptive route and ungated PersistentKV workqueue over FlashInfer.",
                       ("gqa_sweep",), t_gqa_sweep, latex=True),
    "b4_sweep": Table("B4 split sweep: PersistentKV workqueue forced on the B4 boundary",
                      "Mean±std over held-out seeds.", ("b4_sweep",), t_b4_sweep),
    "raggedness": Table("Raggedness ablation: exact buckets vs masked bucket vs workqueue",
                        "Per decode step means; ratios over the faster FlashInfer variant.", ("raggedness",), t_raggedness),
    "ablations": Table("Implementation ablations: fused merge, row-local bounds, early exit, indexed Q/O, CUDA-graph replay",
                       "Graph ms/step is the CUDA-graph replay of run() (no host overhead).", ("implementation",), t_ablations),
    "external": Table("External request trace (Azure LLM inference 2023, conversation)",
                      "Ratios over the faster FlashInfer variant.", ("external",), t_external),
}


def provenance_line(raw: Raw) -> str:
    keys = ("gpu", "torch", "flashinfer", "cuda", "config_hash", "constants_hash", "git_commit")
    parts = [f"{len(raw.metas)} Parquet file(s)"]
    for k in keys:
        parts.append(f"{k}: {', '.join(sorted({m.get(k, 'unknown') for m in raw.metas})) or '–'}")
    return "; ".join(parts)


def render(name: str, table: Table, raw: Raw, fmt: str) -> str:
    frame = table.build(raw)
    if fmt == "md":
        banner = f"> **{SMOKE_BANNER}.**\n\n" if raw.smoke else ""
        body = tabulate(frame, headers="keys", tablefmt="github", showindex=False, disable_numparse=True)
        return f"# {table.title}\n\n{banner}{table.caption}\n\n{body}\n\nSource: {provenance_line(raw)}.\n"
    body = tabulate(frame, headers="keys", tablefmt="latex_booktabs", showindex=False, disable_numparse=True)
    caption = (f"{SMOKE_BANNER}. " if raw.smoke else "") + table.caption
    return (f"% generated by `pkv report` from Parquet; do not edit\n\\begin{{table}}[t]\n\\centering\n"
            f"\\caption{{{table.title}. {caption}}}\n\\label{{tab:{name}}}\n{body}\n\\end{{table}}\n")


def targets(root: Path) -> list[Path]:
    out = [root / "tables" / f"{n}.md" for n in TABLES]
    out += [root / "tables" / f"{n}.tex" for n, t in TABLES.items() if t.latex]
    out += [root / "figures" / f"{n}.png" for n in report_figures.FIGURES]
    return out


def build_report(root: Path, only: list[Path], on_missing: Callable[[Path, str], None] | None = None) -> list[Path]:
    """Write every target (or only those named) under root; returns what was written.

    A target whose stage has no Parquet fails, unless `on_missing` is given: then it is
    told (target, reason) and the target is skipped, as for a partly measured folder.
    """
    wanted = targets(root)
    if only:
        unknown = [p for p in only if p not in wanted]
        if unknown:
            raise ValueError(f"unknown report target(s): {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(str(p) for p in wanted)}")
        wanted = only
    written = []
    for path in wanted:
        try:
            _write_target(root, path)
        except MissingStage as e:
            if on_missing is None:
                raise
            on_missing(path, str(e))
            continue
        written.append(path)
    return written


def _write_target(root: Path, path: Path) -> None:
    name = path.stem
    if path.parent.name == "tables":
        table = TABLES[name]
        atomic_write_text(path, render(name, table, load(root, table.stages, table.required), path.suffix[1:]))
    else:
        fig = report_figures.FIGURES[name]
        raw = load(root, fig.stages, fig.required)
        report_figures.draw(name, raw.frame, raw.smoke, path)
