"""Request files: the loader of CSV, JSON (a list, or {"requests": [...]}) and JSONL
traces, UTF-8, into a pkv.core.traces.Trace.

Formats (FORMATS, detected from the header or keys, first match wins): native
(prompt_len, decode_len[, arrival_step]), Azure LLM inference (TIMESTAMP date strings,
ContextTokens, GeneratedTokens), Mooncake (timestamp in ms, input_length, output_length;
hash_ids ignored) and BurstGPT (Timestamp in s, Request tokens, Response tokens; a row of
0 response tokens is one of the log's failed requests: skipped and counted in
meta["skipped_failed"]). Any other layout is read through a column mapping
(`columns()`, `pkv trace show --columns prompt=NAME,decode=NAME[,time=NAME:s|ms]`, the
config's external.columns). A numeric time is seconds or milliseconds, as the format or
the mapping says, and never read as a date.

The request file's own limits are its trace's (pkv.core.traces: MAX_LEN, MAX_REQUESTS,
MAX_ARRIVAL_STEP), MAX_JSON_DEPTH and MAX_DIGITS (pkv.core.json_strict) and MAX_STEP_MS
below. Rows are read one at a time (CSV, JSONL) and reading stops at the first request past
MAX_REQUESTS, so a file of millions of rows is refused in the time of reading the limit's
worth. A value is an
integer only as its text is one ("12", not "12.0", "1e3", "1_000" or true), in CSV and
JSON alike. A column (CSV header) or key (JSON object) given twice is refused. Every
error names the file, the line (CSV, JSONL; the item for JSON) and the field.

Timestamps (every format but native): rows need not be in time order. A request's
arrival step is floor((time - earliest time) / step_ms), so the earliest request arrives
at step 0 wherever it is in the file; requests that arrive at the same step are admitted
in file order (continuous batching sorts by arrival step, stably).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import re
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Iterable

import numpy as np

from pkv.core.json_strict import (
    MAX_DIGITS,
    MAX_JSON_DEPTH,
    DuplicateKey,
    JsonLongInt,
    JsonNumber,
    TooDeep,
    strict_loads,
)
from pkv.core.traces import MAX_ARRIVAL_STEP, MAX_LEN, MAX_REQUESTS, Trace, Transform, _trace, apply_transform


@dataclass(frozen=True)
class Format:
    """One request-file layout: the columns (CSV header names, JSON keys) of the prompt
    and decode lengths and of the arrival time, and the time's unit."""

    name: str                 # recorded as the trace's meta["schema"]
    prompt: str
    decode: str
    time: str | None = None   # None: every request arrives at step 0
    unit: str = "step"        # step (integer arrival steps), date (Azure TIMESTAMP), s, ms
    time_optional: bool = False      # native: a missing or empty arrival_step is step 0
    skip_zero_decode: bool = False   # BurstGPT logs a failed request as 0 response tokens

    @property
    def needed(self) -> tuple[str, ...]:
        return (self.prompt, self.decode) + ((self.time,) if self.time and not self.time_optional else ())


FORMATS = (
    Format("native", "prompt_len", "decode_len", "arrival_step", "step", time_optional=True),
    Format("azure", "ContextTokens", "GeneratedTokens", "TIMESTAMP", "date"),
    Format("mooncake", "input_length", "output_length", "timestamp", "ms"),
    Format("burstgpt", "Request tokens", "Response tokens", "Timestamp", "s", skip_zero_decode=True),
)
TIME_UNITS = {"s": 10**9, "ms": 10**6}   # nanoseconds per unit of a numeric time column
COLUMN_KEYS = ("prompt", "decode", "time")
MAPPING_HINT = "name the columns with --columns prompt=NAME,decode=NAME[,time=NAME:s|ms] (config: external.columns)"
INTEGER = re.compile(r"[+-]?[0-9]+")   # the whole text (fullmatch): "1\n00" is not 100
NUMBER = re.compile(r"[+-]?[0-9]{1,30}(\.[0-9]{1,9})?")   # a numeric time: digits, optional decimals, no exponent
# An Azure TIMESTAMP: date, optional time, no timezone (an offset would be converted
# silently, and rows in several zones mixed).
TIMESTAMP = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}([ T][0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,9})?)?)?")
MAX_STEP_MS = 86_400_000.0  # a step of at most a day: step_ms * 1e6 ns stays a finite float


