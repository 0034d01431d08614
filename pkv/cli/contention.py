"""Do neighbours slow a job down? The same measuring command alone, then N copies at once,
one per GPU of this host's pool, and each measured time's ratio (docs/multigpu.md):

    python3 -m pkv.cli.contention --copies 8 --out /tmp/contention -- \\
        python3 -m pkv.cli bench host --config R/config.json --constants R/calibration/constants.json --out {out}

`{out}` in the command becomes DIR/alone.parquet, then DIR/copy-1.parquet ... DIR/copy-N.parquet.
The copies take their GPUs from the pool as a pipeline job does (pkv/cli/gpu_pool.py; the
pool is this host's GPUs, pkv.config.gpus, unless PKV_GPUS is set already), so with
PKV_PIN_CORES=on they also run on their slots' cores. Every copy must hold the rows the
lone run holds, in its order (the same command on the same config); the measured-time
columns (pkv.measure.loop and pkv.bench.host's MEASURED_TIMES) are compared row by row:
a row's ratio is the median over the copies of copy / alone. DIR/contention.md gets one
line per column: rows, median and largest ratio, and the row of the largest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from pkv.config.errors import ConfigError
from pkv.config.gpus import Pool, default_lock_dir, one_model, query, visible


def pool_env(environ) -> dict[str, str]:
    """PKV_GPUS and PKV_GPU_LOCKS: the caller's, else this host's GPUs (one model)."""
    if environ.get("PKV_GPUS"):
        return {"PKV_GPUS": environ["PKV_GPUS"], "PKV_GPU_LOCKS": environ.get("PKV_GPU_LOCKS", "")}
    gpus = visible(query(), environ.get("CUDA_VISIBLE_DEVICES"))
    if not gpus:
        raise ConfigError("this host shows no GPU (nvidia-smi); set PKV_GPUS and PKV_GPU_LOCKS for a pool of your own")
    one_model(gpus)
    return Pool(tuple(gpus), len(gpus), default_lock_dir()).env


def run(command: list[str], outs: list[Path], env: dict[str, str]) -> None:
    """`command` once per file of `outs`, all at once; each must exit 0 and write its file."""
    procs = [subprocess.Popen([a.replace("{out}", str(o)) for a in command], env=env) for o in outs]
    codes = [p.wait() for p in procs]
    for out, code in zip(outs, codes):
        if code != 0 or not out.is_file():
            why = f"exited with {code}" if code else "wrote no file"
            raise OSError(f"the run that writes {out} {why}")


def measured_columns(frame) -> list[str]:
    from pkv.bench.host import MEASURED_TIMES as HOST_TIMES
    from pkv.measure.loop import MEASURED_TIMES as LOOP_TIMES

    return [c for c in dict.fromkeys((*LOOP_TIMES, *HOST_TIMES)) if c in frame.columns]


def compare(alone_path: Path, copy_paths: list[Path], columns: list[str] | None = None) -> str:
    """The Markdown table of module docstring."""
    import pandas as pd

    alone = pd.read_parquet(alone_path)
    copies = [pd.read_parquet(p) for p in copy_paths]
    columns = columns or measured_columns(alone)
    keys = [c for c in alone.columns if c not in columns and not pd.api.types.is_float_dtype(alone[c])]
    for path, frame in zip(copy_paths, copies):
        if len(frame) != len(alone) or not frame[keys].astype(str).equals(alone[keys].astype(str)):
            raise ValueError(f"{path}: not the rows of {alone_path} (another command or config?)")
    lines = [f"Contention: {len(copies)} copies at once against one alone ({alone_path.parent})", "",
             "| column | rows | median ratio | largest ratio | row of the largest |", "| --- | --- | --- | --- | --- |"]
    for col in columns:
        ratio = pd.concat([c[col] / alone[col] for c in copies], axis=1).median(axis=1)
        ratio = ratio[alone[col].notna() & (alone[col] > 0)].dropna()
        if ratio.empty:
            continue
        worst = ratio.idxmax()
        row = ", ".join(f"{k}={alone.at[worst, k]}" for k in keys[:4])
        lines.append(f"| {col} | {len(ratio)} | {ratio.median():.3f} | {ratio.max():.3f} | {row} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m pkv.cli.contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--copies", type=int, default=8, help="copies at once (one per GPU)")
    p.add_argument("--out", required=True, type=Path, help="folder for the Parquet files and contention.md")
    p.add_argument("--columns", nargs="+", help="the columns to compare (default: the measured times present)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the measuring command, with {out}")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not any("{out}" in a for a in command):
        p.error("the command must name its output file as {out}")
    if args.copies < 1:
        p.error("--copies must be at least 1")
    try:
        env = {**os.environ, **pool_env(os.environ)}
        args.out.mkdir(parents=True, exist_ok=True)
        alone = args.out / "alone.parquet"
        copies = [args.out / f"copy-{i}.parquet" for i in range(1, args.copies + 1)]
        run(command, [alone], env)
        run(command, copies, env)
        table = compare(alone, copies, args.columns)
    except (ConfigError, OSError, ValueError) as e:
        print(f"contention: error: {e}", file=sys.stderr)
        return 2
    (args.out / "contention.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
