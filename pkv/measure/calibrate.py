"""`pkv calibrate`: fit the cost model's constants on the device present, freeze them.

Measured here, never assumed: beta (streaming copy bandwidth), the SM count, and on the
calibration seed only, for every serving operating point, the split counts of the bucket
and workqueue routes (best wall throughput over the configured grid). The device terms
of the PersistentKV routes, C_min (occupancy target, CTAs per SM) and lambda (cost of one
launch inside the step's device span), are fitted jointly by least squares in log time
to the CUDA-event time of every PersistentKV row of the sweep; the host's back-to-back
launch overhead is recorded beside them (`launch_measured_s`) but is not lambda: a
decode launch costs the step its ramp-up and tail as well. Each baseline's effective
CTAs per (row, KV head) is the power of two whose roofline estimate best fits its
measured step times. Each route's host time per step (H_r: wall time outside the
CUDA-event span, i.e. planning and launch submission) is the median over the sweep,
and per operating point (`operating_points[point]["host_s"]`), since it grows with the
batch. Margins and gates are policy, copied from the config. On the CPU smoke profile
the same measurements run on the CPU (threads stand in for SMs) and the constants say so.

pkv-graph runs once per operating point (it has no split) beside the
baselines; its device fit (`fit_graph`: fixed cost, seconds per KV byte and per merge
byte, by non-negative least squares in relative error over its rows' device time and
counters) is `constants["graph"]`, and its host time is H_graph of fit_host_s.

The same split-0 run runs the host-scheduled routes once more, at the split
the grid just chose for the point (split 0 in their rows: "the engine's own", as in a serving
run), so that they too are graph-replayed: their device fits (`fit_route`, the roofline's
terms with each route's own coefficients, `constants["route_fit"]`) and their H_r are made on
replay, not on CUDA events, whose span holds the host's submission of the launches. The
split choice and C_min / lambda stay the split grid's (split-0 rows are not in them).

With `policy.fit_overlapped_margin`, the overlapped objective's margin is fitted last, by
replaying the router over the split-0 run's steps (pkv.measure.overlapped_margin); else
the config's `overlapped_margins`, if any, are copied like the serial margins.
"""

from __future__ import annotations

import dataclasses
import statistics
from itertools import combinations

import numpy as np
import pandas as pd
import torch

from pkv.config.resolve import device_of, point_key, shape_of
from pkv.config.typed import Config
from pkv.engines.table import PKV_KERNEL, pkv_engines, pkv_routes, route_key
from pkv.measure.loop import Job, measure
from pkv.measure.overlapped_margin import device_by_step, fit_overlapped_margin, with_device_scale
from pkv.measure.stages import build_cache, build_engines, steps_of, synthetic_trace, tolerance
from pkv.measure.sweep_rows import device_s, grid_rows, measured_s, replayed
from pkv.measure.timing import HostClock, sync
from pkv.plan.costmodel import BaselineFit, Constants, GraphFit, RouteCost, RouteFit, estimate
from pkv.plan.device_schedule import GRAPH_MIN_TILES, PIECE_COST

FIT_CTAS = tuple(2 ** i for i in range(8))


def bandwidth(device: str, nbytes: int, reps: int = 10) -> float:
    """Bytes moved per second (read + write) by a large device copy, median of `reps`."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        sync(device)
        clock = HostClock()
        dst.copy_(src)
        sync(device)
        times.append(clock.stop())
    return 2 * src.numel() / statistics.median(times)


def launch_overhead(device: str, samples: int) -> float:
    """Seconds per back-to-back launch of a one-element kernel (host launch cost)."""
    x = torch.zeros(1, device=device)
    for _ in range(10):
        x.add_(1)
    sync(device)
    clock = HostClock()
    for _ in range(samples):
        x.add_(1)
    sync(device)
    return clock.stop() / samples


def sm_count(device: str) -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else torch.get_num_threads()


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "cpu (smoke stand-in for a GPU)"


def scheduled_routes() -> dict[str, str]:
    """The router's host-scheduled routes (a split per operating point): name -> kind."""
    return {n: k for n, k in pkv_routes().items() if n in pkv_engines()}


