"""The FP8 KV tables, from their Parquet alone: kernel speed, accuracy, the serving ablation.

- `kernels`: `pkv bench kernels --suites fp8` rows. Per point (the same lengths from a
  16-bit cache and from both FP8 policies): pkv-graph and FlashInfer device time, the FP8
  kernel's fraction of the read roofline on FP8 bytes, and its ratio over the faster
  FlashInfer 16-bit and the faster FlashInfer FP8 decode; the FP8 issue's bars as measured.
- `accuracy`: `pkv bench fp8-accuracy` rows, mean over seeds per (data, cache, engine).
- `serving`: the `kv_fp8` ablation (one Parquet per held-out seed): per cache and engine,
  ms per step and the throughput ratios, mean±sd over seeds.
"""

from __future__ import annotations

import argparse

import pandas as pd

from pkv.core import io
from pkv.core.units import K
from pkv.engines.table import PKV_KERNEL, baselines
from pkv.report.kernels import pools_note
from pkv.report.ratios import mean_sd, names_path, num, throughputs

ENGINE = PKV_KERNEL


def _provenance(meta: dict) -> str:
    return (f"Command: `{meta.get('command', '?')}`  \nGPU: {meta.get('gpu', '?')}, CUDA {meta.get('cuda', '?')}, "
            f"torch {meta.get('torch', '?')}, FlashInfer {meta.get('flashinfer', '?')}, "
            f"commit {meta.get('git_commit', '?')}  ")


# ---------------------------------------------------------------- kernels


