"""The lines around a stage table: an external trace's title and caption, what ran (engines, the
router's routes), missing seeds, and the provenance of its Parquet files."""

from __future__ import annotations

import json

from pkv.engines import table
from pkv.report.load import Raw, ReportError

PROVENANCE = ("gpu", "torch", "flashinfer", "cuda", "config_hash", "constants_hash", "git_commit")


def provenance_of(metas: list[dict]) -> str:
    """The Source line's body: how many files, and each provenance key's values among them."""
    parts = [f"{len(metas)} Parquet file(s)"]
    for k in PROVENANCE:
        parts.append(f"{k}: {', '.join(sorted({m.get(k, 'unknown') for m in metas})) or '–'}")
    return "; ".join(parts)


def provenance_line(raw: Raw) -> str:
    return provenance_of(raw.metas)


def missing_note(raw: Raw) -> str:
    if not raw.missing_seeds:
        return ""
    parts = [f"{label} lacks seed(s) {', '.join(map(str, seeds))}" for label, seeds in raw.missing_seeds.items()]
    return "**Missing seeds** (means are over fewer seeds than the config's held-out seeds): " + "; ".join(parts) + "."


def ran_line(raw: Raw) -> str:
    """What ran: the engines of the table's rows and, where a router ran, the routes it took
    (share of its steps), so a reader sees which kernels a ratio compares."""
    f = raw.frame
    if "engine" not in f or f.empty:
        return ""
    engines = sorted(set(f["engine"].astype(str)))
    line = f"Engines: {', '.join(engines)}."
    routers = [e for e in engines if table.is_router(e)]
    if routers and "route" in f:
        share = f.loc[f["engine"].isin(routers), "route"].astype(str).value_counts(normalize=True)
        shown = [f"{route} {frac:.0%}" for route, frac in share.head(6).items()]
        more = f" and {len(share) - 6} more" if len(share) > 6 else ""
        line += f" Routes the router took (share of its steps): {', '.join(shown)}{more}."
    return line + "\n\n"


def trace_heading(raw: Raw, caption: str) -> tuple[str, str] | None:
    """(title, caption) of an external trace's replay, from its Parquet (trace_name, trace_title,
    trace_format: pkv.measure.stages.external); None for a file from before traces were named."""
    named = [m for m in raw.metas if "trace_title" in m]
    titles = sorted({m["trace_title"] for m in named})
    if len(titles) > 1:
        raise ReportError(f"the external stage's files name several traces ({'; '.join(titles)}); one run, one trace")
    if not titles:
        return None
    m = named[0]
    scale = json.loads(m.get("trace_meta", "{}")).get("transform", {}).get("prompt_scale")
    recorded = ", prompts as recorded" if scale == 1 else ""
    return titles[0], f"Trace {m['trace_name']} ({m['trace_format']} request file{recorded}). {caption}"
