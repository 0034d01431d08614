"""Nsight Compute CSV -> one row per kernel invocation with named, unit-bearing columns.

`ncu --csv --metrics ...` prints one line per (invocation, metric): the "Metric Name",
"Metric Unit" and "Metric Value" columns, numbers with thousands separators, and its own
"==PROF==" / "==WARNING==" lines around them. Parsing pivots that into columns such as
`time_us` and `dram_read_gbps`, converting each value by the unit ncu printed.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pandas as pd

ID_COLUMNS = {"ID": "invocation", "Kernel Name": "kernel_name", "Grid Size": "grid", "Block Size": "block"}
METRIC_COLUMNS = {
    "gpu__time_duration.sum": ("time_us", "time"),
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": ("sm_throughput_pct", "pct"),
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed": ("mem_throughput_pct", "pct"),
    "dram__bytes_read.sum.per_second": ("dram_read_gbps", "rate"),
    "dram__bytes_read.sum": ("dram_read_mb", "bytes"),
    "lts__t_sector_hit_rate.pct": ("l2_hit_pct", "pct"),
}
# Factors into the column's unit: microseconds, GB/s, MB, percent.
UNITS = {
    "time": {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
             "s": 1e6, "second": 1e6},
    "rate": {f"{p}byte/{s}": f * 1e-9 for p, f in (("", 1), ("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))
             for s in ("s", "second")},
    "bytes": {f"{p}byte": f * 1e-6 for p, f in (("", 1), ("K", 1e3), ("M", 1e6), ("G", 1e9), ("T", 1e12))},
    "pct": {"%": 1.0},
}
# Table rows: which kernels are which, first match wins.
ROLES = (
    (r"flashinfer::BatchDecodeWithPagedKVCache", "FlashInfer decode (CUDA cores)"),
    (r"flashinfer::BatchPrefillWithPagedKVCache", "FlashInfer decode (tensor cores)"),
    (r"flashinfer::.*MergeStates", "FlashInfer merge"),
    (r"flashinfer::.*Persistent", "FlashInfer persistent attention"),
    (r"kernel_mha", "FlashInfer decode (XQA)"),      # TensorRT-LLM's XQA kernel (flashinfer-xqa), no namespace
    (r"pkv::.*graph_decode_kernel", "PersistentKV graph decode (pkv-graph)"),
    (r"pkv::.*decode_kernel", "PersistentKV decode"),
    (r"pkv::.*merge_kernel", "PersistentKV merge"),
)


class NcuCsvError(ValueError):
    """An ncu CSV this parser cannot read; the message says why."""


def kernel_role(name: str) -> str:
    for pattern, role in ROLES:
        if re.search(pattern, name):
            return role
    return re.sub(r"<.*", "", name.removeprefix("void ")).strip()


def _column_name(metric: str, unit: str) -> str:
    """A metric this module does not name keeps its own name, with its unit appended."""
    return "_".join(filter(None, (re.sub(r"\W+", "_", metric), re.sub(r"\W+", "", unit))))


def _number(raw: str) -> float:
    return float(raw.replace(",", "")) if raw.strip() not in ("", "n/a") else float("nan")


def parse_ncu_csv(path: str | Path) -> pd.DataFrame:
    path = Path(path)
    lines = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("==")]
    if not lines:
        raise NcuCsvError(f"{path}: no CSV rows (did ncu capture any kernel that matched its filter?)")
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    need = {*ID_COLUMNS, "Metric Name", "Metric Unit", "Metric Value"}
    missing = need - set(reader.fieldnames or [])
    if missing:
        raise NcuCsvError(f"{path}: not an `ncu --csv --metrics` capture; "
                          f"missing column(s) {', '.join(sorted(missing))}")
    rows: dict[str, dict] = {}
    for n, rec in enumerate(reader, start=2):
        row = rows.setdefault(rec["ID"], {v: rec[k] for k, v in ID_COLUMNS.items()})
        name, unit = rec["Metric Name"], rec["Metric Unit"]
        column, kind = METRIC_COLUMNS.get(name, (_column_name(name, unit), None))
        factor = 1.0 if kind is None else UNITS[kind].get(unit)
        if factor is None:
            raise NcuCsvError(f"{path}:row {n}: unit {unit!r} of {name} is not one of {sorted(UNITS[kind])}")
        row[column] = _number(rec["Metric Value"]) * factor
    frame = pd.DataFrame(list(rows.values()))
    frame["invocation"] = frame["invocation"].astype(int)
    frame.insert(1, "kernel", frame["kernel_name"].map(kernel_role))
    return frame.sort_values("invocation", ignore_index=True)


def table5(frame: pd.DataFrame, roofline_gbps: float) -> pd.DataFrame:
    """Table 5's layout, per kernel role: means over invocations, plus DRAM read bandwidth
    as a fraction of the measured read roofline."""
    g = frame.groupby("kernel", sort=True)
    out = pd.DataFrame({
        "Invocations": g.size(),
        "Time ms": g["time_us"].mean() / 1e3,
        "SM thr. %": g["sm_throughput_pct"].mean(),
        "Mem. thr. %": g["mem_throughput_pct"].mean(),
        "DRAM GB/s": g["dram_read_gbps"].mean(),
        "DRAM / roofline": g["dram_read_gbps"].mean() / roofline_gbps,
        "L2 hit %": g["l2_hit_pct"].mean(),
    })
    return out.reset_index().rename(columns={"kernel": "Kernel"})


def add_commands(sub) -> None:
    p = sub.add_parser("nsight-parse", help="parse an ncu CSV capture into per-invocation Parquet (Table 5)")
    p.add_argument("--csv", required=True, help="the capture (`pkv nsight` output)")
    p.add_argument("--run", required=True,
                   help="the Parquet of the profiled trace run; its provenance is the capture's")
    p.add_argument("--constants", required=True, help="calibration constants: beta is the read roofline")
    p.add_argument("--out", required=True)
    p.set_defaults(func=parse_cmd)


def parse_cmd(args) -> int:
    import json

    from pkv.core.io import file_hash, read_meta, write_parquet

    constants = json.loads(Path(args.constants).read_text())
    run_config = read_meta(args.run).get("config_hash", "none")
    if constants.get("config_hash", "none") != run_config:
        raise ValueError(f"{args.constants}: frozen for config hash {constants.get('config_hash', 'none')}, but the "
                         f"profiled run {args.run} ran config {run_config}")
    frame = parse_ncu_csv(args.csv)
    beta = constants["beta_bytes_per_s"]
    frame["roofline_gbps"] = beta / 1e9
    # The counters were read where the trace ran: keep that run's provenance (GPU, versions).
    meta = {**read_meta(args.run), "stage": "nsight_kernels", "roofline_gbps": f"{beta / 1e9:.1f}",
            "constants_hash": file_hash(args.constants), "source_csv": Path(args.csv).name}
    write_parquet(frame, args.out, meta)
    return 0