def unscheduled_routes() -> list[str]:
    """The router's routes that decide their own split (pkv-graph): measured once per point."""
    return [n for n in pkv_routes() if n not in pkv_engines()]


def sweep(cfg: Config | dict, provisional: Constants) -> pd.DataFrame:
    """Every serving point on the calibration seed: baselines and the host-scheduled PKV
    routes per split, then once more (split 0: the engine's own) the baselines, pkv-graph
    and the host-scheduled routes at the split the grid chose for the point."""
    t = Config.of(cfg)
    c = t.calibration
    seed = t.seeds.calibration
    shape = shape_of({"shape": t.to_dict()["shape"]})
    frames = []
    for p in t.serving:
        trace = synthetic_trace(t, p.family, seed)
        cache = build_cache(t, trace, shape, t.measure.holes, seed)
        steps = steps_of(trace, p.max_active, c.max_steps)
        point = point_key(p.family, p.max_active)
        grid = []
        for split in c.split_grid:
            engines = build_engines([*t.baselines, *scheduled_routes()], cache, provisional, point, split)
            job = Job("calibrate", trace.name, p.family, p.max_active, seed, shape.group, split)
            grid.append(measure(job, cache, steps, engines, t.baselines[0], tolerance(t), t.measure.reference_every,
                                graph=False))
        frames += grid
        # The split-0 run also replays each step's CUDA graph (where the config times
        # graphs): the device time the baselines', pkv-graph's and the scheduled routes'
        # fits are made on. Its scheduled routes run at the splits just chosen.
        chosen = operating_points(pd.concat(grid, ignore_index=True))[point]
        k = dataclasses.replace(provisional, operating_points={**provisional.operating_points, point: chosen})
        engines = build_engines([*t.baselines, *unscheduled_routes(), *scheduled_routes()], cache, k, point)
        job = Job("calibrate", trace.name, p.family, p.max_active, seed, shape.group, 0)
        frames.append(measure(job, cache, steps, engines, t.baselines[0], tolerance(t), t.measure.reference_every,
                              graph=t.measure.graph))
    return pd.concat(frames, ignore_index=True)


def _throughput(rows: pd.DataFrame) -> float:
    return rows["active"].sum() / rows["wall_s"].sum()


def _best_split(rows: pd.DataFrame) -> int:
    """The split of the route's rows with the best wall throughput; ties to the smaller."""
    return int(max(sorted(rows["split"].unique()), key=lambda s: _throughput(rows[rows["split"] == s])))


def operating_points(frame: pd.DataFrame) -> dict:
    """(family, batch) -> {kind: split with the best wall throughput over the split grid;
    ties to the smaller}."""
    points = {}
    for (family, batch), rows in grid_rows(frame).groupby(["family", "max_active"], sort=True):
        points[point_key(family, int(batch))] = {
            kind: _best_split(rows[rows["engine"] == name]) for name, kind in scheduled_routes().items()
        }
    return points


def _relative_fit(features: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, float]:
    """Non-negative coefficients minimizing the squared relative error, and its rms log error."""
    x = nonnegative_lstsq(features / measured[:, None], np.ones(len(measured)))
    return x, _rms_log_err(features @ x, measured)


def _rms_log_err(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.log(predicted / measured) ** 2)))


def _stall(occupancy: np.ndarray, c_min: float) -> np.ndarray:
    """pkv.plan.costmodel.occupancy_stall over rows (occupancy = decode CTAs per SM)."""
    return np.where(occupancy > 0, np.maximum(1.0, c_min / np.maximum(occupancy, 1e-12)), c_min)


FIT_C_MIN = tuple(round(0.25 + 0.05 * i, 2) for i in range(76))      # 0.25 .. 4.0 CTAs per SM
FIT_LAUNCH_S = tuple(0.5e-6 * i for i in range(101))                   # 0 .. 50 us per launch


