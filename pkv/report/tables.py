"""`pkv report RESULTS_DIR`: every table and figure from the Parquet under RESULTS_DIR/raw.

Reads Parquet only (never a GPU; of the folder's config.json only the held-out seeds, to
flag a missing one). Tables are Markdown, plus LaTeX for the paper's tables, and are
deterministic: the same Parquet gives the same bytes. Ratios are per job (one Parquet
file = one trace, one seed), pkv.report.ratios; mean and sample std are over seeds.

A report refuses to mix: the files it reads must name one GPU model, one config hash and
one constants hash (those of the folder's config.json and calibration/constants.json
where the folder has them). An unreadable file is named in a one-line error. Every
requested table and figure is built in memory first and written only when all of them
built (all or nothing). A seed missing from a per-seed stage is flagged in the table.

`pkv compare RUN_DIR` puts a run's tables beside the committed reference run's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
from tabulate import tabulate

from pkv.config.resolve import SMOKE_BANNER
from pkv.config.stages import EXTERNAL_REPLAYS
from pkv.core.io import atomic_write_many
from pkv.core.units import K
from pkv.engines import table
from pkv.measure.nsight import table5

# What the report reads and refuses (names re-exported for the modules that import them here).
from pkv.report.load import MissingStage, Raw, ReportError, check_folder, frozen, load, seeds_cell  # noqa: F401
from pkv.report.notes import missing_note, provenance_line, ran_line, trace_heading  # noqa: F401 (compare reads missing_note here)
from pkv.report.ratios import (
    base_path,
    baselines,
    mean_sd,
    modal_route,
    names_path,
    num,
    ratios,
    router_label,
    routers,
    trace_label,
    trace_order,
)
from pkv.report.spec import FIGURE_SPECS, TABLE_SPECS, configured

# ---------------------------------------------------------------- tables


@dataclass(frozen=True)
class Table:
    """A TableSpec (pkv.report.spec) with the function that builds it."""

    title: str
    caption: str
    stages: tuple[str, ...]
    keys: tuple[str, ...]
    build: Callable[[Raw], pd.DataFrame] | None   # None: the spec's `render` makes the file (pkv.report.artifacts)
    latex: bool = False
    required: bool = True
    render: str = ""
    profiles: tuple[str, ...] = ("paper", "smoke")
    in_all: bool | str = True


def t_serving(raw: Raw) -> pd.DataFrame:
    """One row per trace and adaptive engine (the router engines: `adaptive` and e.g.
    `adaptive:objective=overlapped`, the latter labelled "trace · objective=overlapped")."""
    f = raw.frame
    r = ratios(f, ["family", "max_active", "seed"])
    rows = []
    for (family, batch), router in ((fb, e) for fb in trace_order(f) for e in routers(f) or [table.ROUTER]):
        sel = (r["family"] == family) & (r["max_active"] == batch) & (r["engine"] == router)
        steps = f[(f["family"] == family) & (f["max_active"] == batch) & (f["engine"] == router)]
        if steps.empty and router != table.ROUTER:
            continue
        rows.append({
            "Trace / mode": router_label(trace_label(family, batch), router),
            "Selected route": modal_route(steps["route"]), "CUDA tok/s ratio": mean_sd(r.loc[sel, "cuda_ratio"]),
            "Graph ratio": mean_sd(r.loc[sel, "graph_ratio"]), "Wall tok/s ratio": mean_sd(r.loc[sel, "wall_ratio"]),
            "Wall ratio min": num(r.loc[sel, "wall_ratio"].min()),
            "Max |e|": num(steps["max_abs_err"].max(), ".3e"), "Mean |e|": num(steps["mean_abs_err"].mean(), ".3e"),
            **({"FlashInfer path (wall / CUDA)": base_path(r.loc[sel])} if names_path(f["engine"]) else {}),
            "Seeds": seeds_cell(raw, "serve", family, batch, r.loc[sel, "seed"].nunique()),
        })
    return pd.DataFrame(rows)


def t_counters(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    rows = []
    for family, batch in trace_order(f):
        sub = f[(f["family"] == family) & (f["max_active"] == batch)]
        for engine, g in sub.groupby("engine", sort=True, observed=True):
            rows.append({
                "Trace": trace_label(family, batch), "Engine": engine,
                "Launches/step": num(g["launches"].mean(), ".2f"),
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
        if table.persistentkv(engine):
            # Auto split: the best split of the grid per context (the paper's autotuned row).
            best = g.loc[g.groupby("context")["device_s"].idxmin()].set_index("context")
            row = {"Method": f"{engine}, auto split"}
            row.update({f"{c // K}K ms" if c >= K else f"{c} ms": f"{num(best.loc[c, 'device_s'] * 1e3, '.4f')} "
                        f"(s{int(best.loc[c, 'split'])})" for c in contexts})
        else:
            g = g.set_index("context")
            row = {"Method": engine}
            row.update({f"{c // K}K ms" if c >= K else f"{c} ms": num(g.loc[c, "device_s"] * 1e3, ".4f")
                        for c in contexts})
        rows.append(row)
    return pd.DataFrame(rows)


def t_mlp_proxy(raw: Raw) -> pd.DataFrame:
    """Per layer count: the faster baseline, then each engine of the stage (mlp_proxy.engines:
    other engines by name, then the routers, plain `adaptive` first) with its ratio over
    that baseline. A run of `adaptive` alone gives the committed table's three rows."""
    f = raw.frame
    t = ratios(f, ["seed", "layers"])
    base = baselines(f)
    rows = []
    for layers, g in t.groupby("layers", sort=True):
        # The faster baseline by mean wall throughput over seeds represents FlashInfer.
        b = g[g["engine"].isin(base)].groupby("engine")["wall_tps"].mean().idxmax()
        present = set(g["engine"]) - set(base)
        adaptive = [e for e in routers(g) if e in present]
        specs = sorted(present - set(adaptive)) + adaptive
        labels = {e: router_label("Adaptive route", e) if e in adaptive else e for e in specs}
        for engine, label in ((b, f"{b} + MLP tail"), *((e, f"{labels[e]} + MLP tail") for e in specs)):
            e = g[g["engine"] == engine]
            rows.append({"Layers": str(layers), "Engine": label, "CUDA tok/s": mean_sd(e["cuda_tps"], ".1f"),
                         "CUDA ms/step": mean_sd(e["cuda_ms"]), "Wall tok/s": mean_sd(e["wall_tps"], ".1f"),
                         "Wall ms/step": mean_sd(e["wall_ms"])})
            if engine == b:
                continue
            rows.append({"Layers": str(layers), "Engine": "Ratio" if engine == table.ROUTER else f"Ratio, {engine}",
                         "CUDA tok/s": mean_sd(e["cuda_ratio"]) + "×", "CUDA ms/step": "–",
                         "Wall tok/s": mean_sd(e["wall_ratio"]) + "×", "Wall ms/step": "–"})
    return pd.DataFrame(rows)


