"""The calibrated roofline route policy of paper §3.5.

For every candidate route r of a decode step

    T_r = KVBytes_r / beta * max(1, C_min / C_r) + L_r * lambda + MergeBytes_r / beta + H_r

with C_r the decode CTA work per SM, L_r the launch count and H_r the route's host time
per step outside the device span (planning, launch submission). H_r extends the paper's
device-time roofline: serving pays for it every step, and on a fast GPU it is a large part
of a short step, FlashInfer's plan() more than our prepare(), so a device-only model keeps
FlashInfer where it loses on wall time. A route with no calibrated H_r (CPU smoke,
hand-built constants) is costed at 0. FlashInfer routes are estimated with one launch and
`baseline_ctas_per_head[r]` CTAs per (row, KV head), the effective split its own planner
exposes, fitted at calibration. A PersistentKV route must pass the eligibility gates
(calibrated GQA group, long enough context) and beat the best FlashInfer estimate by the
promotion margin for the step's active count.

Where the constants hold a route's own fit, that fit replaces the shared roofline's device term:

- pkv-graph (route key "graph", `GraphFit`) has no host plan and decides its split on the
  GPU, so the roofline does not describe it:
  T = fixed_s + KVBytes * s_per_kv_byte + MergeBytes * s_per_merge_byte
  (one launch plus the merge, streaming, and the partial states of the segments the device
  rule cuts: pkv.plan.device_schedule's rule counted by `graph_counts`). Its H_r is its
  prepare() (one metadata upload). Constants without a GraphFit do not offer pkv-graph.
- A FlashInfer route (`BaselineFit`): T = fixed_s + KVBytes * s_per_kv_byte + rows * s_per_row,
  fitted per variant on its device time. The roofline's one free parameter (CTAs per head)
  cannot tell FlashInfer's CUDA-core decode from its tensor-core one.
- A host-scheduled PersistentKV route (bucket, workqueue; `RouteFit`): the roofline's form
  with the route's own coefficients, fitted on its graph-replayed calibration rows at its
  frozen split,
  T = fixed_s + KVBytes * s_per_kv_byte * max(1, c_min / C_r) + MergeBytes * s_per_merge_byte
      + L_r * s_per_launch + TaskBytes * s_per_task_byte.
  The shared roofline's C_min and lambda are fitted on CUDA events of the split grid, whose
  span holds the host's submission of the launches, and so overprice these routes' device
  time. TaskBytes is the longest task's KV bytes: with fewer CTAs than SMs a step waits for
  it (a fit without the term has s_per_task_byte 0).

A route's device estimate at a calibrated operating point is multiplied by that point's
`device_scale` for the route: measured over estimated device time, summed over the
calibration seed's steps of that point (pkv.measure.overlapped_margin). One closed form per
route leaves errors that are systematic per trace family and of the size of the differences
between the routes; the scale takes them out. Points without a scale (traces outside the
serving grid, constants without scales) keep factor 1.

The objective says what a step costs: `serial` (device + H_r: the paper's synchronized
loop, the default) or `overlapped` (device time only: a scheduler that hides host work
behind the GPU). The overlapped objective promotes by its own margins where the config sets
them (`policy.overlapped_margins`), else by the serial ones: a margin m keeps FlashInfer where
a route is up to m times faster, so a bar b of the best fixed route on device time needs
m <= 1/b at the batches where the routes are that close.
All constants come from `constants.json` written by `pkv calibrate` on the GPU present.

This module is long because the Router's per-step fast path and the route cost functions
(bucket_cost, workqueue_cost, graph_cost) share one definition of each route's counts
(bucket_counts, workqueue_counts, graph_counts), each with a plain-int path for a few rows
and a numpy path for many: both stay in one file so that a change to one is made beside
the other (tests check they agree with the schedules they count).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from pkv.core.shape import Shape
from pkv.plan.device_schedule import ONE_QUERY, PIECE_COST, SHORT_TILES, Queries, grid_ctas, setup_units
from pkv.plan.schedule import TILE_TOKENS, SplitPolicy, num_tiles, slot_bytes, workqueue_row_splits

OBJECTIVES = ("serial", "overlapped")   # the words of pkv.engines.table.ENUM_OPTIONS["objective"]
GRAPH = "graph"                          # pkv-graph's route key (pkv.engines.table.pkv_routes)
SMALL_ROWS = 48                          # up to this many rows, plain Python ints beat numpy's per-call overhead


@dataclass(frozen=True)
class GraphFit:
    """pkv-graph's fitted device time (its closed form in the module docstring) and the grid it was fitted on."""

    fixed_s: float            # launch, length scan and merge-kernel latency of a step
    s_per_kv_byte: float      # 1 / streaming bandwidth of the single launch
    s_per_merge_byte: float   # per partial-state byte of the cut segments (written, then merged)
    num_ctas: int             # the grid the calibration ran (CTAs/SM x SMs)
    min_tiles: int            # the smallest CTA range, in tiles
    piece_cost: int = 0       # set-up units in front of a short segment; constants without it: 0

    KEYS = ("fixed_s", "s_per_kv_byte", "s_per_merge_byte", "num_ctas", "min_tiles", "piece_cost")

    def __post_init__(self) -> None:
        if (min(self.fixed_s, self.s_per_kv_byte, self.s_per_merge_byte) < 0 or self.num_ctas < 1 or self.min_tiles < 1
                or self.piece_cost < 0):
            raise ValueError(f"graph fit out of range: {self}")

    def device_s(self, cost: "RouteCost") -> float:
        return self.fixed_s + cost.kv_bytes * self.s_per_kv_byte + cost.merge_bytes * self.s_per_merge_byte

    @classmethod
    def from_dict(cls, d: dict) -> "GraphFit":
        return cls(float(d["fixed_s"]), float(d["s_per_kv_byte"]), float(d["s_per_merge_byte"]), int(d["num_ctas"]),
                   int(d["min_tiles"]), int(d.get("piece_cost", 0)))