def fit_device_terms(frame: pd.DataFrame, beta: float, sm_count: int) -> tuple[float, float]:
    """(C_min, lambda) minimizing the squared log error of the PersistentKV routes' device
    estimate (pkv.plan.costmodel.estimate without H_r) against their measured step time (CUDA
    events; wall time where none were timed), over every PersistentKV row of the sweep.

    Why fitted, not set: a heuristic (C_min = CTA work per SM of the best bucket split at
    the lowest batch, lambda = back-to-back launch overhead on the host) makes the
    occupancy stall too steep and launches too cheap: at bimodal B4 it costs the
    workqueue's CTAs at a multiple of the bytes time and the bucket route's launches at
    little, so the router takes the bucket route, which runs slower on every measure."""
    frame = grid_rows(frame)
    rows = frame[frame["engine"].isin(list(scheduled_routes())) & frame["decode_ctas"].notna()]
    if rows.empty:
        raise ValueError("no PersistentKV rows to fit C_min and lambda on")
    measured = measured_s(rows)
    bytes_t = rows["useful_kv_bytes"].to_numpy() / beta
    merge_t = rows["merge_bytes"].to_numpy() / beta
    occupancy = rows["decode_ctas"].to_numpy() / sm_count
    launches = rows["launches"].to_numpy()
    log_measured = np.log(measured)
    best = None
    for c_min in FIT_C_MIN:
        stall = _stall(occupancy, c_min)
        fixed = bytes_t * stall + merge_t
        for lam in FIT_LAUNCH_S:
            loss = float(np.sum((np.log(fixed + launches * lam) - log_measured) ** 2))
            if best is None or loss < best[0]:
                best = (loss, c_min, lam)
    return float(best[1]), float(best[2])


def fit_baseline_ctas(frame: pd.DataFrame, baseline: str, k: Constants, kv_bytes_per_token: int,
                      num_kv_heads: int) -> float:
    rows = frame[frame["engine"] == baseline]
    measured = measured_s(rows)

    def loss(ctas: int) -> float:
        model = [estimate(RouteCost(baseline, t * kv_bytes_per_token, a * num_kv_heads * ctas, 1, 0.0), k)
                 for t, a in zip(rows["total_tokens"], rows["active"])]
        return float(np.sum((np.log(model) - np.log(measured)) ** 2))

    return float(min(FIT_CTAS, key=loss))


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0, by trying every support (a handful of columns here)."""
    best = (np.inf, np.zeros(a.shape[1]))
    cols = range(a.shape[1])
    for size in range(1, a.shape[1] + 1):
        for support in combinations(cols, size):
            x = np.zeros(a.shape[1])
            x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
            if (x >= 0).all():
                loss = float(np.sum((a @ x - b) ** 2))
                if loss < best[0]:
                    best = (loss, x)
    return best[1]


def fit_graph(frame: pd.DataFrame, min_tiles: int = GRAPH_MIN_TILES, piece_cost: int = PIECE_COST) -> dict | None:
    """pkv-graph's GraphFit from its rows of the sweep, or None where it has none: the
    coefficients of T = fixed + KV bytes * a + merge bytes * b, non-negative, minimizing
    the squared relative error against the measured device time. The grid (num_ctas) is
    the rows' own: CTAs with work + CTAs without."""
    rows = replayed(frame[(frame["engine"] == PKV_KERNEL) & frame["decode_ctas"].notna()])
    if rows.empty:
        return None
    grids = (rows["decode_ctas"] + rows["empty_ctas"]).unique()
    if len(grids) != 1:
        raise ValueError(f"pkv-graph rows of the sweep ran on several grids: {sorted(grids)}")
    features = np.column_stack([np.ones(len(rows)), rows["useful_kv_bytes"].to_numpy(), rows["merge_bytes"].to_numpy()])
    x, err = _relative_fit(features, device_s(rows))
    fit = GraphFit(float(x[0]), float(x[1]), float(x[2]), int(grids[0]), int(min_tiles), int(piece_cost))
    return {**{key: getattr(fit, key) for key in GraphFit.KEYS}, "rows": int(len(rows)), "rms_log_err": err}


