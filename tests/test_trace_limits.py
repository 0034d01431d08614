"""Trace loader hardening: bounded lengths (int32-safe through batching and paging), no
simulation that runs unbounded, one number rule for CSV and JSON, duplicate columns,
encodings, directories, and Azure timestamps out of order."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from pkv.core.harness import MAX_SIMULATED_STEPS, decode_steps, peak_active
from pkv.core.paging import assign_pages, flashinfer_view
from pkv.core.trace_files import TraceFileError, load_trace
from pkv.core.traces import MAX_LEN, SyntheticSpec, Trace, synthetic


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return p


def refused(path, needle):
    with pytest.raises(TraceFileError) as e:
        load_trace(path)
    msg = str(e.value)
    assert str(path) in msg and needle in msg and "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("name, text, needle", [
    ("huge.csv", "prompt_len,decode_len\n100,1000000000000\n", "line 2: field 'decode_len' is 1000000000000, above"),
    ("huge.csv", "prompt_len,decode_len\n1000000000000,4\n", "line 2: field 'prompt_len' is 1000000000000, above"),
    ("sum.csv", f"prompt_len,decode_len\n{MAX_LEN - 1},2\n", f"prompt_len + decode_len = {MAX_LEN + 1} tokens"),
    ("huge.jsonl", '{"prompt_len": 5, "decode_len": 1000000000000}\n', "line 1: field 'decode_len'"),
    ("late.csv", "prompt_len,decode_len,arrival_step\n5,5,99999999999\n", "field 'arrival_step' is 99999999999"),
])
def test_lengths_are_bounded(tmp_path, name, text, needle):
    msg = refused(write(tmp_path, name, text), needle)
    assert "MAX_" in msg


def test_huge_decode_length_fails_fast_on_the_command_line(tmp_path):
    p = write(tmp_path, "t.csv", "prompt_len,decode_len\n100,1000000000000\n")
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pkv", "trace", "show", "--file", str(p)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "above the maximum" in done.stderr
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("name, text", [
    ("a.csv", "prompt_len,decode_len\n100.0,5\n"),
    ("a.csv", "prompt_len,decode_len\n1e3,5\n"),
    ("a.json", '[{"prompt_len": 100.0, "decode_len": 5}]'),
    ("a.json", '[{"prompt_len": 1e3, "decode_len": 5}]'),
    ("a.jsonl", '{"prompt_len": 1E3, "decode_len": 5}\n'),
    ("a.json", '[{"prompt_len": NaN, "decode_len": 5}]'),
    ("a.csv", "prompt_len,decode_len\n1_000,5\n"),
])
def test_one_number_rule_for_csv_and_json(tmp_path, name, text):
    refused(write(tmp_path, name, text), "field 'prompt_len' must be an integer")


def test_integers_pass_in_both(tmp_path):
    a = load_trace(write(tmp_path, "a.csv", "prompt_len,decode_len\n 100 ,+5\n"))
    b = load_trace(write(tmp_path, "b.json", '[{"prompt_len": 100, "decode_len": 5}]'))
    assert a.prompt_len.tolist() == b.prompt_len.tolist() == [100] and a.decode_len.tolist() == [5]


@pytest.mark.parametrize("name, text, needle", [
    ("d.csv", "prompt_len,decode_len,prompt_len\n1,2,3\n", "line 1: column 'prompt_len' appears twice"),
    ("d.csv", "prompt_len, decode_len,decode_len \n1,2,3\n", "column 'decode_len' appears twice"),
    ("d.json", '[{"prompt_len": 1, "decode_len": 2, "prompt_len": 3}]', "key 'prompt_len' appears twice"),
    ("d.jsonl", '{"prompt_len": 1, "decode_len": 2}\n{"decode_len": 1, "decode_len": 2, "prompt_len": 1}\n',
     "line 2: key 'decode_len' appears twice"),
    ("d.csv", "prompt_len,decode_len\n1,2,3\n", "line 2: more values than the header's 2 columns"),
])
def test_duplicate_columns_are_refused(tmp_path, name, text, needle):
    refused(write(tmp_path, name, text), needle)


def test_non_utf8_names_file_and_line(tmp_path):
    p = write(tmp_path, "latin.csv", b"prompt_len,decode_len\n1,2\n3,4 \xe9t\xe9\n")
    refused(p, "line 3: not UTF-8 text (byte 0xe9")
    done = subprocess.run([sys.executable, "-m", "pkv", "trace", "show", "--file", str(p)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and f"{p}:line 3" in done.stderr


def test_directory_is_reported_as_a_directory(tmp_path):
    d = tmp_path / "traces.csv"
    d.mkdir()
    refused(d, "is a directory, not a request file")
    refused(tmp_path / "none.csv", "no such file")


def test_azure_rows_out_of_time_order(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:48.0,30,3\n"     # third in time
              "2023-11-16 18:15:46.0,10,1\n"     # earliest, anywhere in the file -> step 0
              "2023-11-16 18:15:46.05,20,2\n"    # same 100 ms step as the earliest, later in the file
              "2023-11-16 18:15:46.0,40,4\n")    # the same timestamp as the earliest, last in the file
    t = load_trace(p, step_ms=100)
    assert t.arrival_step.tolist() == [20, 0, 0, 0]
    # Admission: by arrival step, then file order.
    first = next(decode_steps(t, max_active=8))
    assert first.request_ids.tolist() == [1, 2, 3]


# ---------------------------------------------------------------- int32 through batching and paging


def test_longest_request_stays_int32_through_batching():
    t = Trace("long", np.zeros(1, np.int64), np.array([MAX_LEN - 1]), np.array([1]))
    (state,) = decode_steps(t, 1)
    assert state.seq_lens.dtype == np.int32 and int(state.seq_lens[0]) == MAX_LEN
    with pytest.raises(ValueError, match="above MAX_LEN"):
        Trace("over", np.zeros(1, np.int64), np.array([MAX_LEN]), np.array([1]))
    with pytest.raises(ValueError, match="above MAX_LEN"):
        synthetic(SyntheticSpec("bucketed", 1, num_requests=2, scale=1024.0))


def test_page_ids_beyond_int32_are_refused_not_wrapped():
    lens = np.full(200, MAX_LEN, dtype=np.int64)       # 200 x 2^24 tokens: 3.4e9 pages of 1 token
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="int32 page-id limit"):
        assign_pages(lens, 1, 0.0, 0)
    assert time.perf_counter() - t0 < 5
    a = assign_pages(np.array([MAX_LEN, 5]), 16, 0.5, 0)
    view = flashinfer_view(a, np.array([0, 1]), np.array([MAX_LEN, 5], dtype=np.int32))
    assert view.indptr.dtype == np.int32 and int(view.indptr[-1]) == MAX_LEN // 16 + 1


# ---------------------------------------------------------------- no unbounded simulation


def test_peak_active_does_not_step_through_long_decodes():
    n = 64
    t = Trace("long-decodes", np.arange(n, dtype=np.int64) * 1000, np.full(n, 16), np.full(n, MAX_LEN - 16))
    t0 = time.perf_counter()
    assert peak_active(t, 8) == 8
    assert time.perf_counter() - t0 < 2
    with pytest.raises(ValueError, match="MAX_SIMULATED_STEPS"):
        next(decode_steps(t, 8))
    assert len(list(decode_steps(t, 8, max_steps=3))) == 3


@pytest.mark.parametrize("seed", range(20))
def test_peak_active_agrees_with_step_by_step_batching(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    t = Trace("r", rng.integers(0, 30, n), rng.integers(1, 100, n), rng.integers(1, 12, n))
    for max_active in (1, 2, 3, 8):
        stepwise = max(s.active for s in decode_steps(t, max_active))
        assert peak_active(t, max_active) == stepwise
    assert MAX_SIMULATED_STEPS >= 1_000_000


def pkv_trace(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pkv", "trace", "show", *args], capture_output=True, text=True,
                          timeout=300)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    return done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag, value, message", [
    ("--step-ms", "1e303", "argument --step-ms: must be a finite number in (0, 86400000.0], got '1e303'"),
    ("--prompt-scale", "1e18", f"argument --prompt-scale: must be a finite number in (0, {MAX_LEN}], got '1e18'"),
])
def test_huge_flag_values_are_refused_by_name(tmp_path, flag, value, message):
    p = write(tmp_path, "t.csv", "input_length,output_length,timestamp\n100,5,0\n200,5,3\n")
    assert one_line(pkv_trace("--file", str(p), flag, value)).endswith(message)


def test_a_huge_step_or_scale_through_the_api_is_one_value_error(tmp_path):
    from pkv.core.traces import Transform

    p = write(tmp_path, "t.csv", "input_length,output_length,timestamp\n100,5,0\n200,5,3\n")
    with pytest.raises(ValueError, match=r"step_ms must be a number in \(0, 86400000\] ms"):
        load_trace(p, step_ms=1e303)
    with pytest.raises(ValueError, match=rf"prompt_scale must be a number in \(0, {MAX_LEN}\]"):
        Transform(prompt_scale=1e18)


@pytest.mark.parametrize("name, text", [
    ("long.csv", "prompt_len,decode_len\n5,{}\n"),
    ("long.jsonl", '{{"prompt_len": 5, "decode_len": {}}}\n'),
    ("long.json", '[{{"prompt_len": 5, "decode_len": {}}}]'),
])
def test_a_5000_digit_length_names_file_line_and_field(tmp_path, name, text):
    p = write(tmp_path, name, text.format("9" * 5000))
    msg = refused(p, "field 'decode_len' is an integer of 5000 digits")
    assert ("line 2" if name.endswith(".csv") else "line 1" if name.endswith(".jsonl") else "item 0") in msg
    assert len(msg) < 400


def test_a_file_past_the_request_limit_stops_reading_at_the_limit(tmp_path, monkeypatch):
    """Reading stops at the first request past MAX_REQUESTS: rows after it are never parsed
    (here a broken row right after the limit would fail with another message)."""
    import pkv.core.trace_files as tf

    monkeypatch.setattr(tf, "MAX_REQUESTS", 3)
    for name, row, broken in (("many.csv", "5,5\n", "x,y,z,w\n"),
                              ("many.jsonl", '{"prompt_len": 5, "decode_len": 5}\n', "not json\n")):
        header = "prompt_len,decode_len\n" if name.endswith(".csv") else ""
        p = write(tmp_path, name, header + row * 4 + broken * 3)
        line = "line 5" if name.endswith(".csv") else "line 4"
        msg = refused(p, f"{line}: more than 3 requests")
        assert "--max-requests applies only after loading" in msg and "split it" in msg
        p = write(tmp_path, name, header + row * 3)
        assert len(load_trace(p)) == 3