@dataclass(frozen=True)
class BaselineFit:
    """A FlashInfer route's fitted device time: fixed + bytes streamed + a per-row term
    (its planner's work units and merge grow with the rows)."""

    fixed_s: float
    s_per_kv_byte: float
    s_per_row: float

    KEYS = ("fixed_s", "s_per_kv_byte", "s_per_row")

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.s_per_kv_byte, self.s_per_row) < 0:
            raise ValueError(f"baseline fit out of range: {self}")

    def device_s(self, cost: "RouteCost") -> float:
        return self.fixed_s + cost.kv_bytes * self.s_per_kv_byte + cost.rows * self.s_per_row

    @classmethod
    def from_dict(cls, d: dict) -> "BaselineFit":
        return cls(*(float(d[key]) for key in cls.KEYS))


def occupancy_stall(ctas: float, sm_count: int, c_min: float) -> float:
    """The roofline's stall factor max(1, c_min / C) at C = ctas / SMs decode CTAs per SM
    (c_min itself for a step with no CTAs): streaming slows below c_min CTAs per SM."""
    occupancy = ctas / sm_count
    return max(1.0, c_min / occupancy) if occupancy > 0 else c_min


@dataclass(frozen=True)
class RouteFit:
    """A host-scheduled PersistentKV route's fitted device time (bucket, workqueue): the
    roofline's terms with the route's own coefficients and occupancy target."""

    fixed_s: float            # per-step latency of the route's launches
    s_per_kv_byte: float      # 1 / streaming bandwidth at full occupancy
    c_min: float              # occupancy target, decode CTAs per SM, below which streaming stalls
    s_per_merge_byte: float   # per partial-state byte (written, then merged)
    s_per_launch: float       # per launch inside the step's device span
    s_per_task_byte: float = 0.0   # per KV byte of the longest task (0: no such term)

    KEYS = ("fixed_s", "s_per_kv_byte", "c_min", "s_per_merge_byte", "s_per_launch", "s_per_task_byte")

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.s_per_kv_byte, self.s_per_merge_byte, self.s_per_launch,
               self.s_per_task_byte) < 0 or self.c_min <= 0:
            raise ValueError(f"route fit out of range: {self}")

    def device_s(self, cost: "RouteCost", sm_count: int) -> float:
        stall = occupancy_stall(cost.ctas, sm_count, self.c_min)
        return (self.fixed_s + cost.kv_bytes * self.s_per_kv_byte * stall + cost.merge_bytes * self.s_per_merge_byte
                + cost.launches * self.s_per_launch + cost.task_bytes * self.s_per_task_byte)

    @classmethod
    def from_dict(cls, d: dict) -> "RouteFit":
        # Constants without the critical-path term were fitted without it: 0.
        return cls(*(float(d.get(key, 0.0) if key == "s_per_task_byte" else d[key]) for key in cls.KEYS))


