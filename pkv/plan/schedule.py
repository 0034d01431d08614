"""Decode schedules: which (row, kv_head, split) tasks run, in which launches.

A schedule is pure data, built on the host from one decode step's sequence lengths.
The CUDA kernels execute it and `pkv.kernels.reference.run_schedule` executes the same task
list on the CPU, so the two can be compared task for task.

Split bounds (one rule everywhere, kernels included): a row of length N has
`n = ceil(N / TILE_TOKENS)` tiles; with S splits each split owns `ceil(n / S)`
consecutive tiles, clipped to N. Splits past the last tile are empty.

The rules the paper defines once are written once, here, and imported by the
schedules, the GPU launch builder (pkv.engines.persistent) and the cost model
(pkv.plan.costmodel): how many splits a row gets (`SplitPolicy.for_length`), how the
workqueue cuts rows (`workqueue_row_splits`) and how big a partial-state slot is
(`slot_floats`, `slot_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from pkv.core.shape import Shape

TILE_TOKENS = 32
TASK_FIELDS = ("row", "kv_head", "split", "t_begin", "t_end")


def num_tiles(lengths: np.ndarray | int) -> np.ndarray | int:
    return -(-np.asarray(lengths) // TILE_TOKENS) if isinstance(lengths, np.ndarray) else -(-lengths // TILE_TOKENS)


def split_bounds(bound_len: np.ndarray, splits: int | np.ndarray, split: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Token range [begin, end) of `split` for rows whose split bounds derive from `bound_len`."""
    bound_len = np.asarray(bound_len, dtype=np.int64)
    tiles_per_split = -(-num_tiles(bound_len) // np.asarray(splits, dtype=np.int64))
    begin = np.minimum(split * tiles_per_split * TILE_TOKENS, bound_len)
    end = np.minimum((split + 1) * tiles_per_split * TILE_TOKENS, bound_len)
    return begin, end


@dataclass(frozen=True)
class SplitPolicy:
    """How many splits a row gets.

    `splits` is the operating point (frozen per trace family and batch by calibration);
    no split is shorter than `min_tiles_per_split` tiles, so short rows get fewer.
    """

    splits: int
    min_tiles_per_split: int = 4

    def __post_init__(self) -> None:
        if self.splits < 1 or self.min_tiles_per_split < 1:
            raise ValueError(f"SplitPolicy needs splits >= 1 and min_tiles_per_split >= 1, got {self}")

    def for_length(self, length: int) -> int:
        return int(max(1, min(self.splits, -(-num_tiles(int(length)) // self.min_tiles_per_split))))


def workqueue_chunk(longest: int, policy: SplitPolicy) -> int:
    """Tiles per workqueue task: the longest row's tiles over the splits the policy gives it."""
    return -(-num_tiles(int(longest)) // policy.for_length(int(longest)))


def task_tokens(length: int, splits: int) -> int:
    """Tokens of a row's longest task when split_bounds cuts it into `splits` (its first)."""
    return min(-(-num_tiles(int(length)) // splits) * TILE_TOKENS, int(length))


def workqueue_row_splits(seq_lens, policy: SplitPolicy):
    """Splits of each row in the compact workqueue: every row is cut into chunks of
    `workqueue_chunk` tiles. A numpy array in, an int64 array out; a list of ints in
    (the cost model's hot path, where numpy's per-call overhead dominates), a list out."""
    if isinstance(seq_lens, np.ndarray):
        chunk = workqueue_chunk(int(seq_lens.max()), policy)
        return -(-num_tiles(seq_lens.astype(np.int64)) // chunk)
    chunk = workqueue_chunk(max(seq_lens), policy)
    return [-(-num_tiles(n) // chunk) for n in seq_lens]


def slot_floats(shape: Shape) -> int:
    """FP32 words of one partial-state slot: m and l for each of the G grouped query heads
    plus acc[G, D]."""
    return shape.group * (shape.head_dim + 2)


def slot_bytes(shape: Shape) -> int:
    return 4 * slot_floats(shape)


@dataclass(frozen=True)
class Launch:
    """One decode kernel launch and, when any (row, kv head) has several slots, its merge.

    `tasks[k]` = (row, kv_head, split, t_begin, t_end) writes partial state slot k; `row`
    is a batch row. Slots of (rows[i], g) are `seg_offsets[i*H_kv + g] : seg_offsets[i*H_kv + g + 1]`.
    A "grid" launch is the rectangle rows x kv_heads x splits (empty tasks included, the
    kernel derives bounds from `bound_len`); a "queue" launch lists non-empty tasks only.
    Tokens at or past a row's seq_len inside [t_begin, t_end) are read and masked.
    """

    kind: Literal["grid", "queue"]
    rows: np.ndarray
    splits: int
    tasks: np.ndarray
    seg_offsets: np.ndarray
    bound_len: np.ndarray

    @property
    def needs_merge(self) -> bool:
        return bool(np.any(np.diff(self.seg_offsets) > 1))

    @property
    def num_tasks(self) -> int:
        return int(self.tasks.shape[0])


@dataclass(frozen=True)
class Counters:
    """Table 4's structural counters for one decode step."""

    decode_launches: int
    merge_launches: int
    extra_launches: int
    decode_ctas: int
    empty_ctas: int
    num_sms: int
    useful_kv_bytes: int
    read_kv_bytes: int
    merge_bytes: int
    task_kv_bytes: int = 0    # the most KV bytes one task (one CTA) reads: the step's critical path when CTAs <= SMs

    @property
    def launches(self) -> int:
        return self.decode_launches + self.merge_launches + self.extra_launches

    @property
    def cta_work_per_sm(self) -> float:
        return self.decode_ctas / self.num_sms


@dataclass(frozen=True)
class Schedule:
    kind: Literal["bucket", "masked", "workqueue"]
    num_kv_heads: int
    launches: tuple[Launch, ...]

    def counters(self, shape: Shape, seq_lens: np.ndarray, num_sms: int, extra_launches: int = 0) -> Counters:
        token_bytes_per_head = shape.kv_bytes_per_head_token
        spans = [launch.tasks[:, 4] - launch.tasks[:, 3] for launch in self.launches]   # tokens each task reads
        read_tokens = sum(int(s.sum()) for s in spans)
        merging = [launch for launch in self.launches if launch.needs_merge]
        return Counters(
            decode_launches=len(self.launches),
            merge_launches=len(merging),
            extra_launches=extra_launches,
            decode_ctas=sum(launch.num_tasks for launch in self.launches),
            empty_ctas=sum(int((launch.tasks[:, 3] >= launch.tasks[:, 4]).sum()) for launch in self.launches),
            num_sms=num_sms,
            useful_kv_bytes=int(np.asarray(seq_lens, dtype=np.int64).sum()) * shape.kv_bytes_per_token,
            read_kv_bytes=read_tokens * token_bytes_per_head,
            merge_bytes=sum(launch.num_tasks for launch in merging) * slot_bytes(shape),
            task_kv_bytes=max(int(s.max()) for s in spans) * token_bytes_per_head,
        )


def _grid_launch(rows: np.ndarray, seq_lens: np.ndarray, num_kv_heads: int, splits: int, row_local: bool) -> Launch:
    lens = seq_lens[rows].astype(np.int64)
    bound = lens if row_local else np.full_like(lens, lens.max())
    n, h, s = len(rows), num_kv_heads, splits
    r_idx, g_idx, s_idx = (a.ravel() for a in np.meshgrid(np.arange(n), np.arange(h), np.arange(s), indexing="ij"))
    begin, end = split_bounds(bound[r_idx], s, s_idx)
    tasks = np.stack([rows[r_idx], g_idx, s_idx, begin, end], axis=1).astype(np.int32)
    seg = np.arange(0, n * h * s + 1, s, dtype=np.int32)
    return Launch("grid", rows.astype(np.int32), s, tasks, seg, bound.astype(np.int32))


def bucket_schedule(seq_lens: np.ndarray, num_kv_heads: int, policy: SplitPolicy, row_local: bool = True) -> Schedule:
    """Exact length buckets: one grid launch per distinct current length, longest first."""
    seq_lens = _check_lens(seq_lens)
    launches = []
    for length in np.unique(seq_lens)[::-1]:
        rows = np.flatnonzero(seq_lens == length)
        launches.append(_grid_launch(rows, seq_lens, num_kv_heads, policy.for_length(int(length)), row_local))
    return Schedule("bucket", num_kv_heads, tuple(launches))


def masked_schedule(seq_lens: np.ndarray, num_kv_heads: int, policy: SplitPolicy, row_local: bool = True) -> Schedule:
    """One coarse bucket: every row in one rectangular grid sized by the longest row."""
    seq_lens = _check_lens(seq_lens)
    rows = np.arange(len(seq_lens))
    splits = policy.for_length(int(seq_lens.max()))
    return Schedule("masked", num_kv_heads, (_grid_launch(rows, seq_lens, num_kv_heads, splits, row_local),))


def workqueue_schedule(seq_lens: np.ndarray, num_kv_heads: int, policy: SplitPolicy) -> Schedule:
    """Compact workqueue: non-empty (row, kv_head, split) tasks only, in one launch.

    The longest row gets the policy's splits; every row is cut into chunks of the same
    tile count, so tasks carry similar work and short rows produce few slots to merge.
    """
    seq_lens = _check_lens(seq_lens).astype(np.int64)
    row_splits = workqueue_row_splits(seq_lens, policy)
    h = num_kv_heads
    per_seg = np.repeat(row_splits, h)
    seg = np.zeros(len(per_seg) + 1, dtype=np.int64)
    np.cumsum(per_seg, out=seg[1:])
    seg_id = np.repeat(np.arange(len(per_seg)), per_seg)
    split = np.arange(seg[-1]) - seg[seg_id]
    row = seg_id // h
    begin, end = split_bounds(seq_lens[row], row_splits[row], split)
    tasks = np.stack([row, seg_id % h, split, begin, end], axis=1).astype(np.int32)
    rows = np.arange(len(seq_lens), dtype=np.int32)
    launch = Launch("queue", rows, int(row_splits.max()), tasks, seg.astype(np.int32), seq_lens.astype(np.int32))
    return Schedule("workqueue", num_kv_heads, (launch,))


def _check_lens(seq_lens: np.ndarray) -> np.ndarray:
    seq_lens = np.asarray(seq_lens)
    if seq_lens.ndim != 1 or len(seq_lens) == 0:
        raise ValueError(f"seq_lens must be a non-empty 1-D array, got shape {seq_lens.shape}")
    if not np.issubdtype(seq_lens.dtype, np.integer):
        raise ValueError(f"seq_lens must hold integers, got {seq_lens.dtype}")
    if seq_lens.min() < 1:
        raise ValueError(f"every seq_len must be >= 1, got {int(seq_lens.min())}")
    return seq_lens