class TraceFileError(ValueError):
    """A request file that cannot be read; the message names file, line and field."""


def _shown(raw) -> str:
    """A field's value for a message, at most 40 characters of it."""
    text = str(raw) if isinstance(raw, (JsonNumber, JsonLongInt)) else repr(raw)
    return text if len(text) <= 40 else f"{text[:20]}...{text[-8:]} ({len(text)} characters)"


def _int_field(path: Path, where: str, name: str, raw) -> int:
    """An integer by the one rule of CSV and JSON alike: its text is [+-]digits."""
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        raise TraceFileError(f"{path}:{where}: field '{name}' is missing a value")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    text = raw.strip() if isinstance(raw, str) and not isinstance(raw, JsonNumber) else None
    if text is None or not INTEGER.fullmatch(text):
        raise TraceFileError(f"{path}:{where}: field '{name}' must be an integer, got {_shown(raw)}")
    digits = len(text.lstrip("+-").lstrip("0"))
    if digits > MAX_DIGITS:
        raise TraceFileError(f"{path}:{where}: field '{name}' is an integer of {digits} digits, above any limit "
                             f"(at most {MAX_DIGITS} digits are read)")
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
        hint = " with a timezone (give every time in one zone, without an offset)" \
            if re.search(r"(Z|[+-][0-9]{2}:?[0-9]{2})$", text) else ""
        if isinstance(raw, int) or NUMBER.fullmatch(text):   # a number in a column named TIMESTAMP
            hint = " (a number: read a numeric time with --columns ...,time=TIMESTAMP:s|ms)"
        raise TraceFileError(f"{path}:{where}: field 'TIMESTAMP' is not a timestamp YYYY-MM-DD[ HH:MM[:SS[.f]]]"
                             f"{hint}: {_shown(raw)}")
    try:
        return int(np.datetime64(text.replace(" ", "T"), "ns").astype(np.int64))
    except (ValueError, OverflowError):
        raise TraceFileError(f"{path}:{where}: field 'TIMESTAMP' is not a timestamp: {raw!r}") from None


def _number_ns(path: Path, where: str, name: str, raw, unit: str) -> int:
    """A numeric time in `unit` (s, ms) as integer nanoseconds, exactly (no float rounding)."""
    if raw is None or (isinstance(raw, str) and raw.strip() == ""):
        raise TraceFileError(f"{path}:{where}: field '{name}' is missing a value")
    if isinstance(raw, int) and not isinstance(raw, bool):
        return raw * TIME_UNITS[unit]
    text = raw.strip() if isinstance(raw, str) else None
    if text is None or not NUMBER.fullmatch(text):
        raise TraceFileError(f"{path}:{where}: field '{name}' must be a time in {unit} (digits, optional decimals; "
                             f"never a date), got {_shown(raw)}")
    return int(Decimal(text) * TIME_UNITS[unit])


def columns(prompt: str, decode: str, time: str | None = None, time_unit: str | None = None) -> Format:
    """The layout of a column mapping; `time` may carry its unit as NAME:s or NAME:ms
    (else `time_unit` gives it: a numeric time's unit is never guessed)."""
    for key, value in (("prompt", prompt), ("decode", decode), ("time", time)):
        if value is not None and not (isinstance(value, str) and value.strip()):
            raise ValueError(f"columns: {key} must name a column, got {value!r}")
    if time_unit is not None and time_unit not in TIME_UNITS:
        raise ValueError(f"columns: time unit must be s or ms, got {time_unit!r}")
    if time is None:
        if time_unit is not None:
            raise ValueError(f"columns: a time unit ({time_unit}) without a time column (time=NAME)")
        return Format("columns", prompt, decode)
    name, _, unit = time.rpartition(":")
    if name and unit in TIME_UNITS:
        if time_unit is not None and time_unit != unit:
            raise ValueError(f"columns: time={time} says {unit}, the time unit says {time_unit}")
    else:
        name, unit = time, time_unit
    if unit is None:
        raise ValueError(f"columns: time={time} needs its unit: time={time}:s or time={time}:ms "
                         "(or --time-unit / external.time_unit)")
    return Format("columns", prompt, decode, name, unit)


