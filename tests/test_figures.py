"""The report's figures read at a glance: plain tick labels on every log axis (no "2×10¹"),
no overlapping labels or legends, one panel / line / legend entry per thing plotted.

CPU only, from the committed raw Parquet or small synthetic frames in the model step's
current schema (pkv.measure.model_step.COLUMNS)."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from pkv.report import figures, model  # noqa: E402
from pkv.report.tables import _build_target  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
SCIENTIFIC = ("×10", "\\times", "^{", "$", "e+", "e-0")


def _raw(stage: str) -> pd.DataFrame:
    files = sorted((RESULTS / "raw" / stage).glob("*.parquet"))
    if not files:
        pytest.skip(f"no committed {stage} Parquet")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _renderer(fig):
    """fig drawn on an Agg canvas (a figure pyplot closed has lost its own)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if not hasattr(fig.canvas, "get_renderer"):
        FigureCanvasAgg(fig)
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def _tick_texts(fig) -> list[str]:
    _renderer(fig)
    return [t.get_text() for ax in fig.axes for axis in (ax.xaxis, ax.yaxis)
            for t in (*axis.get_majorticklabels(), *axis.get_minorticklabels()) if t.get_visible() and t.get_text()]


def _assert_plain(fig, name: str = "") -> None:
    texts = _tick_texts(fig)
    assert texts, name
    bad = [t for t in texts if any(s in t for s in SCIENTIFIC)]
    assert not bad, f"{name}: scientific tick labels {bad}"


def _no_overlap(boxes) -> bool:
    boxes = sorted(boxes, key=lambda b: b.x0)
    return all(a.x1 < b.x0 for a, b in zip(boxes, boxes[1:]))


# ---------------------------------------------------------------- the model step


def _model_frame(engines=("pkv-graph", "flashinfer-graph", "flashinfer-eager", "adaptive"), kv=("auto", "fp8"),
                 models=(("llama-8b", 32, 4096), ("llama-1b", 16, 2048)), buckets=(1, 8), seeds=(1, 2)) -> pd.DataFrame:
    """Rows in the schema pkv.measure.model_step writes: steps, then one pipelined row per job and engine."""
    rng = np.random.default_rng(0)
    rows = []
    for name, layers, hidden in models:
        for kv_dtype in kv:
            for seed in seeds:
                for b in buckets:
                    for step in range(6):
                        active = max(1, b - step % 2)
                        total = int(1024 * 2 ** step * active)
                        for i, engine in enumerate(engines):
                            wall = 1e-3 * (1 + i) * (1 + total / 65536) * rng.uniform(0.9, 1.1)
                            rows.append({"stage": "model_step", "model": name, "layers": layers, "hidden": hidden,
                                         "kv_dtype": kv_dtype, "kv_layers": layers, "family": "bimodal",
                                         "trace": f"bimodal-{seed}", "seed": seed, "max_active": b, "bucket": b,
                                         "engine": engine, "route": engine, "kind": "step", "step": step,
                                         "active": active, "total_tokens": total, "max_len": total // active,
                                         "steps": 1, "tokens": active, "wall_s": wall, "prepare_s": 1e-5,
                                         "device_s": wall * 0.8 if engine != "reference" else np.nan,
                                         "rel_err": 1e-3, "max_rel_err": 1e-3, "failed": False})
                    for engine in engines:
                        rows.append({**rows[-1], "engine": engine, "kind": "pipelined", "step": -1, "steps": 6,
                                     "tokens": 6 * b, "wall_s": 6e-3, "device_s": np.nan, "rel_err": np.nan})
    return pd.DataFrame(rows)


def _check_model_figure(fig, panels: int, engines: int, lines: list[int] | None = None) -> None:
    """`lines`: the engines of each panel (any order), where not every panel has all of them."""
    panels_drawn = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels_drawn) == panels
    assert sorted(len(ax.get_lines()) for ax in panels_drawn) == sorted(lines or [engines] * panels), \
        "one line per engine in every panel"
    for ax in panels_drawn:
        assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
        assert not ax.xaxis.get_minorticklocs().size and not ax.yaxis.get_minorticklocs().size
    assert len(fig.legends) == 1 and len(fig.legends[0].get_texts()) == engines
    _assert_plain(fig, "model_step")
    renderer = _renderer(fig)
    legend = fig.legends[0].get_window_extent(renderer)
    assert not any(legend.overlaps(ax.get_window_extent(renderer)) for ax in panels_drawn), "legend over a panel"
    assert not legend.overlaps(fig._suptitle.get_window_extent(renderer))
    for ax in panels_drawn:
        labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert _no_overlap(labels), "x tick labels overlap"


def test_model_step_figure_of_the_committed_raw():
    frame = _raw("model_step")   # every held-out seed and the external trace, 16-bit and FP8 KV
    fig = model.model_step_figure(frame, smoke=False)
    steps = frame[frame["kind"] == "step"]
    per = steps.groupby(["model", "kv_dtype", "bucket"])["engine"].nunique()   # FP8 panels: no adaptive
    _check_model_figure(fig, len(per), steps["engine"].nunique(), list(per))
    bottom = [t.get_text() for t in fig.axes[-1].get_xticklabels() if t.get_text()]
    assert all(t.endswith("K") for t in bottom), bottom
    plt.close(fig)


def test_model_step_figure_of_the_current_schema():
    frame = _model_frame()
    fig = model.model_step_figure(frame, smoke=False)
    _check_model_figure(fig, 2 * 2 * 2, 4)   # (model x KV dtype) rows x buckets
    names = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert names[0].startswith("llama-1b") and sum("fp8" in n for n in names) == 2   # smaller model first
    plt.close(fig)


