"""Pipeline commands the Snakemake rules call: `pkv freeze-config`, `pkv calibrate`,
`pkv measure STAGE`, `pkv nsight`, `pkv report`, `pkv compare`. Each measuring command
reads the frozen config.json (checked) and constants.json (refused when frozen for another
config) and writes one Parquet file per job atomically, provenance included; a stage with a
`many` flag (pkv.config.stages) measures several jobs in one process (`--seed S1 S2 --out
F1 F2`), every job's flags checked before the first is measured. Each command imports
only what it uses: the report and the comparison never import torch.

Outputs are only ever regular files of the run's own folder, checked before any work: for a
command given --config, the folder of that frozen config.json (where `freeze-config` wrote
it); for `compare`, RUN_DIR. A directory, a device, a FIFO, a link or a path outside that
folder as --out (or --raw) is refused in one line.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

from pkv.cli.args import integer, seed
from pkv.config.jobs import check_job, flag_of
from pkv.config.resolve import (
    SMOKE_BANNER,
    ConfigError,
    check_config,
    check_constants,
    config_hash,
    load_config,
    load_schema,
    validate_config,
    write_config,
)
from pkv.config.stages import STAGES, by_command
from pkv.config.typed import Config
from pkv.core.io import atomic_write_text, check_inside, check_writable, file_hash, provenance, write_parquet


def add_commands(sub) -> None:
    fr = sub.add_parser("freeze-config", help="write the resolved experiment config every command reads")
    fr.add_argument("--json", required=True, help="the resolved config (profile applied) as JSON")
    fr.add_argument("--out", required=True, help="the frozen config.json to write; its folder is the run's folder, "
                    "where every other command's outputs must go (a regular file or a new name)")
    fr.set_defaults(func=freeze_config_cmd)

    bk = sub.add_parser("build-kernels", help="build every kernel the run loads, side by side (fresh machine's JIT)")
    bk.add_argument("--config", required=True, help="the frozen config.json")
    bk.add_argument("--out", required=True, help="the manifest (JSON) of what was built and how long it took, "
                    "inside the folder of --config")
    bk.set_defaults(func=build_kernels_cmd)

    cal = sub.add_parser("calibrate", help="fit and freeze the cost-model constants (calibration seed only)")
    _common(cal, constants=False)
    cal.add_argument("--raw", required=True, help="Parquet file for the calibration sweep's rows, inside the folder "
                     "of --config")
    cal.set_defaults(func=calibrate_cmd)

    meas = sub.add_parser("measure", help="run measurement jobs of a pipeline stage")
    msub = meas.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for stage in STAGES.values():   # the one table of stages
        if stage.command is None:   # measured by another command
            continue
        p = msub.add_parser(stage.command, help=stage.help)
        _common(p, many=bool(stage.many))
        for flag, kind in stage.flags:
            several = flag in stage.many
            p.add_argument(flag_of(flag), type=FLAG_TYPES[kind], required=True,
                           nargs="+" if several else None,
                           help=f"{FLAG_HELP.get(flag, flag.replace('_', ' '))}; several: one job each, one --out each"
                           if several else FLAG_HELP.get(flag))
    meas.set_defaults(func=measure_cmd)

    ns = sub.add_parser("nsight", help="capture the short B8 trace under Nsight Compute (ncu) to CSV")
    _common(ns)
    ns.set_defaults(func=nsight_cmd)

    rep = sub.add_parser("report", help="regenerate tables and figures from the Parquet under RESULTS_DIR")
    rep.add_argument("results_dir", nargs="?", help="default: the folder two levels above the --target files")
    rep.add_argument("--target", action="extend", nargs="+", default=[],
                     help="only these outputs (e.g. results/tables/serving.md results/tables/serving.tex); repeatable")
    rep.set_defaults(func=report_cmd)

    cmp = sub.add_parser("compare", help="a run's tables beside the committed reference run's (ratios side by side)")
    cmp.add_argument("run_dir", nargs="?", help="the run's results folder, e.g. results/runs/nvidia-h200-2026-11-30 "
                     "(default: the folder two levels above --out)")
    cmp.add_argument("--reference", default="results", help="the committed reference run's folder")
    cmp.add_argument("--out", help="Markdown file to write, inside RUN_DIR (default: RUN_DIR/tables/comparison.md)")
    cmp.set_defaults(func=compare_cmd)


def _common(p: argparse.ArgumentParser, constants: bool = True, many: bool = False) -> None:
    p.add_argument("--config", required=True, help="the frozen config.json of this run")
    if constants:
        p.add_argument("--constants", required=True, help="results/calibration/constants.json")
    where = "inside the folder of --config (the run's folder)"
    if many:
        p.add_argument("--out", required=True, nargs="+",
                       help=f"the file each job writes (atomically), in order, {where}")
    else:
        p.add_argument("--out", required=True, help=f"the file this job writes (atomically), {where}")


def check_outputs(args, *paths: tuple[str, str]) -> None:
    """Each (flag, path) is a regular file or a new name inside the run's folder: the folder
    of --config."""
    for flag, path in paths:
        check_inside(path, Path(args.config).parent, flag, "the run's folder (the folder of --config)")


# Checked types (pkv.cli.args) and help of the stage table's flag kinds (pkv.config.stages).
FLAG_TYPES = {"seed": seed, "positive": integer(1), "text": str, "path": str}
FLAG_HELP = {"family": "trace family of the operating point", "max_active": "continuous-batching limit B of the "
             "operating point", "trace": "the request file named in the config"}


def _announce(cfg: dict) -> None:
    if Config.of(cfg).profile == "smoke":
        print(f"*** {SMOKE_BANNER}: tiny shapes, CPU engines ***", file=sys.stderr)


def _meta(args, cfg: dict, extra: dict) -> dict:
    consts = getattr(args, "constants", None)
    return {**provenance(config_hash(cfg), file_hash(consts)), "profile": Config.of(cfg).profile, **extra}


def freeze_config_cmd(args) -> int:
    try:
        cfg = json.loads(args.json)
    except json.JSONDecodeError as e:
        raise ValueError(f"freeze-config: --json is not valid JSON ({e})") from None
    # What every command will refuse is never frozen: the schema (NaN too), the rules it
    # cannot say, and the typed view's keys.
    if not isinstance(cfg, dict):
        raise ValueError("freeze-config: --json is not a config (expected a JSON object)")
    validate_config(cfg, load_schema(), "freeze-config --json")
    typed = Config.from_dict(cfg, "freeze-config --json")   # first: a section's missing key, by name
    check_config(cfg, "freeze-config --json")
    check_writable(args.out)
    write_config(cfg, args.out)
    print(f"froze profile {typed.profile} (config hash {config_hash(cfg)}) to {args.out}", file=sys.stderr)
    return 0


def calibrate_cmd(args) -> int:
    from pkv.measure.calibrate import calibrate

    check_outputs(args, ("--out", args.out), ("--raw", args.raw))
    cfg = load_config(args.config)
    check_device(Config.from_dict(cfg, args.config))
    _announce(cfg)
    constants, frame = calibrate(cfg)
    constants["config_hash"] = config_hash(cfg)
    write_parquet(frame, args.raw, _meta(args, cfg, {"stage": "calibrate"}))
    atomic_write_text(args.out, json.dumps(constants, indent=2, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in constants.items() if k != "operating_points"}, sort_keys=True), file=sys.stderr)
    return 0




def check_args(cfg: dict, args) -> None:
    """Before anything is built: the job the flags name is one of this config's, on a seed
    its stage may use (the held-out discipline), and the profile's device is here."""
    Config.from_dict(cfg, args.config)   # every key known: a wrong one fails here, naming the file
    stage, row = by_command(args.stage)
    flags = [f for f, kind in row.flags if kind != "path"]   # the flags that name one job
    if flags:
        check_job(cfg, stage, **{f: getattr(args, f) for f in flags})
    check_device(cfg)