def t_split_sensitivity(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["family", "max_active", "seed", "split"])
    rows = []
    for family, batch in trace_order(f):
        a = r[(r["family"] == family) & (r["max_active"] == batch) & (r["engine"] == table.ROUTER)].sort_values("split")
        rows.append({"Trace": trace_label(family, batch), "Split counts": " / ".join(str(int(s)) for s in a["split"]),
                     "CUDA tok/s ratio": " / ".join(num(x) for x in a["cuda_ratio"]),
                     "Wall tok/s ratio": " / ".join(num(x) for x in a["wall_ratio"]),
                     "Seed": str(int(a["seed"].iloc[0]))})
    return pd.DataFrame(rows)


def t_b4_sweep(raw: Raw) -> pd.DataFrame:
    r = ratios(raw.frame, ["family", "max_active", "seed", "split"])
    r = r[r["engine"] == table.WORKQUEUE]
    rows = []
    for split, g in r.groupby("split", sort=True):
        family, batch = g["family"].iloc[0], int(g["max_active"].iloc[0])
        rows.append({"Split": str(int(split)), "Wall ratio": mean_sd(g["wall_ratio"]),
                     "Wall min": num(g["wall_ratio"].min()), "Wall max": num(g["wall_ratio"].max()),
                     "CUDA ratio": mean_sd(g["cuda_ratio"]), "Graph ratio": mean_sd(g["graph_ratio"]),
                     "Seeds": seeds_cell(raw, "b4_sweep", family, batch, g["seed"].nunique())})
    return pd.DataFrame(rows)