def test_model_step_figure_of_a_smoke_run():
    frame = _model_frame(engines=("pkv-graph", "reference"), models=(("smoke", 2, 256), ("smoke-gqa8", 2, 256)),
                         buckets=(1, 4), seeds=(1,))
    fig = model.model_step_figure(frame, smoke=True)
    _check_model_figure(fig, 4 * 2, 2)
    assert "CPU smoke" in fig._suptitle.get_text()
    plt.close(fig)
    assert model.plot_model_step(frame, smoke=True)[:8] == b"\x89PNG\r\n\x1a\n"


def test_plain_log_ticks():
    assert figures.log10_ticks(1.2, 40) == [2.0, 5.0, 10.0, 20.0]
    assert len(figures.log10_ticks(5.1, 6.9)) >= 2   # a narrow range still gets labels
    assert [figures.tokens_label(t) for t in figures.log2_ticks(1000, 600_000)] == ["1K", "4K", "16K", "64K", "256K"]
    assert [figures.plain_number(v) for v in (0.05, 2.0, 40.0, 1500.0)] == ["0.05", "2", "40", "1500"]


# ---------------------------------------------------------------- serving ratios


def _serving_with_more_engines() -> pd.DataFrame:
    f = _raw("serve")
    over = f[f["engine"] == "adaptive"].assign(engine="adaptive:objective=overlapped")
    graph = f[f["engine"] == "pkv-workqueue"].assign(engine="pkv-graph")
    return pd.concat([f, over, graph], ignore_index=True)


def _check_serving(fig, engines: list[str]) -> None:
    assert len(fig.axes) == len(engines)
    renderer = _renderer(fig)
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert len(legends) == 1, "one legend, on the top panel"
    texts = [t.get_text() for t in legends[0].get_texts()]
    assert len(texts) == len(set(texts)) and "parity (1.0)" in texts
    legend = legends[0].get_window_extent(renderer)
    for ax, engine in zip(fig.axes, engines):
        assert figures._engine_label(engine).split(" · ")[0] in ax.get_ylabel()
        bars = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]
        assert bars and not any(legend.overlaps(b) for b in bars), "the legend covers bars"
    labels = [t.get_window_extent(renderer) for t in fig.axes[-1].get_xticklabels() if t.get_text()]
    assert len(labels) == len(figures.rep.trace_order(_raw("serve"))) and _no_overlap(labels)
    assert not legend.overlaps(fig._suptitle.get_window_extent(renderer))
    _assert_plain(fig, "serving_ratios")


def test_serving_ratios_of_the_committed_raw_plots_both_routers_and_pkv_graph():
    frame = _raw("serve")
    engines = ["adaptive", "adaptive:objective=overlapped", "pkv-graph"]
    assert figures.serving_engines(frame) == engines
    fig = figures.serving_ratios_figure(frame, smoke=False)
    _check_serving(fig, engines)
    assert fig._suptitle.get_text().startswith("Adaptive routes and pkv-graph over")
    only = frame[frame["engine"] != "adaptive:objective=overlapped"]
    only = only[only["engine"] != "pkv-graph"]                     # adaptive alone: its own title
    assert figures.serving_engines(only) == ["adaptive"]
    fig2 = figures.serving_ratios_figure(only, smoke=False)
    _check_serving(fig2, ["adaptive"])
    assert fig2._suptitle.get_text().startswith("Adaptive route over")
    plt.close(fig), plt.close(fig2)


def test_serving_ratios_plots_every_router_and_pkv_graph():
    frame = _serving_with_more_engines()
    engines = figures.serving_engines(frame)
    assert engines == ["adaptive", "adaptive:objective=overlapped", "pkv-graph"]
    fig = figures.serving_ratios_figure(frame, smoke=False)
    _check_serving(fig, engines)
    assert "objective=overlapped" in fig.axes[1].get_ylabel()
    assert "pkv-graph" in fig._suptitle.get_text()
    plt.close(fig)


# ---------------------------------------------------------------- every committed figure


@pytest.fixture
def saved(monkeypatch):
    """The figures savefig was called on (pyplot closes them after, they stay readable)."""
    seen = []
    original = matplotlib.figure.Figure.savefig

    def record(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    return seen


@pytest.mark.parametrize("path", sorted(RESULTS.glob("figures/*.png")), ids=lambda p: p.name)
def test_committed_figure_has_plain_non_overlapping_tick_labels(path, saved):
    assert _build_target(RESULTS, path, {})[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(saved) == 1
    fig = saved[0]
    if path.stem == "nsight" and not fig.axes[0].get_visible():
        return
    _assert_plain(fig, path.name)
    renderer = _renderer(fig)
    for ax in fig.axes:
        labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        if all(abs(t.get_rotation()) < 1 for t in ax.get_xticklabels()):
            assert _no_overlap(labels), f"{path.name}: x tick labels overlap"
    if path.stem == "latency_vs_context":
        left, right = fig.axes[:2]
        assert left.get_yscale() == "log" and len(right.get_lines()) < len(left.get_lines()) + 1


def test_launches_legend_clears_the_bars(saved):
    frame = _raw("serve")
    figures.draw("launches_per_step", frame, smoke=False)
    fig = saved[0]
    ax = fig.axes[0]
    renderer = _renderer(fig)
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, Rectangle) and p.get_height() > 0]
    assert bars and not any(legend.overlaps(b) for b in bars)
    labels = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
    assert _no_overlap(labels)
