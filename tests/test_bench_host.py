"""`pkv bench host` end to end on the CPU smoke profile: Parquet with provenance, the
Markdown table rendered from it, and the engine rows it could build."""

import json

import pandas as pd
import yaml

from pkv.bench.host import nearest_point
from pkv.cli.main import main
from pkv.config.resolve import effective, write_config
from pkv.core import io
from pkv.plan.costmodel import Constants
from pkv.report.host import markdown


def _constants(path):
    d = {"device": "cpu", "beta_bytes_per_s": 1e10, "launch_overhead_s": 1e-5, "sm_count": 2, "c_min": 1.0,
         "baseline_ctas_per_head": {"reference": 1.0}, "margins": [{"max_active": 1024, "margin": 1.05}],
         "supported_groups": [4], "min_context": 1, "min_tiles_per_split": 1,
         "operating_points": {"bucketed-b1": {"bucket": 4, "workqueue": 4},
                              "bimodal-b4": {"bucket": 2, "workqueue": 2}}}
    path.write_text(json.dumps(d))
    return path


def test_bench_host_smoke(tmp_path):
    cfg = effective(yaml.safe_load(open("config.yaml")), "smoke")
    write_config(cfg, tmp_path / "config.json")
    out = tmp_path / "host.parquet"
    rc = main(["bench", "host", "--config", str(tmp_path / "config.json"), "--constants",
               str(_constants(tmp_path / "constants.json")), "--out", str(out)])
    assert rc == 0
    frame = pd.read_parquet(out)
    # On the CPU: the pkv task-list engines, pkv-graph's oracle and the router; FlashInfer needs CUDA.
    assert set(frame["engine"]) == {"pkv-workqueue", "pkv-bucket", "adaptive", "pkv-graph"}
    assert (frame["error"] == "").all()
    assert sorted(frame["batch"].unique()) == [1, 4]
    assert (frame["prepare_us"] > 0).all() and (frame["wall_us"] >= frame["prepare_us"]).all()
    assert frame.loc[frame.engine == "adaptive", "route_us"].notna().all()
    meta = io.read_meta(out)
    assert meta["profile"] == "smoke" and "git_commit" in meta and meta["command"].startswith("pkv bench host")
    assert "| 4 | adaptive |" in markdown(frame, meta)   # the report target tables/host_path.md


def test_bar_and_missing_engines_render():
    frame = pd.DataFrame([
        dict(batch=8, engine="flashinfer", route="flashinfer", prepare_us=400.0, launch_us=60.0, wall_us=700.0,
             route_us=float("nan"), raw_plan_us=380.0, view_us=90.0, meets_bar=True, error=""),
        dict(batch=8, engine="pkv-graph", route=None, prepare_us=float("nan"), launch_us=float("nan"),
             wall_us=float("nan"), route_us=float("nan"), raw_plan_us=float("nan"), view_us=float("nan"),
             meets_bar=None, error="ImportError: no module pkv.engines.graph")])
    frame["meets_bar"] = frame["meets_bar"].astype("boolean")
    text = markdown(frame, {"command": "pkv bench host"})
    assert "| 8 | flashinfer | flashinfer | 400.0 | 60.0 | 700.0 |  | 380.0 | 90.0 | 1.05 | yes |" in text
    assert "| 8 | pkv-graph | not run: ImportError" in text


def test_nearest_point():
    k = Constants.from_dict(json.loads(_constants_text()))
    assert nearest_point(k, 1) == "bucketed-b1" and nearest_point(k, 128) == "bimodal-b8"


def _constants_text():
    return json.dumps({"device": "x", "beta_bytes_per_s": 1e12, "launch_overhead_s": 1e-5, "sm_count": 132,
                       "c_min": 1.0, "baseline_ctas_per_head": {"flashinfer": 4.0},
                       "margins": [{"max_active": 1024, "margin": 1.05}], "supported_groups": [4],
                       "min_context": 1, "min_tiles_per_split": 4,
                       "operating_points": {"bucketed-b1": {}, "homogeneous-b4": {}, "bimodal-b8": {}}})
