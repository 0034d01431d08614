import json
from pathlib import Path

import numpy as np
import pytest

from pkv.core.trace_files import TraceFileError, load_trace
from pkv.core.traces import BUCKETS, FAMILIES, SyntheticSpec, Trace, Transform, apply_transform, synthetic

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"

# Pinned so that a change of generator, numpy stream or family definition is noticed:
# the same seed must give the same trace on every machine.
GOLDEN = {
    "bucketed": "388317e82aafb7b63c7c59b6922ca76014f1769f758bacae7d3588b2bfb82521",
    "homogeneous": "ce96075d0ef030840112247b1135ca48b428dea8d963f7a4b7b07749d7d849dc",
    "bimodal": "4c4d842c443d00b004dde92b762bd20d5adacda3230cabe8ca0b9dadf89dc5c2",
    "uniform": "c244c4728b0c83cf5e8199744249c446bc6d4b80d6db7a34b43845d71d410773",
    "zipf": "e9c5f4dc8e516fcd0e4d9eefd271c0978b2aeac2e02254587b82d7ca01bc0984",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_golden_checksum(family):
    assert synthetic(SyntheticSpec(family, 20260623)).checksum() == GOLDEN[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_trace_other_seed_other_trace(family):
    a, b = synthetic(SyntheticSpec(family, 7)), synthetic(SyntheticSpec(family, 7))
    assert a.checksum() == b.checksum()
    if family not in ("bucketed", "homogeneous"):
        assert synthetic(SyntheticSpec(family, 8)).checksum() != a.checksum()


def test_family_shapes():
    n = 400
    bucketed = synthetic(SyntheticSpec("bucketed", 1, num_requests=n))
    assert bucketed.prompt_len.tolist() == [BUCKETS[i % 4] for i in range(n)]
    assert set(synthetic(SyntheticSpec("homogeneous", 1, num_requests=n)).prompt_len) == {32768}
    bimodal = synthetic(SyntheticSpec("bimodal", 1, num_requests=n)).prompt_len
    assert (bimodal[::4] >= 32768).all() and (np.delete(bimodal, np.s_[::4]) <= 8192).all()
    uniform = synthetic(SyntheticSpec("uniform", 1, num_requests=n, min_len=100, max_len=900)).prompt_len
    assert uniform.min() >= 100 and uniform.max() <= 900 and len(np.unique(uniform)) > 100
    zipf = synthetic(SyntheticSpec("zipf", 1, num_requests=n)).prompt_len
    assert zipf.min() >= 1024 and zipf.max() <= 65536
    assert np.median(zipf) < 4096 < zipf.max()  # heavy tail: most short, some long


def test_decode_lengths_and_arrivals():
    t = synthetic(SyntheticSpec("uniform", 3, num_requests=200, decode_min=5, decode_max=9, mean_arrival_gap=2.0))
    assert t.decode_len.min() >= 5 and t.decode_len.max() <= 9
    assert t.arrival_step[0] == 0 and (np.diff(t.arrival_step) >= 0).all() and t.arrival_step[-1] > 0
    assert (synthetic(SyntheticSpec("uniform", 3)).arrival_step == 0).all()


def test_scale_shrinks_prompts():
    t = synthetic(SyntheticSpec("bucketed", 1, num_requests=4, scale=1 / 256))
    assert t.prompt_len.tolist() == [32, 64, 128, 256]


@pytest.mark.parametrize("bad", [dict(family="nope"), dict(num_requests=0), dict(decode_min=0),
                                 dict(decode_min=9, decode_max=3), dict(min_len=10, max_len=5), dict(scale=0)])
def test_bad_spec(bad):
    with pytest.raises(ValueError):
        SyntheticSpec(**{"family": "uniform", "seed": 1, **bad})


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_csv_json_jsonl_native(tmp_path):
    csv = write(tmp_path, "t.csv", "prompt_len,decode_len,arrival_step\n100,5,0\n200,6,3\n")
    js = write(tmp_path, "t.json",
               json.dumps([{"prompt_len": 100, "decode_len": 5}, {"prompt_len": 200, "decode_len": 6}]))
    wrapped = write(tmp_path, "w.json",
                    json.dumps({"requests": [{"prompt_len": 1, "decode_len": 2, "arrival_step": 4}]}))
    jsonl = write(tmp_path, "t.jsonl", '{"prompt_len": 100, "decode_len": 5}\n\n{"prompt_len": 200, "decode_len": 6}\n')
    a = load_trace(csv)
    assert a.prompt_len.tolist() == [100, 200] and a.arrival_step.tolist() == [0, 3]
    for p in (js, jsonl):
        t = load_trace(p)
        assert t.prompt_len.tolist() == [100, 200] and t.decode_len.tolist() == [5, 6]
        assert t.arrival_step.tolist() == [0, 0]
    assert load_trace(wrapped).arrival_step.tolist() == [4]


def test_azure_schema(tmp_path):
    p = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
              "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:46.9000000,10,2\n2023-11-16 18:15:48.0000000,7,1\n")
    t = load_trace(p, step_ms=250)
    assert t.prompt_len.tolist() == [374, 10, 7] and t.decode_len.tolist() == [44, 2, 1]
    assert t.arrival_step.tolist() == [0, 0, 5]  # 1.319 s / 0.25 s = 5.3 steps
    assert t.meta["schema"] == "azure" and t.meta["step_ms"] == 250


@pytest.mark.skipif(not AZURE.is_file(), reason="shared Azure trace not beside the checkout")
def test_real_azure_trace():
    t = load_trace(AZURE, step_ms=100)
    assert len(t) == 19366 and t.arrival_step.min() == 0
    assert t.prompt_len.min() >= 1 and t.decode_len.min() >= 1


@pytest.mark.parametrize("name,text,needle", [
    ("a.csv", "prompt_len\n5\n", "t.csv:line 1: missing column(s) decode_len"),
    ("a.csv", "prompt_len,decode_len\n5,x\n", "line 2: field 'decode_len' must be an integer"),
    ("a.csv", "prompt_len,decode_len\n5,2\n5,2.5\n", "line 3: field 'decode_len' must be an integer"),
    ("a.csv", "prompt_len,decode_len\n0,2\n", "line 2: field 'prompt_len' must be positive, got 0"),
    ("a.csv", "prompt_len,decode_len\n-4,2\n", "line 2: field 'prompt_len' must be positive, got -4"),
    ("a.csv", "prompt_len,decode_len\n4,\n", "line 2: field 'decode_len' is missing a value"),
    ("a.csv", "prompt_len,decode_len,arrival_step\n4,2,-1\n", "field 'arrival_step' must be >= 0"),
    ("a.csv", "", "the file is empty"),
    ("a.csv", "prompt_len,decode_len\n", "has a header but no requests"),
    ("a.txt", "prompt_len,decode_len\n1,1\n", "unknown extension '.txt'"),
    ("a.jsonl", '{"prompt_len": 1, "decode_len": 1}\n{"prompt_len": 1.5, "decode_len": 1}\n',
     "line 2: field 'prompt_len'"),
    ("a.jsonl", '{"prompt_len": 1, "decode_len": 1}\n{oops\n', "line 2: not valid JSON"),
    ("a.json", '[{"prompt_len": 1, "decode_len": 1}, 7]', "item 1: expected an object"),
    ("a.json", '[{"prompt_len": 1, "decode_len": true}]', "item 0: field 'decode_len' must be an integer"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,1,1\nyesterday,1,1\n",
     "line 3: field 'TIMESTAMP' is not a timestamp"),
    ("a.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,1\n", "missing column(s) GeneratedTokens"),
])
def test_bad_files_name_file_line_field(tmp_path, name, text, needle):
    p = write(tmp_path, name, text)
    with pytest.raises(TraceFileError) as e:
        load_trace(p)
    msg = str(e.value)
    assert str(p) in msg and needle.replace("t.csv", name) in msg and "\n" not in msg


def test_missing_file(tmp_path):
    with pytest.raises(TraceFileError, match="no such file"):
        load_trace(tmp_path / "none.csv")


def test_transform_is_explicit_and_recorded():
    base = Trace("t", np.array([5, 0, 2, 9]), np.array([100, 200, 300, 400]), np.array([1, 1, 1, 1]))
    t = apply_transform(base, Transform(prompt_scale=2.0, min_len=300, max_len=700, max_requests=2))
    # Scaled totals: 201, 401, 601, 801 -> keep 401 (arrival 0) and 601 (arrival 2), rebased to 0.
    assert t.prompt_len.tolist() == [400, 600] and t.arrival_step.tolist() == [0, 2]
    assert t.meta["transform"] == {"prompt_scale": 2.0, "min_len": 300, "max_len": 700, "max_requests": 2,
                                   "kept": 2, "of": 4}
    with pytest.raises(ValueError, match="keeps none"):
        apply_transform(base, Transform(min_len=10_000))
    with pytest.raises(ValueError):
        Transform(prompt_scale=-1)


def test_trace_rejects_bad_arrays():
    with pytest.raises(ValueError):
        Trace("t", np.array([0]), np.array([0]), np.array([1]))
    with pytest.raises(ValueError):
        Trace("t", np.array([0, 1]), np.array([1]), np.array([1]))


def test_each_family_row_carries_its_length_rule_and_an_unknown_one_is_refused(monkeypatch):
    """A new family row gets exactly the lengths its row names (here: a constant 4096), and
    a row naming a rule the generator does not have is refused, never given Zipf lengths."""
    from pkv.core import families

    monkeypatch.setitem(families.FAMILIES, "flat4k", families.Family("every prompt 4K", "constant", {"length": 4096}))
    assert set(synthetic(SyntheticSpec("flat4k", 1, num_requests=50)).prompt_len) == {4096}
    monkeypatch.setitem(families.FAMILIES, "lognormal", families.Family("a rule nobody wrote", "lognormal"))
    with pytest.raises(ValueError, match="'lognormal' names the prompt-length rule 'lognormal', which"):
        SyntheticSpec("lognormal", 1)
    with pytest.raises(ValueError, match="unknown trace family 'nosuch'"):
        SyntheticSpec("nosuch", 1)
