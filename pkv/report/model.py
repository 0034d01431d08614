"""The model-level decode step's table and figure, from the Parquet of pkv.measure.model_step only.

    python -m pkv.report.model --target results/tables/model_step.md --target results/figures/model_step.png

reads RESULTS_DIR/raw/model_step/*.parquet (RESULTS_DIR: two levels above the first
target, or given). Files with a `kv_dtype` column (per-layer KV) get one row per
KV dtype too, the FP8 rows' accuracy (rel. error against the 16-bit baseline) and their
device-time ratio over FlashInfer's 16-bit graph path; files without it (the shared-cache
run before) are read as they were, so their table regenerates unchanged. A speculative
step's rows (column `q_len` > 1) are their model's own rows, labelled "model (q_len N)".
Per model shape x batch bucket x trace x engine: median serial wall and
device time of the steps that ran in that bucket (pooled over the max_active jobs), the
pipelined throughput of the job served at max_active = bucket, the
ratios over FlashInfer's CUDA-graph path (speed-ups: > 1 is faster), pkv-graph's
prepare() host time, and correctness failures. Over several seeds, a ratio is mean±std
of the per-seed ratios. `t_model_step(raw)` and `plot_model_step(frame, smoke, path)`
have pkv.report.tables's table and figure signatures.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
from tabulate import tabulate

from pkv.config.resolve import SMOKE_BANNER
from pkv.core.io import atomic_write_bytes, atomic_write_text, read_meta
from pkv.engines.table import RUNNERS, runners
from pkv.report.notes import provenance_of
from pkv.report.ratios import mean_sd, modal_route, num

STAGE = "model_step"
TITLE = "Model-level decode step: N layers, one CUDA graph per batch bucket"
KEYS = ["model", "bucket", "family"]   # a synthetic trace is (family, seed); seeds aggregate
KV_LABEL = {"auto": "16-bit", "fp8": "fp8"}


def keys_of(frame: pd.DataFrame) -> list[str]:
    """KEYS, and the KV dtype where the files have it (per-layer KV runs)."""
    return [*KEYS, "kv_dtype"] if "kv_dtype" in frame.columns else list(KEYS)


def speculative(frame: pd.DataFrame) -> pd.DataFrame:
    """The frame with each speculative step's model labelled "model (q_len N)" (once: a label is kept)."""
    if "q_len" not in frame.columns or not (frame["q_len"] > 1).any():
        return frame
    out = frame.copy()
    spec = (out["q_len"] > 1) & ~out["model"].str.endswith(")")
    out["model"] = out["model"].astype(object)
    out.loc[spec, "model"] = out.loc[spec, "model"] + " (q_len " + out.loc[spec, "q_len"].astype(str) + ")"
    return out.astype({"model": frame["model"].dtype})


def load(root: Path) -> tuple[pd.DataFrame, list[dict]]:
    files = sorted((root / "raw" / STAGE).glob("*.parquet"))
    if not files:
        raise ValueError(f"no Parquet under {root / 'raw' / STAGE}; run `pkv measure model-step` (its rule) first")
    metas = [read_meta(f) for f in files]
    gpus = sorted({m.get("gpu", "unknown") for m in metas})
    if len(gpus) > 1:
        raise ValueError(f"{root} mixes results from several GPU models ({', '.join(gpus)})")
    return speculative(pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)), metas


def ratio_base(frame: pd.DataFrame) -> str:
    """The ratio's denominator: the first present of the runners marked ratio_base (pkv.engines.table.RUNNERS)."""
    present = set(frame["engine"])
    return next((b for b in runners("ratio_base") if b in present), sorted(present)[0])


def ratio_bases(frame: pd.DataFrame) -> list[str]:
    """The runners a ratio takes the fastest of, per (model, bucket, trace, KV dtype, seed) and
    per timing: the GPU runners marked ratio_base that are present (FlashInfer's graph paths,
    planned and plan-free XQA), else ratio_base(frame) alone (the FP32 reference on the CPU)."""
    present = set(frame["engine"])
    gpu = [b for b in runners("ratio_base") if b in present and RUNNERS[b].gpu]
    return gpu or [ratio_base(frame)]