def parse_columns(text: str) -> dict[str, str]:
    """`prompt=NAME,decode=NAME[,time=NAME[:s|ms]]` as columns()' keyword arguments."""
    out: dict[str, str] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in COLUMN_KEYS:
            raise ValueError(f"columns: {part.strip()!r} is not KEY=COLUMN with KEY one of {', '.join(COLUMN_KEYS)}")
        if key in out:
            raise ValueError(f"columns: {key} given twice")
        out[key] = value.strip()
    missing = [k for k in ("prompt", "decode") if k not in out]
    if missing:
        raise ValueError(f"columns: missing {', '.join(missing)} (prompt=NAME,decode=NAME[,time=NAME:s|ms])")
    return out


def detect(path: Path, names: list[str]) -> Format:
    """The first format of FORMATS whose columns the file has; else one line naming what
    the nearest format lacks."""
    for f in FORMATS:
        if all(c in names for c in f.needed):
            return f
    nearest = max(FORMATS, key=lambda f: sum(c in names for c in f.needed))   # ties: the first (native)
    missing = [c for c in nearest.needed if c not in names]
    raise TraceFileError(f"{path}:line 1: missing column(s) {', '.join(missing)} "
                         f"(found: {', '.join(names) or 'none'}); "
                         f"formats: {', '.join(f.name for f in FORMATS)}, or {MAPPING_HINT}")


def _records(path: Path) -> tuple[list[str], Iterable[tuple[str, dict]]]:
    """(column names, (location, record) pairs) of a CSV, JSON or JSONL file. The pairs of a
    CSV or JSONL file are read as they are taken (the caller stops at its limit); a JSONL
    file's columns are its first record's keys."""
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

        def csv_rows():
            for row in iter(lambda: _csv_step(path, reader, lambda: next(reader, None)), None):
                if None in row:
                    raise TraceFileError(f"{path}:line {reader.line_num}: more values than the header's "
                                         f"{len(columns)} columns")
                yield f"line {reader.line_num}", row

        return columns, csv_rows()
    if suffix == ".jsonl":
        lines = ((n, line) for n, line in enumerate(io.StringIO(text, newline=None), start=1) if line.strip())
        rows = ((f"line {n}", _json_object(path, f"line {n}", line)) for n, line in lines)
        first = next(rows)   # the text has a non-blank line
        return sorted(first[1]), itertools.chain([first], rows)
    if suffix == ".json":
        doc = _parse_json(path, text)
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


def _parse_json(path: Path, text: str, where: str | None = None):
    """`text` parsed, its faults one TraceFileError naming the file and `where` (a JSONL
    line), or for a whole .json file the line the parser stopped at."""
    at = f"{path}:{where}" if where else str(path)
    try:
        return strict_loads(text)
    except json.JSONDecodeError as e:
        raise TraceFileError(f"{path}:{where or f'line {e.lineno}'}: not valid JSON ({e.msg})") from None
    except DuplicateKey as e:
        raise TraceFileError(f"{at}: key '{e.args[0]}' appears twice in one object") from None
    except (TooDeep, RecursionError):
        flat = "a request is a flat object" if where else "a request file is a list of flat objects"
        raise TraceFileError(f"{at}: JSON nested deeper than {MAX_JSON_DEPTH} levels "
                             f"(pkv.core.trace_files.MAX_JSON_DEPTH); {flat}") from None


def _json_object(path: Path, where: str, line: str) -> dict:
    return _as_object(path, where, _parse_json(path, line, where))


def _as_object(path: Path, where: str, value) -> dict:
    if not isinstance(value, dict):
        raise TraceFileError(f"{path}:{where}: expected an object with request fields, got {type(value).__name__}")
    return value