def check_device(cfg: dict) -> None:
    """A paper config measures on CUDA: refuse it in one line where torch sees no GPU."""
    from pkv.config.resolve import device_of

    if device_of(cfg) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"profile {Config.of(cfg).profile}: this config measures on a GPU, and torch sees none "
                              f"(CUDA build: {torch.version.cuda or 'none'}); run the smoke profile on this machine")


def jobs_of(args) -> list[argparse.Namespace]:
    """One namespace per job the command names: the --out files in order, each many flag's
    values paired with them (a flag given once holds for every job); refused unless one
    value or one per --out, and unless every job and every file is named once."""
    _, row = by_command(args.stage)
    if not row.many:
        return [args]
    outs = args.out
    columns = {}
    for name in row.many:
        values = getattr(args, name)
        if len(values) not in (1, len(outs)):
            raise ConfigError(f"measure {args.stage}: {len(values)} {flag_of(name)} value(s) and {len(outs)} --out "
                              f"file(s); give one --out per {flag_of(name)} value, in the same order")
        columns[name] = values * len(outs) if len(values) == 1 else values
    varying = [n for n in row.many if len(getattr(args, n)) > 1] or list(row.many)
    jobs = ["/".join(str(columns[n][i]) for n in varying) for i in range(len(outs))]
    for name, items in (("/".join(flag_of(n) for n in varying), jobs),
                        ("--out", [str(Path(o).resolve()) for o in outs])):
        repeated = sorted({str(v) for v in items if items.count(v) > 1})
        if repeated:
            raise ConfigError(f"measure {args.stage}: {name} names {', '.join(repeated)} more than once")
    return [argparse.Namespace(**{**vars(args), **{n: columns[n][i] for n in row.many}, "out": o})
            for i, o in enumerate(outs)]


