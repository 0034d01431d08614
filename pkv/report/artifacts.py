"""The tables and figures whose inputs are not one stage's rows: the kernel benchmark (its
features rows too) and the FP8 benchmarks, the host path, the router's regret and accuracy,
and the model step.

Each renderer takes the results folder and returns the file's bytes; pkv.report.spec
names them (`render=`), so `pkv report` builds them with the rest, all or none. Each
reads its own Parquet through its module's checked loader, from the paths below: the
ones the pipeline's rules write.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from pkv.core import io

KERNELS = "raw/kernels/sweep.parquet"
FP8_KERNELS = "raw/kernels/fp8.parquet"
FEATURE_KERNELS = "raw/kernels/features.parquet"
FP8_ACCURACY = "raw/fp8/accuracy.parquet"
KV_FP8 = "raw/kv_fp8"
HOST = "raw/host/host_path.parquet"


def _file(root: Path, rel: str) -> Path:
    path = root / rel
    if not path.is_file():
        from pkv.report.load import MissingStage

        raise MissingStage(f"no {path}; run its rule first (docs/pipeline.md)")
    return path


def kernels_md(root: Path) -> bytes:
    from pkv.report import kernels

    return kernels.table(*kernels.load(_file(root, KERNELS))).encode()


def kernel_ratio_png(root: Path) -> bytes:
    from pkv.report import kernels

    return kernels.figure(kernels.load(_file(root, KERNELS))[0])


def feature_kernels_md(root: Path) -> bytes:
    from pkv.report import features

    return features.table(*features.load(_file(root, FEATURE_KERNELS))).encode()


def fp8_kernels_md(root: Path) -> bytes:
    from pkv.report import fp8

    frame, meta = io.read_parquet_checked(_file(root, FP8_KERNELS), {"family", "point", "kv_dtype", "fp8_policy",
                                                                     "engine", "graph_us"}, "FP8 kernel benchmark")
    return fp8.kernels_table(frame, meta).encode()


def fp8_accuracy_md(root: Path) -> bytes:
    from pkv.report import fp8

    frame, meta = io.read_parquet_checked(_file(root, FP8_ACCURACY), {"data", "kv", "engine", "rel_rms", "error"},
                                          "FP8 accuracy")
    return fp8.accuracy_table(frame, meta).encode()


def fp8_serving_md(root: Path) -> bytes:
    from pkv.report import fp8

    files = sorted((root / KV_FP8).glob("*.parquet"))
    if not files:
        _file(root, KV_FP8 + "/s<seed>.parquet")   # raises MissingStage
    parts = [io.read_parquet_checked(p, {"seed", "kv_dtype", "engine", "graph_s", "wall_s"}, "kv_fp8 ablation")
             for p in files]
    commits = {m.get("git_commit") for _, m in parts}
    if len(commits) > 1:
        raise ValueError(f"{root / KV_FP8}: Parquets from different commits {sorted(map(str, commits))}: "
                         "rerun them together")
    return fp8.serving_table(pd.concat([f for f, _ in parts], ignore_index=True), parts[0][1]).encode()


def host_path_md(root: Path) -> bytes:
    from pkv.report.host import markdown

    path = _file(root, HOST)
    return markdown(pd.read_parquet(path), io.read_meta(path)).encode()


def router_regret_md(root: Path) -> bytes:
    from pkv.report import router

    _file(root, "calibration/constants.json")
    return router.regret_md(root).encode()


def router_accuracy_png(root: Path) -> bytes:
    from pkv.report import router

    _file(root, "calibration/constants.json")
    _file(root, "config.json")
    return router.accuracy_png(root)


def _model_step(root: Path):
    if not any((root / "raw" / "model_step").glob("*.parquet")):
        _file(root, "raw/model_step/s<seed>.parquet")
    from pkv.report import model

    return model


def model_step_md(root: Path) -> bytes:
    model = _model_step(root)

    return model.render_md(*model.load(root)).encode()


def model_step_png(root: Path) -> bytes:
    model = _model_step(root)

    frame, metas = model.load(root)
    return model.plot_model_step(frame, any(m.get("profile") == "smoke" for m in metas))


def claims_md(root: Path) -> bytes:
    from pkv.report import claims

    return claims.markdown(root).encode()