def kernel_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per point: µs of each (cache, engine), FP8 roofline fraction and ratios."""
    f = frame[frame.family == "fp8"].copy()
    f["cache"] = f.kv_dtype.where(f.kv_dtype == "auto", "fp8-" + f.fp8_policy.astype(str)).replace("auto", "16-bit")
    wide = f.pivot_table(index="point", columns=["cache", "engine"], values="graph_us", sort=False)
    roof = f[f.engine == ENGINE].pivot_table(index="point", columns="cache", values="frac_of_roofline", sort=False)
    out = pd.DataFrame(index=wide.index)
    for cache in ("16-bit", "fp8-tensor", "fp8-page"):
        out[f"{ENGINE} {cache}"] = wide.get((cache, ENGINE))
    for cache, col in (("16-bit", "flashinfer 16-bit"), ("fp8-tensor", "flashinfer fp8")):
        fi = pd.DataFrame({e: wide[(cache, e)] for e in baselines() if (cache, e) in wide}, index=wide.index)
        out[col] = fi.min(axis=1) if len(fi.columns) else float("nan")     # the fastest FlashInfer path, named
        out[f"{col} path"] = fi.apply(lambda r: r.idxmin() if r.notna().any() else "—", axis=1) \
            if len(fi.columns) else "—"
    out["roofline fp8-tensor"] = roof.get("fp8-tensor")
    out["over FI 16-bit"] = out["flashinfer 16-bit"] / out[f"{ENGINE} fp8-tensor"]
    out["over FI fp8"] = out["flashinfer fp8"] / out[f"{ENGINE} fp8-tensor"]
    out["over pkv 16-bit"] = out[f"{ENGINE} 16-bit"] / out[f"{ENGINE} fp8-tensor"]
    first = f.drop_duplicates("point").set_index("point")
    return out.join(first[["batch", "max_len"]])


def kernel_bars(s: pd.DataFrame) -> list[str]:
    long1 = s[(s.batch == 1) & (s.max_len >= 32 * K)]
    roof = s[((s.batch == 1) & (s.max_len >= 64 * K)) | (s.index == "B8 32K")]

    def listing(rows, col, fmt):
        return ", ".join(f"{p} {format(r[col], fmt)}" for p, r in rows.iterrows()) or "n/a"

    return [
        f"- B1 ≥ 32K over FlashInfer's faster 16-bit decode: {listing(long1, 'over FI 16-bit', '.2f')} (bar ≥ 1.8).",
        f"- B1 ≥ 32K over FlashInfer's faster FP8 decode: {listing(long1, 'over FI fp8', '.2f')} (bar ≥ 1.3).",
        f"- Read roofline on FP8 bytes, B1 ≥ 64K and B8 32K: {listing(roof, 'roofline fp8-tensor', '.1%')} "
        "(bar ≥ 90 %).",
    ]


XQA_NOTE = " or the plan-free XQA: the fastest, named in `FI path`"


def kernels_table(frame: pd.DataFrame, meta: dict) -> str:
    s = kernel_summary(frame)
    cols = [f"{ENGINE} 16-bit", "flashinfer 16-bit", f"{ENGINE} fp8-tensor", f"{ENGINE} fp8-page", "flashinfer fp8"]
    named = names_path(frame["engine"])
    head = ["point", *[f"{c} µs" for c in cols], *(["FI path 16-bit / fp8"] if named else []), "% roofline (fp8)",
            "over FI 16-bit", "over FI fp8", "over pkv 16-bit"]
    lines = [
        "# FP8 (e4m3) KV cache: decode kernels against FlashInfer (device time)",
        "",
        _provenance(meta),
        f"Read roofline {float(meta.get('roofline_gbps', 'nan')):.0f} GB/s. µs = median device time per call by "
        f"CUDA-graph replay, KV copies rotated beyond the L2{pools_note(meta)}. Each point runs the same lengths "
        "from a 16-bit cache "
        "and from e4m3 caches with tensor scales (FlashInfer's convention; FlashInfer reads only these) and with "
        "per-(page, kv head) factors. FlashInfer columns are its faster decode variant (CUDA cores or tensor "
        f"cores{XQA_NOTE if named else ''}). % roofline = FP8 K+V bytes / time / roofline for "
        "pkv-graph fp8-tensor; ratios are "
        "time ÷ pkv-graph fp8-tensor time (> 1: PersistentKV FP8 faster). Shape: Hq 32, Hkv 8, d 128, fp16 "
        "queries, page 16, 50 % holes.",
        "",
        "## Bars, as measured",
        "",
        *kernel_bars(s),
        "",
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for point, r in s.iterrows():
        path = f"{r['flashinfer 16-bit path']} / {r['flashinfer fp8 path']}"
        cells = [point, *[num(r[c], ".1f") for c in cols], *([path] if named else []),
                 num(100 * r["roofline fp8-tensor"], ".1f"),
                 num(r["over FI 16-bit"], ".2f"), num(r["over FI fp8"], ".2f"), num(r["over pkv 16-bit"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- accuracy


def accuracy_table(frame: pd.DataFrame, meta: dict) -> str:
    ok = frame[frame.error.fillna("") == ""]
    g = ok.groupby(["data", "kv", "engine"], sort=False)[["max_abs", "mean_abs", "rel_rms"]].mean().reset_index()
    seeds = sorted(frame.seed.unique())

    def cell(data, kv, engine, col="rel_rms"):
        r = g[(g.data == data) & (g.kv == kv) & (g.engine == engine)]
        return r[col].iloc[0] if len(r) else float("nan")

    fi = [e for e in baselines() if e in set(ok.engine)]
    lines = [
        "# FP8 (e4m3) KV cache: accuracy against the FP32 reference on the original 16-bit values",
        "",
        _provenance(meta),
        f"Batch lengths {meta.get('lens', '?')}; seeds {', '.join(map(str, seeds))} (each a fresh cache and queries); "
        "every number is the mean over seeds. rel RMS = ‖out − ref‖₂ / ‖ref‖₂ over the batch; max / mean |e| are "
        "absolute. `dequantized` = the FP32 reference over the dequantized cache: the quantization alone, no kernel "
        "rounding. Data: random = standard normal K and V; outliers-xN = 4 K channels per KV head N times larger; "
        "head-spread = each KV head's K and V scaled by 10^U(−3, 0).",
        "",
        "## Bars, as measured",
        "",
    ]
    for data in dict.fromkeys(g.data):
        pk = cell(data, "fp8-tensor", ENGINE)
        best_fi = min((cell(data, "fp8-tensor", e) for e in fi), default=float("nan"))
        lines.append(f"- {data}: pkv-graph tensor scales rel RMS {num(pk, '.4f')} vs FlashInfer FP8 "
                     f"{num(best_fi, '.4f')} (bar: no worse); "
                     f"page factors {num(cell(data, 'fp8-page', ENGINE), '.4f')} "
                     f"(bar on outlier caches: better than tensor scales).")
    head = ["data", "cache", "engine", "rel RMS", "max |e|", "mean |e|"]
    lines += ["", "| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * 3]
    for _, r in g.iterrows():
        lines.append(f"| {r.data} | {r.kv} | {r.engine} | {num(r.rel_rms, '.4f')} | {num(r.max_abs, '.3e')} | "
                     f"{num(r.mean_abs, '.3e')} |")
    refused = frame[frame.error.fillna("") != ""][["kv", "engine"]].drop_duplicates()
    if len(refused):
        lines += ["", "Not run (the engine refuses the cache): " +
                  ", ".join(f"{e} on {kv}" for kv, e in refused.itertuples(index=False)) + "."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- serving ablation


def serving_table(frame: pd.DataFrame, meta: dict) -> str:
    t = throughputs(frame, ["seed", "kv_dtype"])
    fi = t[t.engine.isin(baselines())]
    best16 = fi[fi.kv_dtype == "auto"].groupby("seed")[["graph_tps", "wall_tps"]].max()
    best8 = fi[fi.kv_dtype == "fp8"].groupby("seed")[["graph_tps", "wall_tps"]].max()
    t = t.join(best16.add_suffix("_fi16"), on="seed").join(best8.add_suffix("_fi8"), on="seed")
    for timing in ("graph", "wall"):
        t[f"{timing}_over_fi16"] = t[f"{timing}_tps"] / t[f"{timing}_tps_fi16"]
        t[f"{timing}_over_fi8"] = t[f"{timing}_tps"] / t[f"{timing}_tps_fi8"]
    seeds = sorted(frame.seed.unique())
    family, b = frame.family.iloc[0], int(frame.max_active.iloc[0])
    lines = [
        f"# FP8 KV serving ablation: {family.capitalize()} B{b}, held-out seeds",
        "",
        _provenance(meta),
        f"Seeds {', '.join(map(str, seeds))}; one trace per seed served from a 16-bit cache and from the same values "
        f"quantized to e4m3 ({meta.get('fp8_policy', '?')} scales), {int(frame.step.nunique())} decode steps each. "
        "Device ms/step = CUDA-graph replay of run() (no host time); wall includes prepare() and the host. Ratios "
        "are decode-token throughput over the faster FlashInfer variant of the same seed on the 16-bit cache "
        "(FI 16-bit) or on the FP8 cache (FI fp8); mean±sd over seeds.",
        "",
        "| cache | engine | device ms/step | wall ms/step | device over FI 16-bit | device over FI fp8 | "
        "wall over FI 16-bit | wall over FI fp8 |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (kv, engine), r in t.groupby(["kv_dtype", "engine"], sort=True):
        lines.append(f"| {'16-bit' if kv == 'auto' else 'fp8'} | {engine} | {mean_sd(r.graph_ms, '.3f')} | "
                     f"{mean_sd(r.wall_ms, '.3f')} | {mean_sd(r.graph_over_fi16)} | {mean_sd(r.graph_over_fi8)} | "
                     f"{mean_sd(r.wall_over_fi16)} | {mean_sd(r.wall_over_fi8)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pkv.report.fp8", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("kernels", "accuracy", "serving"))
    ap.add_argument("parquet", nargs="+", help="the Parquet file(s) (serving: one per held-out seed)")
    ap.add_argument("--table", required=True, help="Markdown file to write")
    args = ap.parse_args(argv)
    if args.kind != "serving" and len(args.parquet) > 1:
        raise ValueError(f"report_fp8 {args.kind}: one Parquet file, got {len(args.parquet)}")
    if args.kind == "kernels":
        frame, meta = io.read_parquet_checked(args.parquet[0], {"family", "point", "kv_dtype", "fp8_policy", "engine",
                                                                "graph_us"}, "FP8 kernel benchmark")
        text = kernels_table(frame, meta)
    elif args.kind == "accuracy":
        frame, meta = io.read_parquet_checked(args.parquet[0], {"data", "kv", "engine", "rel_rms", "error"},
                                              "FP8 accuracy")
        text = accuracy_table(frame, meta)
    else:
        parts = [io.read_parquet_checked(p, {"seed", "kv_dtype", "engine", "graph_s", "wall_s"}, "kv_fp8 ablation")
                 for p in args.parquet]
        commits = {m.get("git_commit") for _, m in parts}
        if len(commits) > 1:
            raise ValueError(f"kv_fp8 Parquets come from different commits {sorted(map(str, commits))}: "
                             "rerun them together")
        frame, meta = pd.concat([f for f, _ in parts], ignore_index=True), parts[0][1]
        text = serving_table(frame, meta)
    io.atomic_write_text(args.table, text)
    print(f"wrote {args.table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
