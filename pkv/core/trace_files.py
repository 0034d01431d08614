"""Request files: the loader of CSV, JSON (a list, or {"requests": [...]}) and JSONL
traces, UTF-8, native or Azure schema, into a pkv.core.traces.Trace.

The request file's own limits are its trace's (pkv.core.traces: MAX_LEN, MAX_REQUESTS,
MAX_ARRIVAL_STEP) and MAX_JSON_DEPTH below. A value is an
integer only as its text is one ("12", not "12.0", "1e3", "1_000" or true), in CSV and
JSON alike. A column (CSV header) or key (JSON object) given twice is refused. Every
error names the file, the line (CSV, JSONL; the item for JSON) and the field.

Azure timestamps: rows need not be in time order. A request's arrival step is
floor((TIMESTAMP - earliest TIMESTAMP) / step_ms), so the earliest request arrives at
step 0 wherever it is in the file; requests that arrive at the same step are admitted
in file order (continuous batching sorts by arrival step, stably).
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Iterable

import numpy as np

from pkv.core.traces import MAX_ARRIVAL_STEP, MAX_LEN, MAX_REQUESTS, Trace, Transform, _trace, apply_transform

NATIVE_COLUMNS = ("prompt_len", "decode_len")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
INTEGER = re.compile(r"[+-]?[0-9]+")   # the whole text (fullmatch): "1\n00" is not 100
# An Azure TIMESTAMP: date, optional time, no timezone (an offset would be converted
# silently, and rows in several zones mixed).
TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}([ T][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?)?")
MAX_JSON_DEPTH = 64         # nesting of a request file's JSON (a request object is depth 2 or 3)


class TraceFileError(ValueError):
    """A request file that cannot be read; the message names file, line and field."""


class _JsonNumber(str):
    """A JSON number that is not an integer token (100.0, 1e3, 2.5), kept as its text."""


def _int_field(path: Path, where: str, name: str, raw) -> int:
    """An integer by the one rule of CSV and JSON alike: its text is [+-]digits."""
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        raise TraceFileError(f"{path}:{where}: field '{name}' is missing a value")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = raw.strip() if isinstance(raw, str) and not isinstance(raw, _JsonNumber) else None
    if text is None or not INTEGER.fullmatch(text):
        shown = str(raw) if isinstance(raw, _JsonNumber) else repr(raw)
        raise TraceFileError(f"{path}:{where}: field '{name}' must be an integer, got {shown}")
    return int(text)


def _positive(path: Path, where: str, name: str, raw) -> int:
    value = _int_field(path, where, name, raw)
    if value <= 0:
        raise TraceFileError(f"{path}:{where}: field '{name}' must be positive, got {value}")
    if value > MAX_LEN:
        raise TraceFileError(f"{path}:{where}: field '{name}' is {value}, above the maximum of {MAX_LEN} tokens "
                             "a request may have (pkv.core.traces.MAX_LEN)")
    return value


def _timestamp_ns(path: Path, where: str, raw) -> int:
    text = str(raw).strip()
    if not TIMESTAMP.fullmatch(text):
        zone = " with a timezone (give every time in one zone, without an offset)" \
            if re.search(r"(Z|[+-][0-9]{2}:?[0-9]{2})$", text) else ""
        raise TraceFileError(f"{path}:{where}: field 'TIMESTAMP' is not a timestamp YYYY-MM-DD[ HH:MM[:SS[.f]]]"
                             f"{zone}: {raw!r}")
    try:
        return int(np.datetime64(text.replace(" ", "T"), "ns").astype(np.int64))
    except (ValueError, OverflowError):
        raise TraceFileError(f"{path}:{where}: field 'TIMESTAMP' is not a timestamp: {raw!r}") from None


def _records(path: Path) -> tuple[list[str], Iterable[tuple[str, dict]]]:
    """(column names, (location, record) pairs) of a CSV, JSON or JSONL file."""
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".json", ".jsonl"):
        raise TraceFileError(f"{path}: unknown extension {path.suffix!r}; use .csv, .json or .jsonl")
    text = _read_text(path)
    if not text.strip():
        raise TraceFileError(f"{path}: the file is empty")
    if suffix == ".csv":
        # newline="": a quoted field keeps its line breaks ("1\n00" is not read as 100).
        reader = csv.DictReader(io.StringIO(text, newline=""))
        columns = [c.strip() for c in _csv_step(path, reader, lambda: reader.fieldnames) or []]
        seen = set()
        for c in columns:
            if c in seen:
                raise TraceFileError(f"{path}:line 1: column '{c}' appears twice in the header")
            seen.add(c)
        reader.fieldnames = columns
        rows = []
        for row in iter(lambda: _csv_step(path, reader, lambda: next(reader, None)), None):
            if None in row:
                raise TraceFileError(f"{path}:line {reader.line_num}: more values than the header's {len(columns)} columns")
            rows.append((f"line {reader.line_num}", row))
        return columns, rows
    if suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                rows.append((f"line {n}", _json_object(path, f"line {n}", line)))
    elif suffix == ".json":
        try:
            doc = _json_loads(text)
        except json.JSONDecodeError as e:
            raise TraceFileError(f"{path}:line {e.lineno}: not valid JSON ({e.msg})") from None
        except _DuplicateKey as e:
            raise TraceFileError(f"{path}: key '{e.args[0]}' appears twice in one object") from None
        except (_TooDeep, RecursionError):
            raise TraceFileError(f"{path}: JSON nested deeper than {MAX_JSON_DEPTH} levels (pkv.core.trace_files."
                                 "MAX_JSON_DEPTH); a request file is a list of flat objects") from None
        items = doc.get("requests") if isinstance(doc, dict) else doc
        if not isinstance(items, list):
            raise TraceFileError(f"{path}: expected a list of requests or an object with a 'requests' list")
        rows = [(f"item {n}", _as_object(path, f"item {n}", r)) for n, r in enumerate(items)]
    columns = sorted({k for _, r in rows for k in r})
    return columns, rows


def _csv_step(path: Path, reader: csv.DictReader, step):
    """One step of the CSV reader, its errors (a field above csv's size limit, a stray
    quote) named by file and line."""
    try:
        return step()
    except csv.Error as e:
        # line_num counts the lines read before the one that failed.
        raise TraceFileError(f"{path}:line {reader.line_num + 1}: not valid CSV ({e})") from None


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise TraceFileError(f"{path}:line {line}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             "save the file as UTF-8") from None


class _DuplicateKey(Exception):
    pass


def _unique_object(pairs: list[tuple[str, object]]) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _json_loads(text: str):
    doc = json.loads(text, object_pairs_hook=_unique_object, parse_float=_JsonNumber, parse_constant=_JsonNumber)
    if _depth(doc) > MAX_JSON_DEPTH:
        raise _TooDeep()
    return doc


class _TooDeep(Exception):
    pass


def _depth(value, level: int = 1) -> int:
    """Nesting depth of a parsed JSON value, stopping once it passes MAX_JSON_DEPTH."""
    if level > MAX_JSON_DEPTH or not isinstance(value, (dict, list)):
        return level
    subs = value.values() if isinstance(value, dict) else value
    return max((_depth(v, level + 1) for v in subs), default=level)


def _json_object(path: Path, where: str, line: str) -> dict:
    try:
        return _as_object(path, where, _json_loads(line))
    except json.JSONDecodeError as e:
        raise TraceFileError(f"{path}:{where}: not valid JSON ({e.msg})") from None
    except _DuplicateKey as e:
        raise TraceFileError(f"{path}:{where}: key '{e.args[0]}' appears twice in one object") from None
    except (_TooDeep, RecursionError):
        raise TraceFileError(f"{path}:{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                             "(pkv.core.trace_files.MAX_JSON_DEPTH); a request is a flat object") from None


def _as_object(path: Path, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise TraceFileError(f"{path}:{where}: expected an object with request fields, got {type(value).__name__}")
    return value


def load_trace(path: str | Path, step_ms: float = 100.0, transform: Transform | None = None) -> Trace:
    """Read a request file: native columns (prompt_len, decode_len[, arrival_step]) or the
    Azure LLM inference schema (TIMESTAMP, ContextTokens, GeneratedTokens), where
    arrival_step = floor((TIMESTAMP - first TIMESTAMP) / step_ms)."""
    path = Path(path)
    if path.is_dir():
        raise TraceFileError(f"{path}: is a directory, not a request file")
    if not path.exists():
        raise TraceFileError(f"{path}: no such file")
    if not path.is_file():
        raise TraceFileError(f"{path}: not a regular file")
    if not 0 < step_ms < math.inf:   # NaN fails too
        raise ValueError(f"step_ms must be a finite number > 0, got {step_ms}")
    columns, rows = _records(path)
    if all(c in columns for c in NATIVE_COLUMNS):
        schema = "native"
    elif all(c in columns for c in AZURE_COLUMNS):
        schema = "azure"
    else:
        want = NATIVE_COLUMNS if not any(c in columns for c in AZURE_COLUMNS) else AZURE_COLUMNS
        missing = [c for c in want if c not in columns]
        raise TraceFileError(f"{path}:line 1: missing column(s) {', '.join(missing)} (found: {', '.join(columns) or 'none'})")
    if not rows:
        raise TraceFileError(f"{path}: the file has a header but no requests")
    arrival, prompt, decode = [], [], []
    for where, r in rows:
        if schema == "native":
            prompt.append(_positive(path, where, "prompt_len", r.get("prompt_len")))
            decode.append(_positive(path, where, "decode_len", r.get("decode_len")))
            a = r.get("arrival_step")
            a = 0 if a is None or a == "" else _int_field(path, where, "arrival_step", a)
            if a < 0:
                raise TraceFileError(f"{path}:{where}: field 'arrival_step' must be >= 0, got {a}")
            if a > MAX_ARRIVAL_STEP:
                raise TraceFileError(f"{path}:{where}: field 'arrival_step' is {a}, above the maximum "
                                     f"{MAX_ARRIVAL_STEP} (pkv.core.traces.MAX_ARRIVAL_STEP)")
            arrival.append(a)
        else:
            arrival.append(_timestamp_ns(path, where, r.get("TIMESTAMP")))
            prompt.append(_positive(path, where, "ContextTokens", r.get("ContextTokens")))
            decode.append(_positive(path, where, "GeneratedTokens", r.get("GeneratedTokens")))
        if prompt[-1] + decode[-1] > MAX_LEN:
            names = "prompt_len + decode_len" if schema == "native" else "ContextTokens + GeneratedTokens"
            raise TraceFileError(f"{path}:{where}: {names} = {prompt[-1] + decode[-1]} tokens, above the maximum "
                                 f"of {MAX_LEN} (pkv.core.traces.MAX_LEN)")
    if len(rows) > MAX_REQUESTS:
        raise TraceFileError(f"{path}: {len(rows)} requests, above the maximum of {MAX_REQUESTS} "
                             "(pkv.core.traces.MAX_REQUESTS); split the file or cut it with --max-requests after loading")
    arrival = np.asarray(arrival, dtype=np.int64)
    meta = {"source": "file", "path": str(path), "schema": schema, "requests_in_file": len(rows)}
    if schema == "azure":
        # Unsorted rows are fine: steps count from the earliest timestamp (module docstring).
        arrival = (arrival - arrival.min()) // int(step_ms * 1e6)
        if arrival.max() > MAX_ARRIVAL_STEP:
            raise TraceFileError(f"{path}: the timestamps span {int(arrival.max())} steps of {step_ms} ms, above the "
                                 f"maximum of {MAX_ARRIVAL_STEP} (pkv.core.traces.MAX_ARRIVAL_STEP); use a longer --step-ms")
        meta["step_ms"] = step_ms
    trace = _trace(path.stem, arrival, prompt, decode, meta)
    return apply_transform(trace, transform) if transform else trace