def load_trace(path: str | Path, step_ms: float = 100.0, transform: Transform | None = None,
               layout: Format | None = None) -> Trace:
    """Read a request file in the format its columns say (FORMATS), or by `layout` (a
    column mapping, `columns()`); a timed format's arrival_step is
    floor((time - earliest time) / step_ms)."""
    path = Path(path)
    if path.is_dir():
        raise TraceFileError(f"{path}: is a directory, not a request file")
    if not path.exists():
        raise TraceFileError(f"{path}: no such file")
    if not path.is_file():
        raise TraceFileError(f"{path}: not a regular file")
    if not 0 < step_ms <= MAX_STEP_MS:   # NaN fails too
        raise ValueError(f"step_ms must be a number in (0, {MAX_STEP_MS:.0f}] ms (a day; "
                         f"pkv.core.trace_files.MAX_STEP_MS), got {step_ms}")
    names, rows = _records(path)
    if layout is None:
        fmt = detect(path, names)
    else:
        fmt = layout
        missing = [c for c in fmt.needed if c not in names]
        if missing:
            raise TraceFileError(f"{path}:line 1: missing column(s) {', '.join(missing)} of the column mapping "
                                 f"(found: {', '.join(names) or 'none'})")
    arrival, prompt, decode = [], [], []
    skipped = read = 0
    for where, r in rows:
        read += 1
        if fmt.skip_zero_decode and _int_field(path, where, fmt.decode, r.get(fmt.decode)) == 0:
            skipped += 1
            continue
        if len(prompt) == MAX_REQUESTS:   # a request past the limit: stop reading here
            raise TraceFileError(f"{path}:{where}: more than {MAX_REQUESTS} requests (pkv.core.traces.MAX_REQUESTS), "
                                 "the most a trace holds; keep at most that many rows in the file (split it, or cut "
                                 "it with e.g. `head`): --max-requests applies only after loading")
        if fmt.time is None:
            arrival.append(0)
        elif fmt.unit == "step":
            a = r.get(fmt.time)
            a = 0 if a is None or a == "" else _int_field(path, where, fmt.time, a)
            if a < 0:
                raise TraceFileError(f"{path}:{where}: field '{fmt.time}' must be >= 0, got {a}")
            if a > MAX_ARRIVAL_STEP:
                raise TraceFileError(f"{path}:{where}: field '{fmt.time}' is {a}, above the maximum "
                                     f"{MAX_ARRIVAL_STEP} (pkv.core.traces.MAX_ARRIVAL_STEP)")
            arrival.append(a)
        elif fmt.unit == "date":
            arrival.append(_timestamp_ns(path, where, r.get(fmt.time)))
        else:
            arrival.append(_number_ns(path, where, fmt.time, r.get(fmt.time), fmt.unit))
        prompt.append(_positive(path, where, fmt.prompt, r.get(fmt.prompt)))
        decode.append(_positive(path, where, fmt.decode, r.get(fmt.decode)))
        if prompt[-1] + decode[-1] > MAX_LEN:
            raise TraceFileError(f"{path}:{where}: {fmt.prompt} + {fmt.decode} = {prompt[-1] + decode[-1]} tokens, "
                                 f"above the maximum of {MAX_LEN} (pkv.core.traces.MAX_LEN)")
    if not read:
        raise TraceFileError(f"{path}: the file has a header but no requests")
    if not prompt:
        raise TraceFileError(f"{path}: all {read} requests are failed ones ('{fmt.decode}' 0); nothing to replay")
    meta = {"source": "file", "path": str(path), "schema": fmt.name, "requests_in_file": read}
    if layout is not None:
        meta["columns"] = {"prompt": fmt.prompt, "decode": fmt.decode,
                           **({"time": fmt.time, "time_unit": fmt.unit} if fmt.time else {})}
    if fmt.skip_zero_decode:
        meta["skipped_failed"] = skipped
    if fmt.unit != "step":
        # Python ints: a span of numeric times may exceed int64 nanoseconds before it is refused.
        step_ns = max(1, int(step_ms * 1e6))
        first = min(arrival)
        steps = [(a - first) // step_ns for a in arrival]
        if max(steps) > MAX_ARRIVAL_STEP:
            raise TraceFileError(f"{path}: the timestamps span {max(steps)} steps of {step_ms} ms, above the "
                                 f"maximum of {MAX_ARRIVAL_STEP} (pkv.core.traces.MAX_ARRIVAL_STEP); "
                                 "use a longer --step-ms")
        arrival = steps
        meta["step_ms"] = step_ms
    trace = _trace(path.stem, np.asarray(arrival, dtype=np.int64), prompt, decode, meta)
    return apply_transform(trace, transform) if transform else trace
