"""pkv.report.tables on constructed Parquet: ratio arithmetic, determinism, one GPU model per folder."""

import math

import pandas as pd
import pytest

from pkv.core.io import write_parquet
from pkv.measure.loop import COLUMNS
from pkv.report.tables import build_report, load, ratios


def _rows(engine, wall, cuda, seed=20260623, active=4, route=None, family="bimodal", max_active=8):
    base = {c: 0 for c in COLUMNS}
    base.update(stage="serve", trace=f"{family}-{seed}", family=family, max_active=max_active, seed=seed,
                engine=engine, route=route or engine, group=4, layers=1, active=active, total_tokens=4000,
                max_len=2000, graph_s=math.nan, estimate_s=math.nan, launches=1, cta_work_per_sm=math.nan)
    for c in ("decode_launches", "merge_launches", "extra_launches", "decode_ctas", "empty_ctas",
              "useful_kv_bytes", "read_kv_bytes", "merge_bytes", "ref_max_abs_err", "ref_mean_abs_err"):
        base[c] = math.nan
    return [{**base, "step": s, "wall_s": wall, "cuda_s": cuda} for s in range(3)]


def _frame(*groups):
    return pd.DataFrame([r for g in groups for r in g], columns=list(COLUMNS)).astype(COLUMNS)


def _write(root, name, frame, gpu="NVIDIA H200"):
    meta = {"gpu": gpu, "profile": "paper", "torch": "2.11", "flashinfer": "0.7.2.post1", "cuda": "12.8",
            "config_hash": "c", "constants_hash": "k", "git_commit": "g"}
    write_parquet(frame, root / "raw" / "serve" / f"{name}.parquet", meta)


def test_ratio_is_over_the_faster_baseline_per_timing():
    f = _frame(_rows("flashinfer", wall=2.0, cuda=1.0), _rows("flashinfer-tc", wall=3.0, cuda=0.5),
               _rows("adaptive", wall=1.0, cuda=1.0))
    r = ratios(f, ["seed"]).set_index("engine")
    assert r.loc["adaptive", "wall_ratio"] == pytest.approx(2.0)   # vs flashinfer (faster wall)
    assert r.loc["adaptive", "cuda_ratio"] == pytest.approx(0.5)   # vs flashinfer-tc (faster device)
    assert math.isnan(r.loc["adaptive", "graph_ratio"])            # no graph timing taken
    assert r.loc["adaptive", "wall_tps"] == pytest.approx(4 / 1.0)


def test_serving_table_is_deterministic_and_reads_parquet_only(tmp_path):
    for seed, wall in ((20260623, 1.0), (20260624, 1.25)):
        _write(tmp_path, f"s{seed}", _frame(_rows("flashinfer", 2.0, 1.0, seed), _rows("flashinfer-tc", 3.0, 0.5, seed),
                                             _rows("adaptive", wall, 1.0, seed, route="pkv-workqueue/s20")))
    target = tmp_path / "tables" / "serving.md"
    build_report(tmp_path, [target])
    first = target.read_bytes()
    build_report(tmp_path, [target])
    assert target.read_bytes() == first
    text = first.decode()
    assert "| Bimodal B8 " in text and "pkv-workqueue/s20" in text
    assert "1.800±0.283" in text        # wall ratios 2.0 and 1.6 over two seeds
    assert "CPU smoke" not in text


def test_mixed_gpu_models_are_refused(tmp_path):
    _write(tmp_path, "a", _frame(_rows("flashinfer", 1, 1), _rows("adaptive", 1, 1)), gpu="NVIDIA H200")
    _write(tmp_path, "b", _frame(_rows("flashinfer", 1, 1, seed=20260624), _rows("adaptive", 1, 1, seed=20260624)),
           gpu="NVIDIA A100")
    with pytest.raises(ValueError, match="several GPU models"):
        load(tmp_path, ("serve",))


def test_unknown_target_and_missing_stage_fail_clearly(tmp_path):
    (tmp_path / "raw").mkdir()   # a results folder with nothing measured yet
    with pytest.raises(ValueError, match="unknown report target"):
        build_report(tmp_path, [tmp_path / "tables" / "nope.md"])
    with pytest.raises(ValueError, match="no Parquet under"):
        build_report(tmp_path, [tmp_path / "tables" / "serving.md"])


def test_whole_report_of_a_partly_measured_folder_skips_unmeasured_stages(tmp_path):
    _write(tmp_path, "s", _frame(_rows("flashinfer", 2.0, 1.0), _rows("adaptive", 1.0, 1.0)))
    skipped = []
    written = build_report(tmp_path, [], on_missing=lambda path, why: skipped.append((path.name, why)))
    assert tmp_path / "tables" / "serving.md" in written and (tmp_path / "tables" / "serving.md").is_file()
    assert ("isolated.md", f"no Parquet under {tmp_path / 'raw' / 'isolated'}; run the stage first") in skipped
    assert not (tmp_path / "tables" / "isolated.md").exists()
    with pytest.raises(ValueError, match="no Parquet under"):
        build_report(tmp_path, [])   # without on_missing, a missing stage still fails


def test_coverage_has_a_row_per_router_engine():
    """Table 6 lists every adaptive engine's regimes (`adaptive:objective=overlapped` labelled
    by its objective); with plain `adaptive` alone its rows are the committed table's."""
    from pathlib import Path
    from types import SimpleNamespace

    from pkv.report.tables import t_coverage

    files = sorted((Path("results") / "raw" / "serve").glob("*.parquet"))
    f = pd.concat([pd.read_parquet(p) for p in files], ignore_index=True)
    f = f[f["engine"] != "adaptive:objective=overlapped"]       # the committed run has both routers
    plain = t_coverage(SimpleNamespace(frame=f))
    over = f[f["engine"] == "adaptive"].assign(engine="adaptive:objective=overlapped")
    both = t_coverage(SimpleNamespace(frame=pd.concat([f, over], ignore_index=True)))
    assert len(both) == 2 * len(plain)
    pd.testing.assert_frame_equal(both.iloc[:len(plain)].reset_index(drop=True), plain)
    assert set(both["Regime"].iloc[len(plain):]) == {f"{r} · objective=overlapped" for r in plain["Regime"]}


def test_pkv_report_removes_a_table_whose_inputs_are_gone(tmp_path, capsys):
    """By hand as in the pipeline: a table left from an earlier report whose stage's files are
    gone is removed (and said), never left stale beside the fresh ones."""
    from pkv.cli.main import main

    _write(tmp_path, "s", _frame(_rows("flashinfer", 2.0, 1.0), _rows("adaptive", 1.0, 1.0)))
    stale = tmp_path / "tables" / "isolated.md"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("from a run whose raw/isolated/ files are gone\n")
    assert main(["report", str(tmp_path)]) == 0
    assert not stale.exists() and (tmp_path / "tables" / "serving.md").is_file()
    assert f"skipped {stale} (removed the stale one)" in capsys.readouterr().err
