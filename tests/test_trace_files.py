"""Request files in the formats of real traces, the column mapping, and the external trace
as a named stage and a named run.

tests/data/mooncake_sample.jsonl and tests/data/burstgpt_sample.csv are synthetic rows
written for these tests in the two traces' column layouts (no real data): 32 Mooncake
requests (timestamp in ms, hash_ids) and 32 BurstGPT rows (Timestamp in s), two of them
failed (0 response tokens).
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from pkv.config.jobs import stage_files
from pkv.config.resolve import ConfigError, config_hash, effective, load_schema, validate_config
from pkv.config.stages import EXTERNAL_NAME, EXTERNAL_TITLE, STAGES, external_identity
from pkv.config.typed import Config
from pkv.core.io import read_meta
from pkv.core.trace_files import FORMATS, TraceFileError, columns, load_trace, parse_columns
from pkv.measure.stages import external_trace
from worktree import REPO, copy_worktree

DATA = REPO / "tests" / "data"
MOONCAKE = DATA / "mooncake_sample.jsonl"
BURSTGPT = DATA / "burstgpt_sample.csv"
RAW = yaml.safe_load((REPO / "config.yaml").read_text())


def mooncake_rows() -> list[dict]:
    return [json.loads(line) for line in MOONCAKE.read_text().splitlines()]


def burstgpt_rows() -> list[dict]:
    with BURSTGPT.open(newline="") as f:
        return list(csv.DictReader(f))


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def refused(path: Path, needle: str, **kw) -> str:
    with pytest.raises(TraceFileError) as e:
        load_trace(path, **kw)
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "\n" not in msg, msg
    return msg


# ---------------------------------------------------------------- the formats, detected


def test_mooncake_jsonl_is_detected_and_its_timestamps_are_milliseconds():
    rows = mooncake_rows()
    t = load_trace(MOONCAKE, step_ms=100)
    assert t.meta["schema"] == "mooncake" and t.meta["step_ms"] == 100 and len(t) == len(rows) == 32
    assert t.prompt_len.tolist() == [r["input_length"] for r in rows]
    assert t.decode_len.tolist() == [r["output_length"] for r in rows]
    first = min(r["timestamp"] for r in rows)
    assert t.arrival_step.tolist() == [(r["timestamp"] - first) // 100 for r in rows]
    assert t.arrival_step.max() > 0   # the sample spans several steps


def test_burstgpt_csv_is_detected_seconds_and_failed_requests_skipped():
    rows = burstgpt_rows()
    ok = [r for r in rows if r["Response tokens"] != "0"]
    t = load_trace(BURSTGPT, step_ms=1000)
    assert t.meta["schema"] == "burstgpt" and t.meta["requests_in_file"] == 32
    assert t.meta["skipped_failed"] == 2 and len(t) == len(ok) == 30
    assert t.prompt_len.tolist() == [int(r["Request tokens"]) for r in ok]
    assert t.decode_len.tolist() == [int(r["Response tokens"]) for r in ok]
    first = min(int(r["Timestamp"]) for r in ok)
    assert t.arrival_step.tolist() == [int(r["Timestamp"]) - first for r in ok]   # 1 s steps


def test_one_format_table_each_format_named_by_its_columns():
    assert [f.name for f in FORMATS] == ["native", "azure", "mooncake", "burstgpt"]
    assert {f.unit for f in FORMATS} == {"step", "date", "ms", "s"}


def test_fractional_numeric_times_are_exact(tmp_path):
    p = write(tmp_path, "t.jsonl", '{"timestamp": 0.5, "input_length": 4, "output_length": 2}\n'
                                   '{"timestamp": 299.9, "input_length": 4, "output_length": 2}\n'
                                   '{"timestamp": 300, "input_length": 4, "output_length": 2}\n')
    assert load_trace(p, step_ms=100).arrival_step.tolist() == [0, 2, 2]


@pytest.mark.parametrize("name, text, needle", [
    ("m.jsonl", '{"timestamp": 0, "input_length": 4}\n', "line 1: missing column(s) output_length"),
    ("m.jsonl", '{"timestamp": "2023-11-16", "input_length": 4, "output_length": 2}\n',
     "line 1: field 'timestamp' must be a time in ms (digits, optional decimals; never a date), got '2023-11-16'"),
    ("m.jsonl", '{"timestamp": 1e3, "input_length": 4, "output_length": 2}\n',
     "field 'timestamp' must be a time in ms"),
    ("m.jsonl", '{"timestamp": true, "input_length": 4, "output_length": 2}\n', "field 'timestamp' must be a time"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 4, "output_length": 2}\n{"timestamp": 5, "input_length": 4.5, '
     '"output_length": 2}\n', "line 2: field 'input_length' must be an integer, got 4.5"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 2}\n', "field 'input_length' must be positive"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,GPT-4,0,3,3,API log\n",
     "line 2: field 'Request tokens' must be positive, got 0"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,GPT-4,4,x,3,API log\n",
     "line 2: field 'Response tokens' must be an integer"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n,GPT-4,4,3,7,API log\n",
     "line 2: field 'Timestamp' is missing a value"),
    ("b.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,GPT-4,4,0,4,API log\n",
     "all 1 requests are failed ones ('Response tokens' 0)"),
    # Numeric times renamed to TIMESTAMP: still the Azure date column, and the error says how to read them.
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1700000000,4,2\n",
     "field 'TIMESTAMP' is not a timestamp YYYY-MM-DD[ HH:MM[:SS[.f]]] (a number: read a numeric time with --columns"),
    ("x.csv", "ts,in,out\n1,2,3\n", "missing column(s) prompt_len, decode_len (found: ts, in, out); formats: native, "
     "azure, mooncake, burstgpt, or name the columns with --columns prompt=NAME,decode=NAME"),
])
def test_bad_rows_of_the_new_formats_are_one_line_naming_file_line_field(tmp_path, name, text, needle):
    refused(write(tmp_path, name, text), needle)


# ---------------------------------------------------------------- the column mapping


def test_any_layout_reads_through_a_column_mapping_with_its_time_unit(tmp_path):
    rows = mooncake_rows()
    # The Mooncake sample's numbers under other names, time in seconds: the same trace.
    p = write(tmp_path, "mine.csv", "when,ctx,gen\n" + "".join(
        f"{r['timestamp'] / 1000},{r['input_length']},{r['output_length']}\n" for r in rows))
    want = load_trace(MOONCAKE, step_ms=250)
    for layout in (columns(**parse_columns("prompt=ctx,decode=gen,time=when:s")),
                   columns(**parse_columns("prompt=ctx, decode=gen, time=when"), time_unit="s")):
        got = load_trace(p, step_ms=250, layout=layout)
        assert got.checksum() == want.checksum()
        assert got.meta["schema"] == "columns"
        assert got.meta["columns"] == {"prompt": "ctx", "decode": "gen", "time": "when", "time_unit": "s"}
    # Without a time column every request arrives at step 0.
    untimed = load_trace(p, layout=columns("ctx", "gen"))
    assert untimed.arrival_step.tolist() == [0] * 32 and "step_ms" not in untimed.meta
    # Names with spaces are literal; a mapping is strict: only the BurstGPT format knows a
    # row of zeros as a failed request.
    refused(BURSTGPT, "line 11: field 'Request tokens' must be positive, got 0",
            layout=columns("Request tokens", "Total tokens", "Timestamp:s"))


def test_a_mapping_reads_numeric_timestamps_in_a_column_named_timestamp(tmp_path):
    p = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1700000000000,4,2\n1700000000250,4,2\n")
    t = load_trace(p, step_ms=100, layout=columns(**parse_columns("prompt=ContextTokens,decode=GeneratedTokens,"
                                                                  "time=TIMESTAMP:ms")))
    assert t.arrival_step.tolist() == [0, 2]


@pytest.mark.parametrize("text, unit, message", [
    ("prompt=a", None, "columns: missing decode"),
    ("prompt=a,decode=b,when=c", None, "'when=c' is not KEY=COLUMN with KEY one of prompt, decode, time"),
    ("prompt=a,decode=b,prompt=c", None, "prompt given twice"),
    ("prompt=a,decode=", None, "decode must name a column"),
    ("prompt=a,decode=b,time=c", None, "time=c needs its unit: time=c:s or time=c:ms"),
    ("prompt=a,decode=b,time=c:ms", "s", "time=c:ms says ms, the time unit says s"),
    ("prompt=a,decode=b", "ms", "a time unit (ms) without a time column"),
    ("prompt=a,decode=b,time=c", "h", "time unit must be s or ms"),
])
def test_a_bad_mapping_is_one_clear_line(text, unit, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        columns(**parse_columns(text), time_unit=unit)


def test_a_mapping_naming_an_absent_column_says_so(tmp_path):
    p = write(tmp_path, "a.csv", "x,y\n1,2\n")
    refused(p, "line 1: missing column(s) z of the column mapping (found: x, y)", layout=columns("x", "z"))


def pkv(*args) -> subprocess.CompletedProcess:
    # Calibration on the smoke profile takes about a minute alone, several times that on a
    # loaded machine (the suite in parallel).
    return subprocess.run([sys.executable, "-m", "pkv", *args], capture_output=True, text=True, timeout=1200)


def test_trace_show_reads_the_formats_and_the_mapping():
    done = pkv("trace", "show", "--file", str(MOONCAKE), "--step-ms", "100")
    assert done.returncode == 0 and "(file mooncake," in done.stdout and "requests     32" in done.stdout
    done = pkv("trace", "show", "--file", str(MOONCAKE), "--columns", "prompt=input_length,decode=output_length,"
               "time=timestamp", "--time-unit", "ms")
    assert done.returncode == 0 and "(file columns," in done.stdout and "requests     32" in done.stdout
    done = pkv("trace", "show", "--file", str(BURSTGPT))
    assert done.returncode == 0 and "(file burstgpt," in done.stdout and "requests     30" in done.stdout
    bad = pkv("trace", "show", "--file", str(MOONCAKE), "--columns", "prompt=input_length")
    assert bad.returncode == 2 and "argument --columns: columns: missing decode" in bad.stderr
    lone = pkv("trace", "show", "--file", str(MOONCAKE), "--time-unit", "ms")
    assert lone.returncode == 2 and "--time-unit is the unit of a --columns time column" in lone.stderr
    assert "Traceback" not in bad.stderr + lone.stderr


# ---------------------------------------------------------------- the named stage in the config


def smoke(**external) -> dict:
    cfg = copy.deepcopy(effective(RAW, "smoke"))
    cfg["external"].update(external)
    return cfg


def test_the_committed_config_keeps_its_name_file_title_and_hash():
    assert "name" not in RAW["external"] and "title" not in RAW["external"]
    paper = effective(RAW, "paper", {"run": "reference"})
    assert external_identity(paper["external"]) == (EXTERNAL_NAME, EXTERNAL_TITLE) == (
        "azure2023", "External request trace (Azure LLM inference 2023, conversation)")
    assert list(stage_files(paper, "external")) == ["azure2023.parquet"]
    committed = json.loads((REPO / "results" / "config.json").read_text())
    assert config_hash(paper) == config_hash(committed)
    assert STAGES["external"].file == "{name}.parquet"


def test_a_named_trace_has_its_own_file_and_title():
    cfg = smoke(path=str(MOONCAKE), name="mooncake-sample")
    validate_config(cfg, load_schema(), "config")
    assert list(stage_files(cfg, "external")) == ["mooncake-sample.parquet"]
    assert external_identity(cfg["external"]) == ("mooncake-sample", "External request trace (mooncake-sample)")
    titled = smoke(name="kimi", title="Mooncake conversation trace (sample)")
    assert external_identity(titled["external"]) == ("kimi", "Mooncake conversation trace (sample)")
    assert Config.from_dict(titled).external.title == "Mooncake conversation trace (sample)"


def test_an_unnamed_trace_is_named_after_its_file_not_azure():
    assert external_identity({"path": "data/azure2023/AzureLLMInferenceTrace_conv.csv"}) == (EXTERNAL_NAME,
                                                                                               EXTERNAL_TITLE)
    assert external_identity({"path": "/tmp/my traces/Code Trace (v2).jsonl"}) == (
        "Code-Trace-v2", "External request trace (Code-Trace-v2)")
    assert external_identity({"path": "$$$.csv"})[0] == "external"
    cfg = smoke(path="/tmp/burst.csv")
    assert list(stage_files(cfg, "external")) == ["burst.parquet"]
    validate_config({**cfg, "external": {**cfg["external"], "name": external_identity(cfg["external"])[0]}},
                    load_schema(), "config")   # a slug is a name the schema takes


@pytest.mark.parametrize("external, field", [
    ({"name": "../up"}, "name"), ({"name": "a b"}, "name"), ({"name": ""}, "name"),
    ({"title": "two\nlines"}, "title"), ({"columns": {"prompt": "a"}}, "columns"),
    ({"columns": {"prompt": "a", "decode": "b", "when": "c"}}, "columns"), ({"time_unit": "h"}, "time_unit"),
])
def test_the_schema_refuses_a_bad_name_title_or_mapping(external, field):
    with pytest.raises(ConfigError, match=rf"^config: external\.{field}: "):
        validate_config(smoke(**external), load_schema(), "config")


def test_the_config_mapping_reads_the_file_and_a_bad_one_is_named(tmp_path):
    p = write(tmp_path, "mine.csv", "ts,ctx,gen\n0,40,4\n1500,30,2\n")
    cfg = smoke(path=str(p), columns={"prompt": "ctx", "decode": "gen", "time": "ts"}, time_unit="ms")
    validate_config(cfg, load_schema(), "config")
    t = external_trace(cfg, p)
    assert t.meta["schema"] == "columns" and t.arrival_step.tolist() == [0, 15]
    with pytest.raises(ValueError, match=r"config: external\.columns: time=ts needs its unit"):
        external_trace(smoke(path=str(p), columns={"prompt": "ctx", "decode": "gen", "time": "ts"}), p)
    with pytest.raises(ValueError, match="external.time_unit is the unit of external.columns.time"):
        external_trace(smoke(time_unit="s"), p)


# ---------------------------------------------------------------- the stage end to end (CPU)


def test_the_external_stage_runs_on_the_mooncake_sample_end_to_end(tmp_path):
    """freeze-config, calibrate and measure external on a smoke config whose external trace
    is the Mooncake sample: the Parquet holds every engine's steps and names the trace."""
    title = "Mooncake sample (synthetic rows)"
    cfg = smoke(path=str(MOONCAKE), name="mooncake-sample", title=title, max_requests=6)
    config, constants = tmp_path / "config.json", tmp_path / "calibration" / "constants.json"
    assert pkv("freeze-config", "--json", json.dumps(cfg), "--out", str(config)).returncode == 0
    done = pkv("calibrate", "--config", str(config), "--out", str(constants),
               "--raw", str(tmp_path / "raw" / "calibrate" / "calibration.parquet"))
    assert done.returncode == 0, done.stderr[-2000:]
    out = tmp_path / "raw" / "external" / "mooncake-sample.parquet"
    done = pkv("measure", "external", "--config", str(config), "--constants", str(constants),
               "--trace", str(MOONCAKE), "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    frame = pq.read_table(out).to_pandas()
    assert set(frame["engine"]) == set(cfg["external"]["engines"]) | set(cfg["baselines"])
    assert set(frame["trace"]) == {"mooncake_sample"} and set(frame["family"]) == {"external"}
    assert frame.groupby("engine")["step"].nunique().gt(0).all() and np.isfinite(frame["wall_s"]).all()
    meta = read_meta(out)
    assert (meta["trace_name"], meta["trace_title"], meta["trace_format"]) == ("mooncake-sample", title, "mooncake")
    trace_meta = json.loads(meta["trace_meta"])
    assert trace_meta["schema"] == "mooncake" and trace_meta["transform"]["kept"] == 6
    assert meta["config_hash"] == config_hash(cfg)
    # The report titles the table by the trace, from the Parquet.
    done = pkv("report", str(tmp_path), "--target", str(tmp_path / "tables" / "external.md"))
    assert done.returncode == 0, done.stderr[-2000:]
    table = (tmp_path / "tables" / "external.md").read_text()
    assert table.startswith(f"# {title}\n") and "Trace mooncake-sample (mooncake request file)." in table
    assert "Azure" not in table


# ---------------------------------------------------------------- a named run touches nothing else


def _snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(f.relative_to(root)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(root.rglob("*"))
            if f.is_file()}


def test_a_new_trace_is_a_new_named_run_that_leaves_the_reference_and_other_runs_untouched(tmp_path):
    tree = copy_worktree(tmp_path / "tree", "results/runs/")   # the reference run results/ comes along
    other = tree / "results" / "runs" / "other" / "tables" / "external.md"
    other.parent.mkdir(parents=True)
    other.write_text("# another run's table\n")
    before_ref = _snapshot(tree / "results")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    trace = "tests/data/mooncake_sample.jsonl"

    def smk(*config):
        return subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p", "--cores", "1", "all", "--config",
                               "profile=paper", f"external={{path: {trace}, name: mine}}", *config], cwd=tree,
                              capture_output=True, text=True, timeout=600, env=env)

    # On the reference folder: refused, saying how to name a run.
    done = smk()
    assert done.returncode != 0
    assert "a changed config is a new run: name it with --config run=NAME" in done.stdout + done.stderr
    # Named: every planned output is under results/runs/mine/, the external one by the trace's name.
    done = smk("run=mine")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    outputs = [p.strip() for line in re.findall(r"^\s+output: (.*)$", done.stdout, flags=re.M)
               for p in line.split(",")]
    assert outputs and all(p.startswith("results/runs/mine/") for p in outputs), outputs
    assert "results/runs/mine/raw/external/mine.parquet" in outputs
    assert not any("azure2023" in p for p in outputs)
    shell = next(s for s in done.stdout.splitlines() if " measure external " in s)
    assert f"--trace {trace}" in shell and "results/runs/mine/raw/external/mine.parquet" in shell
    # Nothing of the reference run or the other run changed: bytes and mtimes.
    assert _snapshot(tree / "results") == before_ref
    assert not (tree / "results" / "runs" / "mine").exists()