def t_gqa_sweep(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["group", "seed"])
    kv_heads = {int(m["group"]): m["num_kv_heads"] for m in raw.metas}
    rows = []
    for group, g in r.groupby("group", sort=True):
        steps = f[(f["group"] == group) & (f["engine"] == table.ROUTER)]
        a = g[g["engine"] == table.ROUTER]
        ungated = g[g["engine"] == table.WORKQUEUE]
        rows.append({"G": str(int(group)), "H_kv": kv_heads[int(group)], "Selected route": modal_route(steps["route"]),
                     "CUDA tok/s ratio": num(a["cuda_ratio"].mean()), "Wall tok/s ratio": num(a["wall_ratio"].mean()),
                     "Ungated workqueue wall ratio": num(ungated["wall_ratio"].mean()),
                     **({"FlashInfer path (wall / CUDA)": base_path(a)} if names_path(f["engine"]) else {})})
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
                     f"Wall vs {reference}": num((g.set_index("seed")["wall_tps"] / ref["wall_tps"]).mean()),
                     **({"FlashInfer path (wall / CUDA)": base_path(g)} if names_path(f["engine"]) else {})})
    return pd.DataFrame(rows)


def t_raggedness(raw: Raw) -> pd.DataFrame:
    return _per_engine_ablation(raw, table.WORKQUEUE)


def t_ablations(raw: Raw) -> pd.DataFrame:
    return _per_engine_ablation(raw, table.WORKQUEUE)


