import subprocess
import sys
from pathlib import Path

import pytest

from pkv.cli.main import main

AZURE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure2023" / "AzureLLMInferenceTrace_conv.csv"


def pkv(*args):
    return subprocess.run([sys.executable, "-m", "pkv.cli", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_commands():
    r = pkv("--help")
    assert r.returncode == 0 and "trace" in r.stdout


def test_trace_show_family(capsys):
    assert main(["trace", "show", "--family", "bimodal", "--seed", "20260623"]) == 0
    out = capsys.readouterr().out
    for field in ("requests     16", "prompt_len", "p50=", "peak active  8", "KV tokens", "GiB"):
        assert field in out


def test_trace_show_file_with_transform(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text('{"prompt_len": 100, "decode_len": 5}\n{"prompt_len": 9000, "decode_len": 6}\n')
    assert main(["trace", "show", "--file", str(p), "--prompt-scale", "2", "--max-len", "1000"]) == 0
    out = capsys.readouterr().out
    assert "requests     1" in out and "'kept': 1" in out


@pytest.mark.skipif(not AZURE.is_file(), reason="shared Azure trace not beside the checkout")
def test_trace_show_azure():
    r = pkv("trace", "show", "--file", str(AZURE))
    assert r.returncode == 0 and "requests     19366" in r.stdout


@pytest.mark.parametrize("name, text", [
    ("missing.csv", "prompt_len\n5\n"),
    ("nonint.csv", "prompt_len,decode_len\n5,abc\n"),
    ("zero.csv", "prompt_len,decode_len\n0,1\n"),
    ("neg.csv", "prompt_len,decode_len\n5,-1\n"),
    ("ext.yaml", "prompt_len: 1\n"),
    ("empty.csv", ""),
    ("stamp.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-time,3,4\n"),
])
def test_bad_input_is_one_line_no_traceback(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    r = pkv("trace", "show", "--file", str(p))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pkv: error: ") and str(p) in lines[0]
    assert "Traceback" not in r.stderr


def test_a_kernel_only_install_is_told_which_extra_report_needs(tmp_path):
    """Without the pipeline extra (pandas absent), `pkv report` says what to install in one line."""
    probe = ("import sys; sys.modules['pandas'] = None\n"
             "from pkv.cli.main import main\n"
             f"sys.exit(main(['report', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "pkv: error: `pkv report` needs pandas, from the pipeline extra, which this install lacks (the kernels "
        "alone); install it with: pip install 'pkv[pipeline]' (or, in a checkout, pip install -e '.[pipeline]')"]
