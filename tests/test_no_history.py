"""No history in the code: every .py file under pkv/ and tests/, and every comment in csrc/,
says what the code does today, never which version, issue or commit it came from (history
lives in git, in results/ and in the dated log under docs/).

What counts, and what is left alone (false positives a plain grep would raise):
- a version tag: `v` and digits, dotted or not, as a word of its own ("v4", "v5.12", "Router
  v4.3"). `kv4` or `v4_x` are not words of their own; "V100" and "H100" start with another letter.
- an issue tag: "issue 23", "Issue #13", "issues 12, 23"; in a csrc comment also "#22".
- a commit hash: a word of 7 to 40 hex digits holding both a digit and a letter a-f. Numbers,
  seeds and dates are digits only (20260622, 1.25, 2023-11-16); words such as "deadbeef" or
  "facade" are letters only; a sha256 computed in code is 64 digits long, longer than any
  commit name, and a hex constant carries its 0x prefix (0x1f2e3d4c is not a word of hex digits).

ALLOWED names the few strings that match and are not history (a file name under test, the
name of a committed results file); each is taken out of its line before the line is read.
This file itself is not read: its examples are the patterns' own test cases.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

VERSION = re.compile(r"\bv\d+(?:\.\d+)*\b")
ISSUE = re.compile(r"\b[Ii]ssues? ?#?\d+")
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
PATTERNS = (VERSION, ISSUE, COMMIT)
# csrc/: only comments are read (an asm string such as "ld.global.nc.v4.u32" is code), and
# a bare "#22" there is an issue number (no preprocessor line puts a digit after #).
CSRC_SUFFIXES = (".cu", ".cuh", ".h", ".cpp")
CSRC_ISSUE = re.compile(r"(?<![\w&])#\d+\b")
COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)

ALLOWED = {
    # An external trace's file name and the identity derived from it: test data, not a tag.
    "tests/test_trace_files.py": ("Code Trace (v2)", "Code-Trace-v2"),
    # The committed table and raw file of `pkv bench splits` (results/tables/kernels-v3.md):
    # renaming them is a change of the pipeline's outputs, not of this file.
    "pkv/bench/splits.py": ("kernels-v3", "v3-kernels"),
}

def tags(text: str, allowed: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """(line number, match) of every version, issue or commit tag in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for ok in allowed:
            line = line.replace(ok, "")
        found += [(number, m.group(0)) for pattern in PATTERNS for m in pattern.finditer(line)]
    return found


def comment_tags(source: str) -> list[tuple[int, str]]:
    """(line number, match) of every tag in the C++/CUDA comments of `source`."""
    found = []
    for c in COMMENT.finditer(source):
        first = source.count("\n", 0, c.start()) + 1
        found += [(first + n - 1, m) for n, m in tags(c.group(0))]
        found += [(first + c.group(0).count("\n", 0, m.start()), m.group(0)) for m in CSRC_ISSUE.finditer(c.group(0))]
    return found


def sources() -> list[Path]:
    me = Path(__file__).resolve()
    return sorted(p for d in ("pkv", "tests") for p in (ROOT / d).rglob("*.py") if p.resolve() != me)


@pytest.mark.parametrize("text,want", [
    ("Router v4.3 costs it", ["v4.3"]), ("the v5 merge kernel", ["v5"]), ("(v5.12; default)", ["v5.12"]),
    ("see issue 23", ["issue 23"]), ("Issue #13's bar", ["Issue #13"]), ("at c8880c7", ["c8880c7"]),
    ("commit 0a3a33c7e1f2", ["0a3a33c7e1f2"]),
])
def test_the_patterns_find_each_kind_of_tag(text, want):
    assert [m for _, m in tags(text)] == want


@pytest.mark.parametrize("text", [
    "seed 20260622", "ratio 1.25 on 2023-11-16 18:15:46.6805900", "kv4 = v4_x + H100 + V100",
    "0x1f2e3d4c", "digest " + "0123456789abcdef" * 4, "deadbeef facade", "e4m3 at 3e-12", "--seed 20260623",
])
def test_the_patterns_leave_numbers_hex_constants_and_digests_alone(text):
    assert tags(text) == []


def test_no_version_issue_or_commit_tag_in_pkv_or_tests():
    found = []
    for path in sources():
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}:{n}: {m}" for n, m in tags(path.read_text(), ALLOWED.get(rel, ()))]
    assert not found, "history in the code (it belongs in git and docs/):\n" + "\n".join(found)


@pytest.mark.parametrize("source,marks", [
    ("// v5.12: the set-up units\nint x;", 1), ("int x;  // Router v4.4", 1), ("/* measured at 0a3a33c */", 1),
    ("// issue 46 and #22", 2), ('asm("ld.global.nc.v4.u32 %0;");  // four words', 0),
    ("constexpr float k = 0.693147180559945309f;  // ln 2, float4 loads", 0), ("#include <cuda.h>", 0)])
def test_csrc_comments_are_read_for_tags_and_code_is_not(source, marks):
    assert len(comment_tags(source)) == marks


def test_no_version_issue_or_commit_tag_in_csrc_comments():
    found = [f"csrc/{p.name}:{n}: {m}" for p in sorted((ROOT / "csrc").iterdir()) if p.suffix in CSRC_SUFFIXES
             for n, m in comment_tags(p.read_text())]
    assert not found, "history in csrc/'s comments (it belongs in git and docs/):\n" + "\n".join(found)