@dataclass(frozen=True)
class Constants:
    device: str
    beta: float                      # streaming bandwidth, bytes/s
    launch_s: float                  # lambda, seconds per launch
    sm_count: int
    c_min: float                     # occupancy target, CTAs per SM
    baseline_ctas_per_head: dict     # FlashInfer-like route -> effective CTAs per (row, KV head)
    margins: tuple                   # ((max_active, margin), ...), ascending max_active
    supported_groups: tuple
    min_context: int
    min_tiles_per_split: int
    operating_points: dict = field(default_factory=dict)   # "family-bN" -> {"bucket": S, "workqueue": S}
    host_s: dict = field(default_factory=dict)             # route -> H_r, seconds per step
    graph: GraphFit | None = None                          # pkv-graph's device fit; None: not offered
    baseline_fit: dict = field(default_factory=dict)       # FlashInfer route -> BaselineFit; absent: roofline
    route_fit: dict = field(default_factory=dict)          # "bucket"/"workqueue" -> RouteFit; absent: roofline
    overlapped_margins: tuple = ()                         # the overlapped objective's margins; empty: `margins`
    device_scale: dict = field(default_factory=dict)       # route -> factor on its device estimate (set by `at`)

    def __post_init__(self) -> None:
        if self.beta <= 0 or self.launch_s < 0 or self.sm_count < 1 or self.c_min <= 0:
            raise ValueError(f"constants out of range: beta={self.beta}, lambda={self.launch_s}, "
                             f"sm_count={self.sm_count}, c_min={self.c_min}")
        if any(v < 0 for v in self.host_s.values()):
            raise ValueError(f"negative host time in {self.host_s}")
        for where, scale in [("", self.device_scale), *((f" at {p}", op.get("device_scale") or {})
                                                          for p, op in self.operating_points.items())]:
            if not all(isinstance(v, (int, float)) and 0 < v < float("inf") for v in scale.values()):
                raise ValueError(f"device scale out of range{where}: {scale}")
        if not self.baseline_ctas_per_head:
            raise ValueError("constants name no baseline route")

    def margin(self, active: int, objective: str = "serial") -> float:
        """The promotion margin of a step of `active` rows: the first row whose max_active is
        at least `active` (past the last, the last), of the objective's own margins where the
        constants have them (`overlapped_margins`), else of `margins`."""
        margins = self.overlapped_margins if objective == "overlapped" and self.overlapped_margins else self.margins
        for max_active, margin in margins:
            if active <= max_active:
                return float(margin)
        return float(margins[-1][1])

    def split(self, point: str, kind: str) -> int:
        """Frozen split of route `kind` ("workqueue" or "bucket") at operating point `point`; an
        engine runs at the split of its row's `split_route` (pkv.engines.table)."""
        if point not in self.operating_points:
            raise ValueError(f"no frozen operating point {point!r}; "
                             f"calibrated: {', '.join(sorted(self.operating_points))}")
        return int(self.operating_points[point][kind])

    def at(self, point: str) -> "Constants":
        """These constants as the router applies them at operating point `point`: its own
        host times (H_r measured at that point, `operating_points[point]["host_s"]`) over
        the global medians, and its routes' device scales (`operating_points[point]
        ["device_scale"]`). Constants without either are returned as is."""
        here = self.operating_points.get(point, {})
        local, scale = here.get("host_s"), here.get("device_scale")
        if not local and not scale:
            return self
        return dataclasses.replace(self, host_s={**self.host_s, **(local or {})},
                                   device_scale={r: float(v) for r, v in (scale or {}).items()})

    @classmethod
    def from_dict(cls, d: dict) -> "Constants":
        return cls(
            device=d["device"], beta=float(d["beta_bytes_per_s"]), launch_s=float(d["launch_overhead_s"]),
            sm_count=int(d["sm_count"]), c_min=float(d["c_min"]),
            baseline_ctas_per_head={k: float(v) for k, v in d["baseline_ctas_per_head"].items()},
            margins=_margins(d["margins"]), overlapped_margins=_margins(d.get("overlapped_margins") or ()),
            supported_groups=tuple(int(g) for g in d["supported_groups"]), min_context=int(d["min_context"]),
            min_tiles_per_split=int(d["min_tiles_per_split"]), operating_points=d.get("operating_points", {}),
            host_s={k: float(v) for k, v in d.get("host_s", {}).items()},
            graph=GraphFit.from_dict(d["graph"]) if d.get("graph") else None,
            baseline_fit={r: BaselineFit.from_dict(v) for r, v in d.get("baseline_fit", {}).items()},
            route_fit={r: RouteFit.from_dict(v) for r, v in d.get("route_fit", {}).items()},
        )

    @classmethod
    def load(cls, path: str | Path) -> "Constants":
        """The constants frozen at `path`; a file that is not a calibration's output (a key
        missing, a value of the wrong type) is refused in one line naming the file and key."""
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON constants file (line {e.lineno}: {e.msg})") from None
        return cls.of(d, path)

    @classmethod
    def of(cls, d: dict, source: str | Path) -> "Constants":
        """from_dict of a constants file's content read from `source`, a missing key or a value
        of the wrong type refused in one line naming `source` and the key."""
        try:
            return cls.from_dict(d)
        except KeyError as e:
            raise ValueError(f"{source}: constants key {e.args[0]!r} missing; rerun the calibration "
                             f"(pkv measure calibrate) to rewrite it") from None
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: not a calibration's constants ({type(e).__name__}: {e})") from None


