"""Conventions: `pkv --version`, `python -m pkv`, defaults in every --help, the command
table against the modules, and a legible serving-ratio figure."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import pkv
from pkv.cli.main import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_version_matches_pyproject():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert pkv.__version__ == version
    done = _run("-m", "pkv", "--version")
    assert done.returncode == 0 and done.stdout.startswith(f"pkv {version} (commit ")
    for part in ("; torch ", "; CUDA ", "; FlashInfer "):
        assert part in done.stdout


def test_python_dash_m_pkv_is_the_pkv_command():
    done = _run("-m", "pkv", "--help")
    assert done.returncode == 0 and "COMMAND" in done.stdout
    for name in COMMANDS:
        assert name in done.stdout
    done = _run("-m", "pkv", "trace", "show", "--family", "zipf")
    assert done.returncode == 0 and "requests     16" in done.stdout


def _parsers(parser: argparse.ArgumentParser, path=("pkv",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_help_shows_every_default():
    checked = 0
    for path, parser in _parsers(build_parser()):
        formatter = parser._get_formatter()
        text = "".join(parser.format_help().split())   # wrapping may break anywhere
        for action in parser._actions:
            if not action.option_strings or action.default in (None, False, [], argparse.SUPPRESS):
                continue
            if action.help == argparse.SUPPRESS or isinstance(action, argparse._VersionAction):
                continue
            option = action.option_strings[-1]
            assert action.help, (" ".join(path), option, "has no help, so argparse prints no default")
            expanded = "".join(formatter._expand_help(action).split())
            assert (f"(default:{action.default})".replace(" ", "") in expanded
                    and expanded in text), (" ".join(path), option)
            checked += 1
    assert checked > 10


def test_command_table_agrees_with_the_modules():
    full = build_parser()
    sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(COMMANDS)
    for name in COMMANDS:
        alone = build_parser(name)
        alone_sub = next(a for a in alone._actions if isinstance(a, argparse._SubParsersAction))
        assert alone_sub.choices[name].format_help() == sub.choices[name].format_help(), name


def _serve_frame():
    import pandas as pd

    files = sorted((REPO / "results" / "raw" / "serve").glob("*.parquet"))
    if not files:
        pytest.skip("no committed serve Parquet")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def test_serving_ratio_figure_is_legible(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from pkv.report import figures as report_figures
    frame = _serve_frame()
    png = report_figures.draw("serving_ratios", frame, smoke=False)   # also sets the theme
    (tmp_path / "serving_ratios.png").write_bytes(png)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    fig = report_figures.serving_ratios_figure(frame, smoke=False)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    # One panel per engine over a shared x axis: the trace labels sit under the bottom one.
    labelled = [ax for ax in fig.axes if any(t.get_text() for t in ax.get_xticklabels())]
    assert len(labelled) == 1
    labels = [t.get_window_extent(renderer) for t in labelled[0].get_xticklabels() if t.get_text()]
    assert len(labels) == 8
    for a, b in zip(labels, labels[1:]):
        assert a.x1 < b.x0, "x tick labels overlap"
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    assert len(legends) == 1
    legend = legends[0].get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for ax in fig.axes for p in ax.patches
            if isinstance(p, Rectangle) and p.get_height() > 0]
    assert bars and not any(legend.overlaps(b) for b in bars), "the legend covers bars"
    title = fig._suptitle.get_window_extent(renderer)
    assert not legend.overlaps(title)
    plt.close(fig)