def fit_baseline(frame: pd.DataFrame, baseline: str, kv_bytes_per_token: int) -> dict | None:
    """A FlashInfer route's BaselineFit from its rows of the sweep (the graph-replayed ones
    where there are any), or None without rows: T = fixed + KV bytes * a + rows * b,
    non-negative, minimizing the squared relative error against the device time."""
    rows = replayed(frame[frame["engine"] == baseline])
    if rows.empty:
        return None
    features = np.column_stack([np.ones(len(rows)), rows["total_tokens"].to_numpy(dtype=float) * kv_bytes_per_token,
                                rows["active"].to_numpy(dtype=float)])
    x, err = _relative_fit(features, device_s(rows))
    fit = BaselineFit(*map(float, x))
    return {**{key: getattr(fit, key) for key in BaselineFit.KEYS}, "rows": int(len(rows)), "rms_log_err": err}


def fit_route(frame: pd.DataFrame, engine: str, sm_count: int) -> dict | None:
    """A host-scheduled route's RouteFit from its split-0 rows of the sweep (those the frozen
    split ran; graph-replayed where there are any), or None without them (a sweep without
    the split-0 run) or where the fit would price a step at zero: T = fixed + KV bytes * a *
    max(1, C / occupancy) + merge bytes * b + launches * l, the coefficients non-negative and
    minimizing the squared relative error against the device time, C the best of the
    FIT_C_MIN grid (occupancy = decode CTAs / SMs).

    Plus the longest task's KV bytes * t (`task_kv_bytes`, one CTA's read): with fewer CTAs
    than SMs the step waits for its longest task, which total bytes over occupancy do not
    see (a route with few CTAs runs over an estimate without the term on a held-out seed).
    Rows without the column fit t = 0."""
    rows = frame[(frame["engine"] == engine) & (frame["split"] == 0) & frame["decode_ctas"].notna()]
    rows = replayed(rows)
    if rows.empty:
        return None
    measured = device_s(rows)
    kv = rows["useful_kv_bytes"].to_numpy(dtype=float)
    occupancy = rows["decode_ctas"].to_numpy(dtype=float) / sm_count
    task = rows["task_kv_bytes"].fillna(0.0) if "task_kv_bytes" in rows else pd.Series(0.0, index=rows.index)
    rest = [rows["merge_bytes"].to_numpy(dtype=float), rows["launches"].to_numpy(dtype=float),
            task.to_numpy(dtype=float)]
    best = None
    for c_min in FIT_C_MIN:
        stall = _stall(occupancy, c_min)
        features = np.column_stack([np.ones(len(rows)), kv * stall, *rest])
        x = nonnegative_lstsq(features / measured[:, None], np.ones(len(measured)))
        loss = float(np.sum((features @ x / measured - 1) ** 2))
        if best is None or loss < best[0]:
            best = (loss, c_min, x, features)
    _, c_min, x, features = best
    if float(np.min(features[:, [0, 1, 3, 4]] @ x[[0, 1, 3, 4]])) <= 1e-3 * float(measured.min()):
        # Every step has KV bytes and a launch: a fit whose fixed, byte and launch terms come
        # to ~nothing prices a step without a split at zero (the CPU smoke's timings can do
        # that). No fit is better: the shared roofline costs the route, as without split-0 rows.
        return None
    fit = RouteFit(float(x[0]), float(x[1]), float(c_min), float(x[2]), float(x[3]), float(x[4]))
    err = _rms_log_err(features @ x, measured)
    return {**{key: getattr(fit, key) for key in RouteFit.KEYS}, "rows": int(len(rows)), "rms_log_err": err}


def fit_host_s(frame: pd.DataFrame) -> dict:
    """Route -> median seconds per step the host spends outside the device span; empty
    where nothing was timed with CUDA events (the CPU smoke profile). The span is the one
    the route's device fit is made on: graph replay for a route with replayed rows (the
    baselines, pkv-graph), else CUDA events, so device + H_r is the step's wall time."""
    out = {}
    for engine, rows in frame[frame["cuda_s"].notna()].groupby("engine", sort=True):
        rows = replayed(rows)
        out[route_key(engine)] = float(np.median(np.clip(rows["wall_s"].to_numpy() - device_s(rows), 0.0, None)))
    return out