def _margins(rows) -> tuple:
    return tuple((int(m["max_active"]), float(m["margin"])) for m in rows)


@dataclass(frozen=True)
class RouteCost:
    """What T_r needs of one route on one step."""

    route: str
    kv_bytes: float
    ctas: float
    launches: int
    merge_bytes: float
    rows: int = 0          # the step's rows (a BaselineFit's per-row term)
    task_bytes: float = 0.0   # KV bytes of the longest task, one CTA's read (a RouteFit's critical-path term)


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"router objective {objective!r}: choose from {', '.join(OBJECTIVES)}")
    return objective


def estimate(cost: RouteCost, k: Constants, objective: str = "serial") -> float:
    """T_r of `cost`: device time (the route's fit, else the roofline; times the point's
    device scale) plus H_r when serial."""
    if cost.route == GRAPH:
        if k.graph is None:
            raise ValueError("these constants have no pkv-graph fit (recalibrate to offer pkv-graph)")
        device = k.graph.device_s(cost)
    elif cost.route in k.baseline_fit:
        device = k.baseline_fit[cost.route].device_s(cost)
    elif cost.route in k.route_fit:
        device = k.route_fit[cost.route].device_s(cost, k.sm_count)
    else:
        stall = occupancy_stall(cost.ctas, k.sm_count, k.c_min)
        device = cost.kv_bytes / k.beta * stall + cost.launches * k.launch_s + cost.merge_bytes / k.beta
    device *= k.device_scale.get(cost.route, 1.0)
    return device + k.host_s.get(cost.route, 0.0) if objective == "serial" else device


# The PersistentKV routes, costed in closed form from the step's lengths: the same counts
# pkv.plan.schedule's bucket and workqueue schedules and pkv.plan.device_schedule's rule
# produce (row-local bounds, so KV bytes read = useful bytes), without building the task
# lists on the hot path. The Router runs them once per decode step for a batch of a few to
# a few dozen rows, where plain Python ints cost a fraction of numpy's per-call overhead:
# each count takes a list of ints in plain Python and an array in numpy, with equal results.


def _lengths(seq_lens) -> list[int]:
    return seq_lens.tolist() if isinstance(seq_lens, np.ndarray) else [int(n) for n in seq_lens]


def _total(lens) -> int:
    """The step's tokens: `lens` a list of ints or an integer array."""
    return int(lens.sum(dtype=np.int64)) if isinstance(lens, np.ndarray) else sum(lens)


def baseline_cost(route: str, shape: Shape, seq_lens, k: Constants) -> RouteCost:
    """A FlashInfer-like single-launch route reading every useful KV byte once."""
    lens = _lengths(seq_lens)
    ctas = len(lens) * shape.num_kv_heads * k.baseline_ctas_per_head[route]
    return RouteCost(route, float(sum(lens) * shape.kv_bytes_per_token), ctas, 1, 0.0, len(lens))


