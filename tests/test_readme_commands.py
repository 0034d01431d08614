"""The README as a reader meets it. Every command of its shell blocks works as written on a CPU
machine, or is named here as one this test cannot run (and why): Snakemake commands run as dry
runs (`-n`: the smoke run itself is tests/test_pipeline.py's), in a copy of the checkout; `pkv`
commands run for real there. It is short and opens with the quick start and the results; every
number its results quote is copied from a generated table it links; every relative link of the
README and of docs/ names a file of the checkout."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from worktree import REPO, copy_worktree

# Commands this test does not run, by their first words, and why.
NOT_RUN = {
    "pip install": "an install step (CI runs it in .ci/run)",
    "python3 -m pytest": "the test suite itself",
    "snakemake --profile profiles/slurm": "needs a SLURM cluster (tests/test_slurm.py plans and runs it on one)",
}


def readme_commands() -> list[str]:
    return readme_commands_of((REPO / "README.md").read_text())


def readme_commands_of(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            commands += [part.strip() for part in line.split("&&") if part.strip() and not line.startswith("#")]
    return commands


def _skip_reason(command: str) -> str | None:
    return next((why for start, why in NOT_RUN.items() if command.startswith(start)), None)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    dest = copy_worktree(tmp_path_factory.mktemp("readme"), skip="results/smoke/")
    # The README's "your own request file" example names a file of yours: here, a small one.
    (dest / "my_requests.jsonl").write_text(
        "".join(f'{{"prompt_len": {200 * (i + 1)}, "decode_len": {8 + i}}}\n' for i in range(6)))
    return dest


MAX_README_LINES = 220
NUMBER = re.compile(r"(?<![\w.])\d+\.\d+")          # a decimal number, as the tables print them
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")   # a Markdown link's target, without its anchor


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_is_short_and_opens_with_the_quick_start_then_the_results():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    assert text.index("\n## Quick start\n") < text.index("\n## Results\n") < text.index("\n## API\n")
    quick = readme_commands_of(_section(text, "Quick start"))
    assert any(c.startswith("snakemake") for c in quick) and any(c.startswith("python3 -m pytest") for c in quick)


def test_every_number_of_the_readme_results_is_in_a_table_it_links():
    results = _section((REPO / "README.md").read_text(), "Results")
    tables = [REPO / t for t in LINK.findall(results) if t.startswith("results/tables/") and t.endswith(".md")]
    assert tables, "the README's results link no table"
    text = "\n".join(t.read_text() for t in tables)
    missing = [n for n in NUMBER.findall(results) if not re.search(rf"(?<![\w.]){re.escape(n)}(?![\d])", text)]
    assert not missing, f"README.md's results quote numbers no linked table has: {missing}"


def test_the_readme_quotes_the_claims_tables_verdict_counts():
    results = " ".join(_section((REPO / "README.md").read_text(), "Results").split())
    counts = re.search(r"^Verdicts: (.*)\.$", (REPO / "results/tables/claims.md").read_text(), re.M).group(1)
    assert "results/tables/claims.md" in results and counts in results, \
        f"README.md's results: link results/tables/claims.md and copy its counts ({counts})"


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_name_files_of_the_checkout(doc):
    path = REPO / doc
    targets = [t for t in LINK.findall(path.read_text()) if "://" not in t and not t.startswith("mailto:")]
    broken = [t for t in targets if not (path.parent / t).exists()]
    assert not broken, f"{doc}: links to missing files {broken}"


def test_the_readme_has_commands():
    commands = readme_commands()
    assert any(c.startswith("snakemake") for c in commands) and any(c.startswith("pkv ") for c in commands)


@pytest.mark.slow
@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_works_as_written(command, tree):
    why = _skip_reason(command)
    if why:
        pytest.skip(f"not run here: {why}")
    args = shlex.split(command)
    if args[0] == "snakemake":
        args = [sys.executable, "-m", "snakemake", "-n", *args[1:]]
    elif args[0] == "pkv":
        args = [sys.executable, "-m", "pkv", *args[1:]]
    else:
        raise AssertionError(f"README command {command!r}: neither run nor named in NOT_RUN")
    done = subprocess.run(args, cwd=tree, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