def fit_host_s_by_point(frame: pd.DataFrame) -> dict:
    """Operating point -> fit_host_s of that point's rows (H_r grows with the batch: at B1
    the bucket route's host path is shorter than the workqueue's, at B8 not)."""
    return {point_key(family, int(batch)): fit_host_s(rows)
            for (family, batch), rows in frame.groupby(["family", "max_active"], sort=True)}


def fit_constants(constants: dict, frame: pd.DataFrame, baselines: list[str], kv_bytes_per_token: int,
                  num_kv_heads: int) -> dict:
    """The fitted part of constants.json from a calibration sweep (`frame`): operating
    points with their host times, C_min and lambda, the baselines' CTAs, H_r. Runs on
    the CPU, so a committed sweep can be refitted offline."""
    out = dict(constants)
    out.setdefault("launch_measured_s", out["launch_overhead_s"])
    points = operating_points(frame)
    for point, host in fit_host_s_by_point(frame).items():
        if host:
            points[point]["host_s"] = host
    out["operating_points"] = points
    out["c_min"], out["launch_overhead_s"] = fit_device_terms(frame, out["beta_bytes_per_s"], out["sm_count"])
    k = Constants.from_dict(out)
    out["baseline_ctas_per_head"] = {b: fit_baseline_ctas(frame, b, k, kv_bytes_per_token, num_kv_heads)
                                     for b in baselines}
    # After the CTA fit, which models device time only.
    out["host_s"] = fit_host_s(frame)
    # The host-scheduled routes' own device fits (sweeps without their split-0 rows have
    # none and keep the roofline above).
    routes = {kind: fit_route(frame, name, out["sm_count"]) for name, kind in scheduled_routes().items()}
    if any(f is not None for f in routes.values()):
        out["route_fit"] = {kind: f for kind, f in routes.items() if f is not None}
    # A refit of a committed sweep: its pkv-graph rows ran on the cut its constants name
    # (GraphFit.from_dict: none named, so 0); a fresh sweep on the code's.
    base = GraphFit.from_dict(constants["graph"]) if "graph" in constants else None
    cut = (base.min_tiles, base.piece_cost) if base is not None else (GRAPH_MIN_TILES, PIECE_COST)
    graph = fit_graph(frame, *cut)
    if graph is not None:
        out["graph"] = graph
        # The baselines' own device fits (with pkv-graph's: constants without a graph fit
        # keep the roofline for every route).
        fits = {b: fit_baseline(frame, b, kv_bytes_per_token) for b in baselines}
        out["baseline_fit"] = {b: f for b, f in fits.items() if f is not None}
    return out


def calibrate(cfg: Config | dict) -> tuple[dict, pd.DataFrame]:
    """(constants.json content, the calibration sweep's rows)."""
    t = Config.of(cfg)
    device = device_of(t)
    c = t.calibration
    policy = t.to_dict()["policy"]   # copied into constants.json as the config has it
    shape = shape_of({"shape": t.to_dict()["shape"]})
    measured = {
        "beta_bytes_per_s": bandwidth(device, c.bandwidth_bytes),
        "launch_overhead_s": launch_overhead(device, c.launch_samples),
        "sm_count": sm_count(device),
    }
    measured["launch_measured_s"] = measured["launch_overhead_s"]
    constants = {
        "device": device_name(device), "profile": t.profile, "calibration_seed": t.seeds.calibration,
        **measured, "c_min": 1.0, "baseline_ctas_per_head": {b: 1.0 for b in t.baselines},
        "margins": policy["margins"], "supported_groups": policy["supported_groups"],
        "min_context": policy["min_context"], "min_tiles_per_split": policy["min_tiles_per_split"],
        **({"overlapped_margins": policy["overlapped_margins"]} if "overlapped_margins" in policy else {}),
    }
    frame = sweep(t, Constants.from_dict(constants))
    constants = fit_constants(constants, frame, list(t.baselines), shape.kv_bytes_per_token, shape.num_kv_heads)
    device, scheduled = device_by_step(frame), sorted(scheduled_routes().values())
    constants = with_device_scale(t, constants, device, scheduled)   # before the margin: it is fitted on them
    if t.policy.fit_overlapped_margin:
        constants.update(fit_overlapped_margin(t, constants, device, scheduled) or {})
    return constants, frame