def bucket_counts(lens, policy: SplitPolicy, memo: dict | None = None) -> tuple[int, int, int, int]:
    """(split tasks per KV head, launches, merged tasks per KV head, the longest task's tokens)
    of bucket_schedule: one grid launch per distinct length, plus its merge where that length
    splits. `lens` a list of ints (plain Python; `memo`, tile count -> splits, may be kept by
    the caller across steps) or an integer array (numpy)."""
    if isinstance(lens, np.ndarray):
        return _bucket_counts_array(lens, policy)
    memo = {} if memo is None else memo
    tasks = launches = merged = longest_task = 0
    seen = set()
    for n in lens:
        t = -(-n // TILE_TOKENS)                                       # num_tiles, inlined
        s = memo.get(t)
        if s is None:
            s = memo[t] = policy.for_length(t * TILE_TOKENS)
        if n not in seen:
            seen.add(n)
            launches += 2 if s > 1 else 1
            longest_task = max(longest_task, min(-(-t // s) * TILE_TOKENS, n))   # task_tokens, inlined
        tasks += s
        if s > 1:
            merged += s
    return tasks, launches, merged, longest_task


def _bucket_counts_array(arr: np.ndarray, policy: SplitPolicy) -> tuple[int, int, int, int]:
    """bucket_counts of an integer array, vectorized (SplitPolicy.for_length on every row)."""
    tiles = num_tiles(arr.astype(np.int64))
    s = np.clip((tiles + (policy.min_tiles_per_split - 1)) // policy.min_tiles_per_split, 1, policy.splits)
    tasks = int(s.sum())
    singles = int(np.count_nonzero(s == 1))
    ordered = np.sort(arr)
    change = ordered[1:] != ordered[:-1]
    distinct = int(np.count_nonzero(change)) + 1
    # Distinct lengths whose bucket splits (s > 1): s is monotone in the length.
    first_split = int(np.searchsorted(ordered, TILE_TOKENS * policy.min_tiles_per_split, side="right"))
    if policy.splits > 1 and first_split < len(ordered):
        split_distinct = int(np.count_nonzero(change[first_split:])) + 1
    else:
        split_distinct = 0
    longest_task = int(np.minimum(-(-tiles // s) * TILE_TOKENS, arr).max())
    return tasks, distinct + split_distinct, tasks - singles, longest_task


def workqueue_counts(lens, policy: SplitPolicy) -> tuple[int, int, int, int]:
    """(tasks per KV head, launches, merged tasks per KV head, the longest task's tokens) of
    workqueue_schedule: every row cut into chunks sized by the longest row
    (workqueue_row_splits), one launch plus one merge where any row splits. `lens` a list of
    ints (plain Python) or an integer array (numpy)."""
    splits = workqueue_row_splits(lens, policy)
    if isinstance(lens, np.ndarray):
        tiles = num_tiles(lens.astype(np.int64))
        tasks, most = int(splits.sum()), int(splits.max())
        longest_task = int(np.minimum(-(-tiles // splits) * TILE_TOKENS, lens).max())
    else:
        tasks, most = sum(splits), max(splits)
        # task_tokens, inlined: ceil(ceil(n / TILE_TOKENS) / s) tiles is ceil(n / (TILE_TOKENS * s)) tiles
        longest_task = max([min(-(-n // (TILE_TOKENS * s)) * TILE_TOKENS, n) for n, s in zip(lens, splits)])
    merging = most > 1
    return tasks, 1 + merging, tasks if merging else 0, longest_task


def _scheduled_cost(route: str, counts: tuple[int, int, int, int], kv_bytes: float, shape: Shape) -> RouteCost:
    """The RouteCost of a host-scheduled route from its counts (bucket_counts, workqueue_counts)."""
    tasks, launches, merged, task = counts
    h = shape.num_kv_heads
    return RouteCost(route, kv_bytes, float(tasks * h), launches, float(merged * h * slot_bytes(shape)),
                     task_bytes=float(task * shape.kv_bytes_per_head_token))


def bucket_cost(shape: Shape, seq_lens, policy: SplitPolicy) -> RouteCost:
    """Exact length buckets: one grid launch per distinct length (+ its merge if split)."""
    lens = _lengths(seq_lens)
    return _scheduled_cost("bucket", bucket_counts(lens, policy), float(sum(lens) * shape.kv_bytes_per_token), shape)


def workqueue_cost(shape: Shape, seq_lens, policy: SplitPolicy) -> RouteCost:
    """Compact workqueue: chunks sized by the longest row, one launch (+ one merge)."""
    lens = _lengths(seq_lens)
    return _scheduled_cost("workqueue", workqueue_counts(lens, policy), float(sum(lens) * shape.kv_bytes_per_token),
                           shape)


def graph_counts(seq_lens, num_kv_heads: int, num_ctas: int, min_tiles: int,
                 piece_cost: int = PIECE_COST, queries: Queries = ONE_QUERY,
                 short_tiles: int = SHORT_TILES) -> tuple[int, int]:
    """(CTAs with work, partial states of the cut segments) of pkv-graph's device rule
    (pkv.plan.device_schedule: n CTAs take equal ranges of the step's units, a segment's
    tiles after its set-up units; a segment that a range boundary falls inside its tiles
    is cut, and each of its pieces leaves one partial state to merge). Equal to what
    graph_pieces lists (tests/test_router_graph.py), without listing the pieces: plain ints for a list of
    up to SMALL_ROWS rows without set-up units (the router's misses), else O(n) numpy. queries: a
    row's work is its window's tiles, its segments KV heads x query blocks (pkv.plan.device_schedule)."""
    if piece_cost == 0 and queries == ONE_QUERY and isinstance(seq_lens, list) and len(seq_lens) <= SMALL_ROWS:
        return _graph_counts_small(seq_lens, num_kv_heads, num_ctas, min_tiles, short_tiles)
    tiles = queries.tiles(np.asarray(seq_lens, dtype=np.int64))
    h = num_kv_heads * queries.blocks
    work = int(tiles.sum()) * h
    if work == 0:
        return 0, 0
    n = grid_ctas(work, int(np.count_nonzero(tiles)) * h, num_ctas, min_tiles, short_tiles)
    if n == 1:
        return 1, 0
    setup = setup_units(tiles, n, work, piece_cost)
    seg_units = tiles + setup
    ends = h * np.cumsum(seg_units)                    # each row's last unit + 1
    units = int(ends[-1])
    bounds = np.arange(1, n, dtype=np.int64) * units // n   # CTA range boundaries, distinct (units >= n)
    rows = np.searchsorted(ends, bounds, side="right")     # the row holding unit `bound`
    t = seg_units[rows]
    offset = bounds - (ends[rows] - h * t)                 # units into that row
    inside = offset % t > setup[rows]                      # strictly inside a segment's tiles: a cut
    ctas = n - _setup_only(bounds, units, ends, seg_units, setup, h) if piece_cost else n
    cuts = int(np.count_nonzero(inside))
    if not cuts:
        return ctas, 0
    seg = rows[inside] * h + offset[inside] // t[inside]     # non-decreasing: bounds are sorted
    cut_segments = int(np.count_nonzero(seg[1:] != seg[:-1])) + 1
    return ctas, cuts + cut_segments                       # a segment cut k times has k + 1 pieces


def _graph_counts_small(lens: list, h: int, num_ctas: int, min_tiles: int,
                        short_tiles: int = SHORT_TILES) -> tuple[int, int]:
    """graph_counts without set-up units, in plain ints for a few rows (a router miss): each
    segment's cuts counted in closed form. The range boundaries are b_j = j * U // n (j = 1 ..
    n - 1), so those strictly inside a segment's units (S, S + t) are the j from
    ceil((S + 1) n / U) to ceil((S + t) n / U) - 1."""
    tiles = [-(-n // TILE_TOKENS) for n in lens]
    units = sum(tiles) * h
    if units == 0:
        return 0, 0
    n = grid_ctas(units, sum(1 for t in tiles if t) * h, num_ctas, min_tiles, short_tiles)
    if n == 1:
        return 1, 0
    # first >= 1 and last <= n - 1 hold by themselves (start >= 0, start + t <= U).
    cuts = cut_segments = start = 0
    for t in tiles:
        if not t:
            continue
        for _ in range(h):
            inside = (-(-(start + t) * n // units)) - (-(-(start + 1) * n // units))   # last - first + 1
            if inside > 0:
                cuts += inside
                cut_segments += 1
            start += t
    return n, cuts + cut_segments


def _setup_only(bounds, units: int, ends, seg_units, setup, h: int) -> int:
    """CTAs whose whole range lies in one segment's set-up units: no piece, no work."""
    lo = np.concatenate(([0], bounds))
    hi = np.concatenate((bounds, [units]))
    rows = np.searchsorted(ends, lo, side="right")
    t = seg_units[rows]
    first = (lo - (ends[rows] - h * t)) % t                # the range's first unit, into its segment
    return int(np.count_nonzero(first + (hi - lo) <= setup[rows]))


def graph_cost(shape: Shape, seq_lens, num_ctas: int, min_tiles: int, piece_cost: int = PIECE_COST,
               queries: Queries = ONE_QUERY, short_tiles: int = SHORT_TILES) -> RouteCost:
    """pkv-graph on one step: all useful KV bytes in one launch over `ctas` CTAs, plus the
    cut segments' partial states (merge bytes). An integer array is counted in numpy, any
    other sequence as a list of ints (graph_counts). queries: a windowed row reads its window
    (pkv.plan.device_schedule.Queries.window_tokens), once per query block; a state holds the
    block's G x tokens query rows."""
    lens = seq_lens if isinstance(seq_lens, np.ndarray) else _lengths(seq_lens)
    h = shape.num_kv_heads * queries.blocks
    n, states = graph_counts(lens, shape.num_kv_heads, num_ctas, min_tiles, piece_cost, queries, short_tiles)
    if queries == ONE_QUERY:
        tiles = num_tiles(lens.astype(np.int64)) if isinstance(lens, np.ndarray) else [num_tiles(x) for x in lens]
        read = lens
    else:
        arr = np.asarray(lens, dtype=np.int64)
        tiles, read = queries.tiles(arr), queries.window_tokens(arr)
    units = _total(tiles) * h                                          # a CTA's range: its share of the units
    task = -(-units // n) * TILE_TOKENS * shape.kv_bytes_per_head_token if n else 0
    return RouteCost(GRAPH, float(_total(read) * shape.kv_bytes_per_token * queries.blocks), float(n), 1,
                     float(states * slot_bytes(shape) * queries.block), task_bytes=float(task))


def eligible(shape: Shape, seq_lens, k: Constants) -> bool:
    """The hard gates: calibrated GQA group and a long-context step."""
    return shape.group in k.supported_groups and max(_lengths(seq_lens)) >= k.min_context


@dataclass(frozen=True)
class Decision:
    route: str
    estimate_s: float
    estimates: dict   # route -> T_r, every candidate considered


def choose(baselines: list[RouteCost], candidates: list[RouteCost], active: int, k: Constants,
           objective: str = "serial") -> Decision:
    """The cheapest baseline, unless the cheapest candidate clears the promotion margin.

    `candidates` must already have passed `eligible`; an empty list keeps the baseline.
    """
    if not baselines:
        raise ValueError("choose() needs at least one baseline route")
    est = {c.route: estimate(c, k, objective) for c in (*baselines, *candidates)}
    route = promote(est, [c.route for c in baselines], [c.route for c in candidates], k.margin(active, objective))
    return Decision(route, est[route], est)


def promote(est: dict, baselines: list[str], candidates: list[str], margin: float) -> str:
    """The promotion rule on estimates: the cheapest candidate where the cheapest baseline
    costs at least `margin` times as much, else that baseline (ties by name). One definition
    for the router and for the calibration's margin fit (pkv.measure.overlapped_margin)."""
    base = min(baselines, key=lambda r: (est[r], r))
    if candidates:
        best = min(candidates, key=lambda r: (est[r], r))
        if est[base] >= margin * est[best]:
            return best
    return base


class Router:
    """The per-step decision of `choose` over fixed routes, fast enough to pay for itself.

    Everything that does not change from step to step (shape terms, each route's policy
    and constants, the margin of each active count) is taken once, here. A step costs:

    - a cache lookup on its signature: the active request ids, the longest row's tile and
      whether the step passes the context gate. Within one active set every row grows by
      one token a step, so the rows' relative order, their distinct lengths and the bucket
      structure are fixed, and estimates move by a few tokens' worth of bytes across the
      32 steps of a tile; the decision is taken at the first step of each signature and
      reused (tests check it equals the uncached decision on recorded traces; a reused
      decision's estimate_s is that of its signature's first step);
    - on a miss (about one step in eight on the serving traces: the active set changed),
      the exact decision from the routes' counts (bucket_counts, workqueue_counts,
      graph_counts): plain Python ints up to SMALL rows (split counts memoized per tile
      count), a handful of vectorized numpy ops above.

    `cache=False` gives the uncached decision (every step evaluated exactly). `graph` is
    the pkv-graph engine's (num_ctas, min_tiles[, piece_cost]) where it was built; it is a candidate only
    with a GraphFit in the constants (the same gates as the other PersistentKV routes).
    `objective` is "serial" or "overlapped" (module docstring).
    """

    SMALL = SMALL_ROWS
    FEW = 16            # up to this many rows, the longest row by Python's max (the cache key)
    MAX_ENTRIES = 4096

    def __init__(self, shape: Shape, k: Constants, baselines, policies: dict, cache: bool = True,
                 objective: str = "serial", graph: tuple[int, ...] | None = None):
        self.k, self.shape = k, shape
        self.baselines = tuple(baselines)
        self.policies = dict(policies)          # "bucket"/"workqueue" -> SplitPolicy; empty = gated out
        self.objective = check_objective(objective)
        # A cut given without its piece_cost is the constants' (the cut their fit ran on).
        self.graph = None if graph is None or k.graph is None else (*graph, k.graph.piece_cost)[:3]
        self.kvb, self.h = shape.kv_bytes_per_token, shape.num_kv_heads
        self.base_cta = {b: k.baseline_ctas_per_head[b] for b in self.baselines}
        self.group_ok = bool(self.policies or self.graph) and shape.group in k.supported_groups
        self.cache = {} if cache else None
        self._split_memo: dict = {}
        self.hits = self.misses = 0

    def uncached(self) -> "Router":
        """The same router without its cache: every step's decision taken exactly."""
        return Router(self.shape, self.k, self.baselines, self.policies, False, self.objective, self.graph)

    def decide(self, request_ids: np.ndarray, seq_lens: np.ndarray) -> Decision:
        active = len(seq_lens)
        # A cache hit is a few dict operations; numpy's max() of a few rows costs more than
        # they do, Python's max over the list a fraction of it.
        longest = max(seq_lens.tolist()) if active <= self.FEW else int(seq_lens.max())
        gate = self.group_ok and longest >= self.k.min_context
        if self.cache is None:
            return self._exact(seq_lens, active, longest, gate)
        key = (request_ids.tobytes(), (longest + 31) >> 5, gate)
        hit = self.cache.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        d = self._exact(seq_lens, active, longest, gate)
        if len(self.cache) >= self.MAX_ENTRIES:
            self.cache.clear()
        self.cache[key] = d
        return d

    def _exact(self, seq_lens: np.ndarray, active: int, longest: int, gate: bool) -> Decision:
        small = active <= self.SMALL
        if small:
            lens = seq_lens.tolist()
            total = sum(lens)
        else:
            lens = None
            total = int(seq_lens.sum(dtype=np.int64))
        kv_bytes = float(total * self.kvb)
        base = [RouteCost(b, kv_bytes, active * self.h * self.base_cta[b], 1, 0.0, active) for b in self.baselines]
        cands = []
        if gate:
            arg = lens if small else seq_lens
            for kind, policy in self.policies.items():
                counts = (bucket_counts(arg, policy, self._splits_of(policy)) if kind == "bucket"
                          else workqueue_counts(arg, policy))
                cands.append(_scheduled_cost(kind, counts, kv_bytes, self.shape))
            if self.graph:
                cands.append(graph_cost(self.shape, arg, *self.graph))
        return choose(base, cands, active, self.k, self.objective)

    def _splits_of(self, policy: SplitPolicy) -> dict:
        """tile count -> SplitPolicy.for_length, memoized across steps (one rule, asked once)."""
        memo = self._split_memo.get(policy)
        if memo is None:
            memo = self._split_memo[policy] = {}
        return memo