def measure_cmd(args) -> int:
    cfg = load_config(args.config)
    constants = check_constants(cfg, args.constants)
    jobs = jobs_of(args)
    for job in jobs:        # every job's flags and file before any is measured
        check_args(cfg, job)
        check_outputs(job, ("--out", job.out))
    from pkv.plan.costmodel import Constants

    k = Constants.of(constants, args.constants)   # a constants file missing a key is refused before the banner
    _announce(cfg)
    _, row = by_command(args.stage)
    run = getattr(importlib.import_module(row.module), row.run)
    for job in jobs:
        kwargs = {f: (Path(getattr(job, f)) if kind == "path" else getattr(job, f)) for f, kind in row.flags}
        frame, meta = run(cfg, k, **dict(row.fixed), **kwargs)
        # The command that measures this one job alone (a stage may name its own instead).
        command = " ".join(["pkv measure", row.command, *(f"{flag_of(f)} {getattr(job, f)}" for f, _ in row.flags)])
        write_parquet(frame, job.out, _meta(job, cfg, {"stage": frame["stage"].iloc[0], "command": command, **meta}))
        print(f"wrote {job.out}", file=sys.stderr)
    return 0


def build_kernels_cmd(args) -> int:
    from pkv.bench.kernels import suite_shapes
    from pkv.measure.warm import build_all, write_manifest

    check_outputs(args, ("--out", args.out))
    cfg = load_config(args.config)
    manifest = build_all(cfg, suite_shapes(run_suites(cfg)))
    write_manifest(manifest, cfg, args.out)
    print(f"built {len(manifest['built'])} kernel variants in {manifest['wall_s']:.1f} s: {args.out}", file=sys.stderr)
    return 0


def run_suites(cfg: dict) -> tuple[str, ...]:
    """The kernel sweep's suites a run measures: those of the kernel stages (pkv.config.stages) that
    the tables and figures of its `all` read, for its profile and config (pkv.report.spec)."""
    from pkv.report.spec import stages_in_all

    return tuple(dict.fromkeys(s for stage in stages_in_all(cfg["profile"], cfg) for s in STAGES[stage].suites))


def nsight_cmd(args) -> int:
    """Profile `pkv measure nsight-trace` under ncu; pkv.measure.nsight parses its CSV."""
    ncu = shutil.which("ncu")
    if ncu is None:
        raise OSError("nsight: `ncu` (Nsight Compute) is not on PATH; install it, or set `nsight: false` "
                      "in config.yaml (or pass --config nsight=False) to run `all` without the Nsight stage")
    check_outputs(args, ("--out", args.out))
    cfg = load_config(args.config)
    check_constants(cfg, args.constants)
    c = Config.from_dict(cfg, args.config).nsight_capture
    out = Path(args.out)
    cmd = [ncu, "--clock-control", "none", "--kernel-name-base", "demangled", "--kernel-name", c.kernel_filter,
           "--metrics", ",".join(c.metrics), "--csv", "--log-file", str(out.with_suffix(".tmp.csv")),
           sys.executable, "-m", "pkv.cli", "measure", "nsight-trace", "--config", args.config,
           "--constants", args.constants, "--out", str(out.with_suffix(".run.parquet"))]
    print(" ".join(cmd), file=sys.stderr)
    done = subprocess.run(cmd)
    if done.returncode != 0:
        out.with_suffix(".tmp.csv").unlink(missing_ok=True)
        raise OSError(f"nsight: ncu exited with {done.returncode} (no counter access? see the log above); "
                      "set `nsight: false` to skip the stage")
    out.with_suffix(".tmp.csv").replace(out)
    return 0


def report_cmd(args) -> int:
    from pkv.report.tables import build_report

    targets = [Path(t) for t in args.target]
    roots = {t.parent.parent for t in targets}
    if args.results_dir is None and len(roots) != 1:
        raise ValueError("name RESULTS_DIR, or --target files of one results folder")
    root = Path(args.results_dir) if args.results_dir else roots.pop()

    skipped = []
    # Named targets must exist; the whole report of a partly measured folder skips the rest
    # (said after the report is written: a failed report prints only its one-line error).
    written = build_report(root, targets, on_missing=None if targets else lambda p, why: skipped.append((p, why)))
    for path in written:
        print(path)
    for path, why in skipped:
        # A table of gone inputs never outlives them: the one from an earlier report is removed.
        stale = path.exists()
        path.unlink(missing_ok=True)
        print(f"skipped {path}{' (removed the stale one)' if stale else ''}: {why}", file=sys.stderr)
    return 0


def compare_cmd(args) -> int:
    from pkv.report.compare import compare

    if args.run_dir is None and args.out is None:
        raise ValueError("compare: name RUN_DIR, or --out RUN_DIR/tables/comparison.md")
    run = Path(args.run_dir) if args.run_dir else Path(args.out).parent.parent
    out = Path(args.out) if args.out else run / "tables" / "comparison.md"
    check_inside(out, run, "--out", "RUN_DIR")
    text = compare(run, Path(args.reference))
    atomic_write_text(out, text)
    print(out)
    return 0
