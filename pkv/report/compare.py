"""`pkv compare RUN_DIR`: a run's tables beside the committed reference run's, ratio
columns side by side (a ratio's denominator is FlashInfer in the same run, so ratios
compare across GPUs; absolute times do not)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
from tabulate import tabulate

from pkv.config.stages import EXTERNAL_REPLAYS, external_identity, external_scale, external_title
from pkv.report.load import MissingStage, Raw, check_folder, load
from pkv.report.tables import TABLES, Table, missing_note


def _side_by_side(table: Table, ref: pd.DataFrame, run: pd.DataFrame) -> pd.DataFrame:
    keys = [k for k in table.keys if k in ref.columns and k in run.columns]
    values = [c for c in ref.columns if c not in keys and c in run.columns]
    ratio_cols = [c for c in values if "ratio" in c.lower()]
    values = ratio_cols or values
    ref = ref.drop_duplicates(subset=keys).set_index(keys)[values]
    run = run.drop_duplicates(subset=keys).set_index(keys)[values]
    order = list(dict.fromkeys([*ref.index, *run.index]))
    both = pd.DataFrame(index=pd.Index(order) if len(keys) == 1 else pd.MultiIndex.from_tuples(order, names=keys))
    both.index.names = keys
    for c in values:
        both[f"{c} (reference)"] = ref[c].reindex(both.index).fillna("–")
        both[f"{c} (this run)"] = run[c].reindex(both.index).fillna("–")
    return both.reset_index()


def _run_line(raw: Raw) -> str:
    keys = ("gpu", "git_commit", "config_hash", "constants_hash", "torch", "flashinfer")
    return ", ".join(f"{k} {', '.join(sorted({m.get(k, 'unknown') for m in raw.metas})) or '–'}" for k in keys)


def compare(run: Path, reference: Path) -> str:
    """Markdown: every table of `run` beside the same table of `reference`, per table, the
    ratio columns side by side (every value column where a table has no ratio)."""
    check_folder(run)
    check_folder(reference)
    parts = [f"# {run} against the reference run {reference}\n",
             "Each table of this run beside the committed reference run's, row by row (ratio columns where the "
             "table has them, else every value column). A ratio's denominator is FlashInfer measured in the same "
             "run on the same GPU, so ratios compare across GPUs; absolute times do not.\n"]
    traces = {}   # each side's external section, where its config says
    try:
        cfg_ref = json.loads((reference / "config.json").read_text())
        cfg_run = json.loads((run / "config.json").read_text())
        from pkv.config.resolve import differences

        diff = differences(cfg_ref, cfg_run)
        parts.append("Configs: identical.\n" if not diff else f"**Configs differ** in: {', '.join(diff)}.\n")
        traces = {side: c.get("external", {}) for side, c in (("reference", cfg_ref), ("this run", cfg_run))}
    except (OSError, ValueError):
        parts.append("Configs: not compared (a folder has no config.json).\n")
    for name, table in TABLES.items():
        if table.build is None:   # a benchmark's own table: no row keys to join on
            continue
        if name in EXTERNAL_REPLAYS and traces:
            mine = traces["this run"]
            ours, theirs = (external_identity(traces[side])[0] for side in ("this run", "reference"))
            parts.append(f"## {external_title(mine, name) if external_scale(mine, name) else table.title}\n")
            if ours != theirs:   # two request files: no rows to pair
                parts.append(f"Not compared: this run replays the external trace {ours!r}, the reference run "
                             f"{theirs!r}.\n")
                continue
            scales = [external_scale(traces[side], name) for side in ("this run", "reference")]
            if None not in scales and scales[0] != scales[1]:   # one file, other lengths: no rows to pair
                parts.append(f"Not compared: this run scales the prompts by {scales[0]:g}, the reference run by "
                             f"{scales[1]:g}.\n")
                continue
        else:
            parts.append(f"## {table.title}\n")
        sides = {}
        for label, root in (("reference", reference), ("this run", run)):
            try:
                sides[label] = load(root, table.stages, table.required)
            except MissingStage:
                sides[label] = None
        if sides["reference"] is None or sides["this run"] is None:
            which = " and ".join(k for k, v in sides.items() if v is None)
            parts.append(f"Not measured in {which}.\n")
            continue
        frame = _side_by_side(table, table.build(sides["reference"]), table.build(sides["this run"]))
        parts.append(tabulate(frame, headers="keys", tablefmt="github", showindex=False, disable_numparse=True) + "\n")
        for label, raw in sides.items():
            note = missing_note(raw)
            parts.append(f"{label.capitalize()}: {_run_line(raw)}." + (f" {note}" if note else "") + "\n")
    return "\n".join(parts)
