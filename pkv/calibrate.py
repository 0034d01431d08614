"""`pkv calibrate`: fit the cost model's constants on the device present, freeze them.

Measured here, never assumed: beta (streaming copy bandwidth), lambda (per-launch host
overhead), the SM count, and on the calibration seed only, for every serving operating
point, the split counts of the bucket and workqueue routes (best wall throughput over
the configured grid). C_min is the CTA work per SM of the best bucket split at the
lowest-batch point (where splitting is the only source of CTAs); each baseline's
effective CTAs per (row, KV head) is the power of two whose roofline estimate best fits
its measured step times (least squares in log time). Each route's host time per step
(H_r: wall time outside the CUDA-event span, i.e. planning and launch submission) is
the median over the sweep. Margins and gates are policy,
copied from the config. On the CPU smoke profile the same measurements run on the CPU
(threads stand in for SMs) and the constants say so.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import pandas as pd
import torch

from pkv.costmodel import Constants, RouteCost, estimate
from pkv.measure import Job, measure
from pkv.measure_config import device_of, point_key, shape_of
from pkv.measure_stages import build_cache, build_engines, steps_of, synthetic_trace, tolerance
from pkv.timing import sync

PKV_KINDS = ("bucket", "workqueue")
FIT_CTAS = tuple(2 ** i for i in range(8))


def bandwidth(device: str, nbytes: int, reps: int = 10) -> float:
    """Bytes moved per second (read + write) by a large device copy, median of `reps`."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times)


def launch_overhead(device: str, samples: int) -> float:
    """Seconds per back-to-back launch of a one-element kernel (host launch cost)."""
    x = torch.zeros(1, device=device)
    for _ in range(10):
        x.add_(1)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(samples):
        x.add_(1)
    sync(device)
    return (time.perf_counter() - t0) / samples


def sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else torch.get_num_threads()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke stand-in for a GPU)"


def sweep(cfg: dict, provisional: Constants) -> pd.DataFrame:
    """Every serving point on the calibration seed: baselines and both PKV routes per split."""
    c = cfg["calibration"]
    seed = cfg["seeds"]["calibration"]
    shape = shape_of(cfg)
    frames = []
    for p in cfg["serving"]:
        trace = synthetic_trace(cfg, p["family"], seed)
        cache = build_cache(cfg, trace, shape, cfg["measure"]["holes"], seed)
        steps = steps_of(trace, p["max_active"], c["max_steps"])
        for split in c["split_grid"]:
            specs = [*cfg["baselines"], *(f"pkv-{kind}" for kind in PKV_KINDS)]
            engines = build_engines(specs, cache, provisional, point_key(p["family"], p["max_active"]), split)
            job = Job("calibrate", trace.name, p["family"], p["max_active"], seed, shape.group, split)
            frames.append(measure(job, cache, steps, engines, cfg["baselines"][0], tolerance(cfg),
                                  cfg["measure"]["reference_every"], graph=False))
    return pd.concat(frames, ignore_index=True)


def _throughput(rows: pd.DataFrame) -> float:
    return rows["active"].sum() / rows["wall_s"].sum()


def operating_points(frame: pd.DataFrame) -> dict:
    """(family, batch) -> {kind: split with the best wall throughput; ties to the smaller}."""
    points = {}
    for (family, batch), rows in frame.groupby(["family", "max_active"], sort=True):
        points[point_key(family, int(batch))] = {
            kind: int(max(sorted(rows["split"].unique()),
                          key=lambda s: _throughput(rows[(rows["engine"] == f"pkv-{kind}") & (rows["split"] == s)])))
            for kind in PKV_KINDS
        }
    return points


def fit_c_min(frame: pd.DataFrame, points: dict) -> float:
    lowest = frame[frame["max_active"] == frame["max_active"].min()]
    family, batch = lowest["family"].iloc[0], int(lowest["max_active"].iloc[0])
    best = points[point_key(family, batch)]["bucket"]
    rows = lowest[(lowest["family"] == family) & (lowest["engine"] == "pkv-bucket") & (lowest["split"] == best)]
    return max(1.0, float(rows["cta_work_per_sm"].median()))


def fit_baseline_ctas(frame: pd.DataFrame, baseline: str, k: Constants, kv_bytes_per_token: int, num_kv_heads: int) -> float:
    rows = frame[frame["engine"] == baseline]
    measured = rows["cuda_s"].where(rows["cuda_s"].notna(), rows["wall_s"]).to_numpy()

    def loss(ctas: int) -> float:
        model = [estimate(RouteCost(baseline, t * kv_bytes_per_token, a * num_kv_heads * ctas, 1, 0.0), k)
                 for t, a in zip(rows["total_tokens"], rows["active"])]
        return float(np.sum((np.log(model) - np.log(measured)) ** 2))

    return float(min(FIT_CTAS, key=loss))


def fit_host_s(frame: pd.DataFrame) -> dict:
    """Route -> median seconds per step the host spends outside the device span; empty
    where nothing was timed with CUDA events (the CPU smoke profile)."""
    timed = frame[frame["cuda_s"].notna()]
    host = (timed["wall_s"] - timed["cuda_s"]).clip(lower=0.0)
    return {engine.removeprefix("pkv-"): float(h.median()) for engine, h in host.groupby(timed["engine"], sort=True)}


def calibrate(cfg: dict) -> tuple[dict, pd.DataFrame]:
    """(constants.json content, the calibration sweep's rows)."""
    device = device_of(cfg)
    c, policy = cfg["calibration"], cfg["policy"]
    shape = shape_of(cfg)
    measured = {
        "beta_bytes_per_s": bandwidth(device, c["bandwidth_bytes"]),
        "launch_overhead_s": launch_overhead(device, c["launch_samples"]),
        "sm_count": sm_count(device),
    }
    constants = {
        "device": device_name(device), "profile": cfg["profile"], "calibration_seed": cfg["seeds"]["calibration"],
        **measured, "c_min": 1.0, "baseline_ctas_per_head": {b: 1.0 for b in cfg["baselines"]},
        "margins": policy["margins"], "supported_groups": policy["supported_groups"],
        "min_context": policy["min_context"], "min_tiles_per_split": policy["min_tiles_per_split"],
    }
    frame = sweep(cfg, Constants.from_dict(constants))
    constants["operating_points"] = operating_points(frame)
    constants["c_min"] = fit_c_min(frame, constants["operating_points"])
    k = Constants.from_dict(constants)
    constants["baseline_ctas_per_head"] = {
        b: fit_baseline_ctas(frame, b, k, shape.kv_bytes_per_token, shape.num_kv_heads) for b in cfg["baselines"]}
    # After the CTA fit, which models device time only.
    constants["host_s"] = fit_host_s(frame)
    return constants, frame