def t_external(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    r = ratios(f, ["seed"])
    rows = []
    for engine, g in r.groupby("engine", sort=True):
        steps = f[f["engine"] == engine]
        rows.append({"Engine": engine, "Route": modal_route(steps["route"]),
                     "CUDA tok/s ratio": num(g["cuda_ratio"].mean()),
                     "Wall tok/s ratio": num(g["wall_ratio"].mean()), "Max |e|": num(steps["max_abs_err"].max(), ".3e"),
                     **({"FlashInfer path (wall / CUDA)": base_path(g)} if names_path(f["engine"]) else {}),
                     "Steps": str(int(g["steps"].sum()))})
    return pd.DataFrame(rows)


def t_nsight(raw: Raw) -> pd.DataFrame:
    if raw.frame.empty:
        return pd.DataFrame({"Kernel": ["(no parsed Nsight Compute capture in this results folder)"]})
    t = table5(raw.frame, float(raw.frame["roofline_gbps"].iloc[0]))
    for col, fmt in (("Time ms", ".4f"), ("SM thr. %", ".2f"), ("Mem. thr. %", ".2f"), ("DRAM GB/s", ".1f"),
                     ("DRAM / roofline", ".3f"), ("L2 hit %", ".2f")):
        t[col] = t[col].map(lambda v, fmt=fmt: num(v, fmt))
    return t.astype(str)


def t_coverage(raw: Raw) -> pd.DataFrame:
    f = raw.frame
    rows = []
    for stage, keys in (("serve", ["family", "max_active", "seed"]),
                        ("gqa_sweep", ["family", "max_active", "group", "seed"]),
                        ("mlp_proxy", ["family", "max_active", "layers", "seed"]),
                        ("external", ["family", "max_active", "seed"])):
        s = f[f["stage"] == stage]
        if s.empty:
            continue
        r = ratios(s, keys)
        for router, (key, g) in ((e, kg) for e in routers(s) or [table.ROUTER]
                                 for kg in r[r["engine"] == e].groupby(keys[:-1], sort=True)):
            key = dict(zip(keys[:-1], key if isinstance(key, tuple) else (key,)))
            steps = s[(s["engine"] == router) & np.logical_and.reduce([s[k] == v for k, v in key.items()])]
            regime = trace_label(key["family"], key["max_active"])
            if stage == "gqa_sweep":
                regime += f", G={key['group']}"
            elif stage == "mlp_proxy":
                regime += f", attention + MLP, {key['layers']} layer(s)"
            elif stage == "external":
                regime = f"External trace, B{key['max_active']}"
            rows.append({"Regime": router_label(regime, router), "Route": modal_route(steps["route"]),
                         "Evidence": f"{stage}: {g['seed'].nunique()} seed(s)",
                         "Wall ratio": mean_sd(g["wall_ratio"]), "Status": status(g["wall_ratio"], steps["route"])})
    return pd.DataFrame(rows)


def status(wall_ratio: pd.Series, routes: pd.Series) -> str:
    lo = wall_ratio.min()
    if not np.isfinite(lo):
        return "Not measured"
    if lo > 1.0:
        return "Positive"
    if routes.isin([table.REFERENCE, *table.baselines()]).all():
        return "Baseline route (no regression)" if lo >= 0.97 else "Baseline route, slower than baseline"
    return "Mixed" if wall_ratio.mean() >= 1.0 else "Regression"


BUILDERS = {"isolated": t_isolated, "serving": t_serving, "mlp_proxy": t_mlp_proxy, "counters": t_counters,
            "nsight": t_nsight, "coverage": t_coverage, "split_sensitivity": t_split_sensitivity,
            "gqa_sweep": t_gqa_sweep, "b4_sweep": t_b4_sweep, "raggedness": t_raggedness, "ablations": t_ablations,
            "external": t_external, "external_stress": t_external}
TABLES = {name: Table(**asdict(spec), build=BUILDERS.get(name)) for name, spec in TABLE_SPECS.items()}


def heading(name: str, table: Table, raw: Raw) -> tuple[str, str]:
    """(title, caption) of a table: the spec's, or an external replay's own (pkv.report.notes)."""
    named = trace_heading(raw, table.caption) if name in EXTERNAL_REPLAYS else None
    return named or (table.title, table.caption)


def render(name: str, table: Table, raw: Raw, fmt: str) -> str:
    frame = table.build(raw)
    note = missing_note(raw)
    title, caption = heading(name, table, raw)
    if fmt == "md":
        banner = f"> **{SMOKE_BANNER}.**\n\n" if raw.smoke else ""
        body = tabulate(frame, headers="keys", tablefmt="github", showindex=False, disable_numparse=True)
        note = f"{note}\n\n" if note else ""
        return f"# {title}\n\n{banner}{caption}\n\n{body}\n\n{note}{ran_line(raw)}Source: {provenance_line(raw)}.\n"
    body = tabulate(frame, headers="keys", tablefmt="latex_booktabs", showindex=False, disable_numparse=True)
    caption = (f"{SMOKE_BANNER}. " if raw.smoke else "") + caption + (f" {note.replace('**', '')}" if note else "")
    return (f"% generated by `pkv report` from Parquet; do not edit\n\\begin{{table}}[t]\n\\centering\n"
            f"\\caption{{{title}. {caption}}}\n\\label{{tab:{name}}}\n{body}\n\\end{{table}}\n")


def targets(root: Path) -> list[Path]:
    """Every table and figure of the folder's profile (its frozen config's; any, without one),
    an optional stage's where that config has it (pkv.report.spec.configured)."""
    cfg = frozen(root)[0] if (root / "config.json").exists() else None
    mine = (lambda spec: cfg["profile"] in spec.profiles and configured(spec, cfg)) if cfg and "profile" in cfg \
        else (lambda spec: True)
    out = [root / "tables" / f"{n}.md" for n, t in TABLES.items() if mine(t)]
    out += [root / "tables" / f"{n}.tex" for n, t in TABLES.items() if t.latex and mine(t)]
    out += [root / "figures" / f"{n}.png" for n, f in FIGURE_SPECS.items() if mine(f)]
    return out


def build_report(root: Path, only: list[Path], on_missing: Callable[[Path, str], None] | None = None) -> list[Path]:
    """Write every target (or only those named) under root; returns what was written.

    All or nothing: every target is built in memory first; if any fails (an unreadable
    or mixed file), nothing is written. A target whose stage has no Parquet fails too,
    unless `on_missing` is given: then it is told (target, reason) and the target is
    skipped, as for a partly measured folder.
    """
    check_folder(root)
    wanted = targets(root)
    if only:
        unknown = [p for p in only if p not in wanted]
        if unknown:
            raise ValueError(f"unknown report target(s): {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(str(p) for p in wanted)}")
        wanted = only
    built: dict[Path, bytes] = {}
    cache: dict[tuple, Raw] = {}
    for path in wanted:
        try:
            built[path] = _build_target(root, path, cache)
        except MissingStage as e:
            if on_missing is None:
                raise
            on_missing(path, str(e))
    # All or none on disk too: every file is staged before any is replaced (a directory in
    # the way, a full disk fails the whole report, naming the path).
    atomic_write_many(built)
    return list(built)


def _load_cached(root: Path, stages: tuple[str, ...], required: bool, cache: dict) -> Raw:
    key = (stages, required)
    if key not in cache:
        cache[key] = load(root, stages, required)
    return cache[key]


def _build_target(root: Path, path: Path, cache: dict) -> bytes:
    name = path.stem
    spec = (TABLE_SPECS if path.parent.name == "tables" else FIGURE_SPECS)[name]
    if spec.render:
        from pkv.report import artifacts

        return getattr(artifacts, spec.render)(root)
    if path.parent.name == "tables":
        table = TABLES[name]
        return render(name, table, _load_cached(root, table.stages, table.required, cache), path.suffix[1:]).encode()
    from pkv.report import figures as report_figures
    spec = FIGURE_SPECS[name]
    raw = _load_cached(root, spec.stages, spec.required, cache)
    return report_figures.draw(name, raw.frame, raw.smoke)