def _fastest(out: pd.DataFrame, bases: list[str], keys: list[str], column: str, lowest: bool) -> pd.DataFrame:
    """Per `keys`: the best `column` over the `bases` rows of `out` and the runner that has it."""
    b = out[out["engine"].isin(bases)].dropna(subset=[column])
    g = b.groupby(keys, sort=True, observed=True)[column]
    return b.loc[g.idxmin() if lowest else g.idxmax()].set_index(keys)[[column, "engine"]]


def per_seed(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per (KEYS, seed, engine): medians over steps, pipelined tok/s, ratios over the base."""
    keys = keys_of(frame)
    steps = frame[frame["kind"] == "step"]
    # checked: a step with a baseline (a rel_err, or failed where its own output was not finite)
    steps = steps.assign(checked=steps["rel_err"].notna() | steps["failed"].astype(bool))
    g = steps.groupby([*keys, "seed", "engine"], sort=True, observed=True)
    out = pd.DataFrame({
        "steps": g.size(),
        "wall_ms": g["wall_s"].median() * 1e3,
        "device_ms": g["device_s"].median() * 1e3,
        "prepare_us": g["prepare_s"].median() * 1e6,
        "fails": g["failed"].sum(),
        "checked": g["checked"].sum(),
        "max_rel_err": g["rel_err"].max(),
        "route": g["route"].agg(modal_route),
        "mean_context": g["total_tokens"].sum() / g["active"].sum(),
    })
    pipe = frame[frame["kind"] == "pipelined"].groupby([*keys, "seed", "engine"], sort=True, observed=True)
    out["pipelined_tps"] = pipe["tokens"].sum() / pipe["wall_s"].sum()
    out = out.reset_index()
    bases, on = ratio_bases(frame), [*keys, "seed"]
    for name, column, lowest in (("wall", "wall_ms", True), ("device", "device_ms", True),
                                 ("pipelined", "pipelined_tps", False)):
        best = out.join(_fastest(out, bases, on, column, lowest).add_suffix("_base"), on=on)
        out[f"{name}_x"] = best[f"{column}_base"] / best[column] if lowest else best[column] / best[f"{column}_base"]
        out[f"{name}_base"] = best["engine_base"]
    if "kv_dtype" in keys:   # the fastest base on the 16-bit cache: what FP8 buys over 16-bit practice
        b16 = _fastest(out[out["kv_dtype"] == "auto"], bases, [*KEYS, "seed"], "device_ms", True)
        out["device_x16"] = out.join(b16[["device_ms"]].add_suffix("_b16"), on=[*KEYS, "seed"])["device_ms_b16"] \
            / out["device_ms"]
    return out


def _trace_label(family: str) -> str:
    return "Azure conv" if family == "external" else family


def _engine_rank(engine: str) -> int:
    """Rows, colours and markers in the runner table's order (a name of no row last)."""
    order = runners()
    return order.index(engine) if engine in order else len(order)


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """The formatted table: one row per model x bucket x trace x engine."""
    s = per_seed(frame)
    bases = ratio_bases(frame)
    base = bases[0] if len(bases) == 1 else "fastest FlashInfer"   # several: a column names the winner
    keys = keys_of(frame)
    kv = "kv_dtype" in keys
    rows = []
    groups = s.groupby([*keys, "engine"], sort=False, observed=True)
    order = sorted(groups.groups, key=lambda k: (k[0], k[1], k[2] == "external", k[2], *k[3:-1], _engine_rank(k[-1])))
    for key in order:
        g = groups.get_group(key)
        model, bucket, family, engine = key[0], key[1], key[2], key[-1]
        rows.append({
            "Model": model, "Bucket": int(bucket), "Trace": _trace_label(family),
            **({"KV": KV_LABEL.get(key[3], key[3])} if kv else {}), "Engine": engine,
            "Route": g["route"].iloc[0] if g["route"].nunique() == 1 else "mixed",
            "Seeds": g["seed"].nunique(), "Steps": int(g["steps"].sum()),
            "Context (mean)": num(g["mean_context"].mean(), ".0f"),
            "Wall ms": num(g["wall_ms"].median(), ".3f"), "Device ms": num(g["device_ms"].median(), ".3f"),
            "Pipelined tok/s": num(g["pipelined_tps"].mean(), ".0f"),
            f"Wall × {base}": mean_sd(g["wall_x"]), f"Device × {base}": mean_sd(g["device_x"]),
            f"Pipelined × {base}": mean_sd(g["pipelined_x"]),
            **({"FlashInfer path (wall / device)": f"{modal_route(g['wall_base'])} / {modal_route(g['device_base'])}"}
               if len(bases) > 1 else {}),
            **({f"Device × {base} 16-bit": mean_sd(g["device_x16"])} if kv else {}),
            "Prepare µs": num(g["prepare_us"].median(), ".1f"),
            **({"Rel err (max)": num(g["max_rel_err"].max(), ".1e")} if kv else {}),
            "Check fails": checks(g),
        })
    return pd.DataFrame(rows)


def checks(g: pd.DataFrame) -> str:
    """"fails/checked" over per_seed rows; "unchecked" where no step had a correctness baseline
    (pkv.engines.table.check_base), and the unchecked count where some had none."""
    checked, steps = int(g["checked"].sum()), int(g["steps"].sum())
    if not checked:
        return "unchecked"
    return f"{int(g['fails'].sum())}/{checked}" + (f" ({steps - checked} unchecked)" if checked < steps else "")


def t_model_step(raw) -> pd.DataFrame:
    """pkv.report.tables's table signature (a Raw with .frame)."""
    return table(speculative(raw.frame))


CAPTION = ("Each trace is served at max_active = {buckets} (continuous batching), and decode steps evenly "
           "spaced over it are measured; a step of b rows runs in the smallest bucket >= b (padded). Per bucket: "
           "medians over the steps that ran in it (serial pass; wall: host prepare + launch + synchronize; "
           "device: CUDA events around the graph replay, or around the eager layers); pipelined tok/s: the job "
           "served at max_active = bucket, all its steps back to back (the host prepares step t+1 while the GPU "
           "runs step t). Ratios over FlashInfer's CUDA-graph path (flashinfer-graph{xqa}; the FP32 reference on "
           "the CPU) as speed-ups (> 1 = faster; mean±std over seeds). Prepare µs: the host prepare()/plan() of one "
           "step. Check fails / checked: steps whose final hidden state left the tolerance against the "
           "correctness baseline's for the same input, the first that ran of FlashInfer eager, the FP32 reference "
           "(on the CPU) and the XQA graph path (a sink model's: FlashInfer's planned decode drops sinks); "
           "unchecked: none of them ran. Every layer reads the same KV cache (one cache's bytes, the same bytes "
           "per layer as a real model).")
XQA_CAPTION = (", or its plan-free XQA graph path flashinfer-xqa-graph where that is faster, per seed and timing: "
               "the winner is named in `FlashInfer path`")
# Per-layer KV runs (files with kv_dtype): the same table plus the KV dtype, FP8's accuracy and ratio.
CAPTION_KV = (CAPTION.split(" Every layer reads")[0] + " Every layer attends over its own KV tensor (same page "
              "table and lengths, its own values). KV: the 16-bit cache, or the same values in FP8 e4m3 (tensor "
              "scales); ratios are over the base engine on the same KV dtype, and `Device × ... 16-bit` over the "
              "base on the 16-bit cache. Rel err (max): the final hidden state's relative error against the "
              "baseline's on the 16-bit cache (FP8 rows: the accuracy FP8 costs). Model shapes with fewer layers "
              "than their model are named in the source line (simulated layers).")


def provenance_line(metas: list[dict]) -> str:
    """The common provenance (pkv.report.notes.provenance_of) and what only the model step records."""
    parts = [provenance_of(metas)]
    skipped = sorted({j for m in metas for j in _json_list(m.get("skipped", "[]"))})
    if skipped:
        parts.append(f"skipped past the time budget: {', '.join(skipped)}")
    dropped = sorted({f"{k} ({v})" for m in metas for k, v in _json_dict(m.get("engine_errors", "{}")).items()})
    if dropped:
        parts.append(f"not measured: {'; '.join(dropped)}")
    unchecked = sorted({u for m in metas for u in _json_list(m.get("unchecked", "[]"))})
    if unchecked:
        parts.append(f"unchecked (no correctness baseline ran): {', '.join(unchecked)}")
    simulated = sorted({f"{k}: {v}" for m in metas for k, v in _json_dict(m.get("simulated_layers", "{}")).items()})
    if simulated:
        parts.append(f"simulated layers: {'; '.join(simulated)}")
    commands = sorted({m.get("command", "") for m in metas} - {""})
    if commands:
        parts.append(f"command: `{'`; `'.join(commands)}`")
    return "; ".join(parts)


def _json_dict(text: str) -> dict:
    import json

    try:
        return dict(json.loads(text))
    except ValueError:
        return {}


def _json_list(text: str) -> list[str]:
    import json

    try:
        return list(json.loads(text))
    except ValueError:
        return []


def render_md(frame: pd.DataFrame, metas: list[dict]) -> str:
    smoke = any(m.get("profile") == "smoke" for m in metas)
    banner = f"> **{SMOKE_BANNER}.**\n\n" if smoke else ""
    body = tabulate(table(frame), headers="keys", tablefmt="github", showindex=False, disable_numparse=True)
    xqa = XQA_CAPTION if len(ratio_bases(frame)) > 1 else ""
    caption = (CAPTION_KV if "kv_dtype" in frame.columns else CAPTION).format(buckets=_buckets(frame), xqa=xqa)
    return f"# {TITLE}\n\n{banner}{caption}\n\n{body}\n\nSource: {provenance_line(metas)}.\n"


def _buckets(frame: pd.DataFrame) -> str:
    """The max_active values the files served, in words ("1, 8 and 32")."""
    b = [str(int(x)) for x in sorted(frame["max_active"].unique())]
    return b[0] if len(b) == 1 else f"{', '.join(b[:-1])} and {b[-1]}"


MARKERS = "osD^vP"


def engine_label(engine: str) -> str:
    """The figure's legend name of a runner (its RUNNERS row's label; a name of no row as it is)."""
    return RUNNERS[engine].label if engine in RUNNERS else engine


def step_medians(frame: pd.DataFrame) -> pd.DataFrame:
    """The figure's points: per (model, KV dtype, bucket, engine) and octave of the step's KV
    tokens, the median serial wall ms and the median KV tokens of the steps in it."""
    steps = frame[frame["kind"] == "step"].copy()
    steps["kv_dtype"] = steps["kv_dtype"].fillna("auto") if "kv_dtype" in steps else "auto"
    steps["octave"] = np.round(np.log2(steps["total_tokens"].clip(lower=1).astype(float)))
    steps["wall_ms"] = steps["wall_s"] * 1e3
    g = steps.groupby(["model", "kv_dtype", "bucket", "engine", "octave"], sort=True, observed=True)
    return g.agg(tokens=("total_tokens", "median"), wall_ms=("wall_ms", "median"), steps=("wall_ms", "size"),
                 layers=("layers", "first"), hidden=("hidden", "first")).reset_index()


def plot_model_step(frame: pd.DataFrame, smoke: bool) -> bytes:
    """The model-step figure's PNG bytes (model_step_figure, saved)."""
    import matplotlib.pyplot as plt

    fig = model_step_figure(frame, smoke)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def model_step_figure(frame: pd.DataFrame, smoke: bool):
    """Median serial wall ms per step over the step's KV tokens: one panel per (model shape,
    KV dtype) row and batch bucket column, one line per engine, the legend below the panels.
    The laid-out figure, not yet saved (tests read it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pkv.report.figures import plain_log_axis

    pts = step_medians(frame)
    rows = sorted({(int(h), m, kv) for h, m, kv in zip(pts["hidden"], pts["model"], pts["kv_dtype"])},
                  key=lambda r: (r[0], r[1], r[2] != "auto", r[2]))
    buckets = sorted(int(b) for b in pts["bucket"].unique())
    engines = sorted(pts["engine"].unique(), key=_engine_rank)
    style = {e: (plt.get_cmap("tab10")(min(_engine_rank(e), 9)), MARKERS[min(_engine_rank(e), len(MARKERS) - 1)])
             for e in engines}
    fig, axes = plt.subplots(len(rows), len(buckets), figsize=(1.2 + 3.5 * len(buckets), 1.4 + 2.6 * len(rows)),
                             squeeze=False, sharex="col", sharey="row", layout="constrained")
    for r, (_, model, kv) in enumerate(rows):
        row = pts[(pts["model"] == model) & (pts["kv_dtype"] == kv)]
        finite = row["wall_ms"].dropna()
        for c, bucket in enumerate(buckets):
            ax = axes[r][c]
            cell = row[row["bucket"] == bucket]
            for engine in engines:
                e = cell[cell["engine"] == engine].dropna(subset=["wall_ms"]).sort_values("tokens")
                if not e.empty:
                    color, marker = style[engine]
                    ax.plot(e["tokens"], e["wall_ms"], marker=marker, markersize=4, linewidth=1.4, color=color,
                            label=engine_label(engine))
            if cell["wall_ms"].isna().all():
                ax.text(0.5, 0.5, "no steps in this bucket", ha="center", va="center", transform=ax.transAxes,
                        fontsize=8, color="gray")
            ax.grid(True, which="major", alpha=0.3)
            if r == 0:
                ax.set_title(f"bucket B{bucket}", fontsize=10)
            if c == 0:
                layers = int(row["layers"].iloc[0])
                ax.set_ylabel(f"{model}, {layers} layers\n{KV_LABEL.get(kv, kv)} KV\nserial wall ms / step",
                              fontsize=9)
            if r == len(rows) - 1:
                ax.set_xlabel("KV tokens per layer in the step", fontsize=9)
        if not finite.empty:
            plain_log_axis(axes[r][0].yaxis, finite.min() / 1.15, finite.max() * 1.15)
    for c, bucket in enumerate(buckets):
        col = pts.loc[pts["bucket"] == bucket, "tokens"].dropna()
        if not col.empty:
            plain_log_axis(axes[0][c].xaxis, col.min() / 1.3, col.max() * 1.3, base=2)
    handles = {}
    for ax in axes.ravel():
        handles.update(zip(*reversed(ax.get_legend_handles_labels())))
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="outside lower center", ncols=min(len(handles), 4),
                   fontsize=8, frameon=False)
    fig.suptitle("Model step: serial wall time per step over the KV it reads (median per octave of tokens)"
                 + (f"\n{SMOKE_BANNER}" if smoke else ""), fontsize=11)
    return fig


def write_targets(root: Path, targets: list[Path]) -> list[Path]:
    """Write each target (tables/model_step.md, figures/model_step.png) from root's Parquet."""
    frame, metas = load(root)
    smoke = any(m.get("profile") == "smoke" for m in metas)
    for t in targets:
        if t.suffix == ".md":
            atomic_write_text(t, render_md(frame, metas))
        elif t.suffix == ".png":
            atomic_write_bytes(t, plot_model_step(frame, smoke))
        else:
            raise ValueError(f"unknown model-step report target {t}; write a .md table or a .png figure")
    return targets


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pkv.report.model",
                                description="model-step table and figure from Parquet")
    p.add_argument("results_dir", nargs="?", help="default: two levels above the first --target")
    p.add_argument("--target", action="append", default=[], help="model_step.md and/or model_step.png; repeatable")
    args = p.parse_args(argv)
    try:
        targets = [Path(t) for t in args.target]
        if not args.results_dir and not targets:
            raise ValueError("give RESULTS_DIR or at least one --target")
        root = Path(args.results_dir) if args.results_dir else targets[0].resolve().parent.parent
        targets = targets or [root / "tables" / f"{STAGE}.md", root / "figures" / f"{STAGE}.png"]
        for t in write_targets(root, targets):
            print(f"wrote {t}", file=sys.stderr)
    except (ValueError, OSError) as e:
        print(f"pkv.report.model: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
