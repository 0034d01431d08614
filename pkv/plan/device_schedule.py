"""The graph decode's device-side split rule, in Python (what every CTA of csrc/graph_cut.cuh computes).

A step's work is H * sum_r tiles(r) units (one unit = one TILE_TOKENS tile of one KV
head); segment (r, h) holds units [H * exc_r + h * tiles_r, + tiles_r) where exc_r sums
the tiles of the rows before r. With n CTAs (`active_ctas`), CTA j
owns units [j W / n, (j + 1) W / n): equal to one tile, whatever the mix of lengths. A
segment inside one CTA is written directly; a segment cut across CTAs j0..j1 leaves one
partial state per CTA (slot 2j for the piece that starts CTA j's range, 2j + 1 for its
last piece otherwise) and the last CTA to finish merges them.

Set-up units (`piece_cost` P > 0; PIECE_COST the default): each
piece also costs a set-up that its tiles do not count (block-table ids, the prologue's
copies, the first tile's latency, the drain), so a CTA over many short segments did more
than one over one long segment. Where
a row's segments are shorter than a CTA's range (0 < tiles(r) and tiles(r) * n < W, n and W
as above), each of them holds P set-up units in front of its tiles: the cut then shares
tiles plus set-ups equally. n stays the tiles' (`active_ctas`); a piece of set-up units only
is no piece; a segment's first CTA j0 is the one holding its first tile. P = 0 is the cut
of the tiles alone, unit for unit (`Cut`).

Cut segments are merged inside the decode grid: a segment of at most CTA_MERGE_STATES
states by its last CTA to finish, a longer one by the last MERGE_SLICES of its CTAs to
finish, one equal slice of its columns each (the earlier ones wait on the segment's counter
for the rest; `grid_merge_roles`).

Short steps (`grid_ctas`): a step of at most `short_tiles` tiles a CTA over half the grid runs on
at most half of it, so that the next call's CTAs find free SMs to start on (under PDL: to scan,
cut and issue their first copies) while this one finishes.

Rows with several query tokens, or a sliding window (`Queries`): a row of length L holds q_len
query tokens at positions L - q_len .. L - 1, each attending causally to the keys at or
before its position and, with a left window W, at or after its position - W. A row's work
is then the tiles covering [max(0, L - q_len - W), L) (tiles stay aligned to TILE_TOKENS
positions: `Queries.first_tile`), not its whole length. The kernel puts a segment's
G x q_len query rows in the MMA's M rows, at most MAX_PASS_ROWS of them (8 at head_dim 256):
a row's query tokens are cut into `Queries.blocks` blocks of `Queries.block` tokens, and
each (row, KV head, block) is a segment of its own (a virtual KV head h * blocks + b), so
one pass reads each KV tile once for all of its block's query rows.

This module is the CPU oracle of that rule: `graph_schedule` turns it into a
pkv.plan.schedule.Schedule (one queue launch, tasks in segment order) that
pkv.kernels.reference.run_schedule executes, and `graph_pieces` lists each CTA's pieces with
the slots the kernel uses, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pkv.plan.schedule import TILE_TOKENS, Launch, Schedule, num_tiles

GRAPH_MAX_ROWS = 1024   # kGraphMaxRows in csrc/graph_decode.h
GRAPH_MIN_TILES = 2     # default smallest CTA range, in tiles (its A/B: docs/log.md)
CTA_MERGE_STATES = 8    # kCtaMergeStates: a segment of more states is merged by several of its CTAs
MERGE_SLICES = 16       # kMergeSlices: a longer segment is merged in this many slices in the grid
PIECE_COST = 8          # default set-up units in front of a short segment (its A/B: docs/log.md)
MAX_PIECE_COST = 64     # kMaxPieceCost
MAX_COUNTER_STRIDE = 32  # kMaxCounterStride: merge counters allocated per (row, KV head), in ints
MAX_SPIN_NS = 10000     # kMaxSpinNs: pkv-graph's spin_ns option's bound
MAX_Q_LEN = 8           # kMaxQLen: query tokens per row
MAX_PASS_ROWS = 16      # kMaxGroup in csrc/attend.cuh: query rows (G x tokens) of one pass; 8 at head_dim 256
SHORT_TILES = 8         # default short-step bound, tiles a CTA over half the grid (its A/B: docs/log.md)


def pass_rows(head_dim: int) -> int:
    """Query rows one pass of the kernel holds at this head_dim (the MMA's M rows)."""
    return 8 if head_dim == 256 else MAX_PASS_ROWS


@dataclass(frozen=True)
class Queries:
    """What each row's queries attend: q_len tokens at positions L - q_len .. L - 1 (causal
    among themselves), a left window (-1: off; a query at p reads keys [p - window_left, p]),
    and the query tokens one pass of the kernel holds (`block`, from `Queries.of`)."""
    q_len: int = 1
    window_left: int = -1
    block: int = 1

    def __post_init__(self) -> None:
        if not (1 <= self.q_len <= MAX_Q_LEN and self.window_left >= -1 and 1 <= self.block <= self.q_len):
            raise ValueError(f"queries out of range: q_len 1..{MAX_Q_LEN}, window_left >= -1, got {self}")

    @classmethod
    def of(cls, group: int, head_dim: int, q_len: int = 1, window_left: int = -1) -> "Queries":
        """The queries of a shape: a pass holds as many whole tokens of G rows as pass_rows allows."""
        return cls(q_len, window_left, max(1, min(q_len, pass_rows(head_dim) // group)))

    @property
    def blocks(self) -> int:
        """Query blocks a row's tokens are cut into: segments per KV head."""
        return -(-self.q_len // self.block)

    def first_token(self, lens):
        """The first key any query of a row reads: max(0, L - q_len - window_left), 0 without a window."""
        if self.window_left < 0:
            return lens * 0
        return np.maximum(np.asarray(lens) - self.q_len - self.window_left, 0) if isinstance(lens, np.ndarray) \
            else max(int(lens) - self.q_len - self.window_left, 0)

    def first_tile(self, lens):
        """The row's first tile (positions aligned to TILE_TOKENS)."""
        return self.first_token(lens) // TILE_TOKENS

    def tiles(self, lens):
        """Tiles of a row's work: those covering [first_token, L) (0 for a padding row)."""
        return num_tiles(lens) - self.first_tile(lens)

    def window_tokens(self, lens):
        """Keys a row's queries read: L - first_token."""
        return lens - self.first_token(lens)


ONE_QUERY = Queries()


@dataclass(frozen=True)
class GridMerge:
    """The in-grid merge's roles for one segment of more than CTA_MERGE_STATES states."""
    row: int
    kv_head: int
    ctas: tuple[int, ...]    # j0..j1, the CTAs holding its states
    late: int | None         # j1 when pieces follow in its range: counts in, never waits or merges
    slices: int              # K: the last K of the other CTAs to count in merge one slice each


@dataclass(frozen=True)
class Piece:
    cta: int
    row: int
    kv_head: int
    t_begin: int
    t_end: int
    slot: int        # partial-state slot, -1 when the CTA owns the whole segment
    merger_slots: tuple[int, ...]  # the segment's slots in merge order (empty when direct)
    q_block: int = 0  # the block of the row's query tokens (Queries.block tokens each)


def active_ctas(seq_lens: np.ndarray, num_kv_heads: int, num_ctas: int, min_tiles: int = GRAPH_MIN_TILES,
                queries: Queries = ONE_QUERY, short_tiles: int = SHORT_TILES) -> int:
    """CTAs that get work (`grid_ctas` of the step's tiles and non-empty segments)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    h = num_kv_heads * queries.blocks
    return grid_ctas(int(queries.tiles(lens).sum()) * h, int((lens > 0).sum()) * h, num_ctas, min_tiles, short_tiles)


def grid_ctas(work: int, segments: int, num_ctas: int, min_tiles: int, short_tiles: int = SHORT_TILES) -> int:
    """csrc/graph_cut.cuh's active_ctas from the step's counts (tiles x segments per row, non-empty
    segments), in plain ints: at most the grid, no range under min_tiles; a short step (at most
    short_tiles tiles a CTA over half the grid) on at most half of it; with fewer segments than
    CTAs, a multiple of the segment count (no CTA straddles two segments)."""
    n = min(num_ctas, -(-work // min_tiles))
    half = max(num_ctas // 2, 1)
    if n > half and work <= short_tiles * half:
        n = half
    if 0 < segments <= n:
        n = n // segments * segments
    return n


def graph_pieces(seq_lens, num_kv_heads: int, num_ctas: int, min_tiles: int = GRAPH_MIN_TILES,
                 piece_cost: int = PIECE_COST, queries: Queries = ONE_QUERY,
                 short_tiles: int = SHORT_TILES) -> list[Piece]:
    """Every CTA's pieces, in CTA order, exactly as the kernel cuts them (rows of length 0 are padding)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    if lens.ndim != 1 or len(lens) > GRAPH_MAX_ROWS or (lens < 0).any():
        raise ValueError(f"seq_lens must be 1-D, >= 0, at most {GRAPH_MAX_ROWS} rows")
    cut = Cut.of(lens, num_kv_heads, num_ctas, min_tiles, piece_cost, queries, short_tiles)
    if cut.units == 0:
        return []
    nb = queries.blocks
    first = queries.first_tile(lens) * TILE_TOKENS
    pieces = []
    for j in range(cut.n):
        lo, hi = cut.lo(j), cut.lo(j + 1)
        u = lo
        while u < hi:
            r, head, seg_begin, seg_end = cut.segment(u)
            piece_end = min(hi, seg_end)
            setup = int(cut.setup[r])
            t_begin = int(first[r]) + max(u - seg_begin - setup, 0) * TILE_TOKENS
            t_end = min(int(first[r]) + max(piece_end - seg_begin - setup, 0) * TILE_TOKENS, int(lens[r]))
            if t_end > t_begin:   # else set-up units only: no piece
                j0, j1 = cut.ctas(r, seg_begin, seg_end)
                kv_head, block = divmod(head, nb)
                if j0 == j1:
                    pieces.append(Piece(j, r, kv_head, t_begin, t_end, -1, (), block))
                else:
                    pieces.append(Piece(j, r, kv_head, t_begin, t_end, 2 * j if u == lo else 2 * j + 1,
                                        cut.slots(j0, j1, seg_begin), block))
            u = piece_end
    return pieces


def graph_schedule(seq_lens, num_kv_heads: int, num_ctas: int, min_tiles: int = GRAPH_MIN_TILES,
                   piece_cost: int = PIECE_COST, queries: Queries = ONE_QUERY,
                   short_tiles: int = SHORT_TILES) -> Schedule:
    """The pieces as one queue launch (tasks grouped by segment) for pkv.kernels.reference.run_schedule.
    With several query blocks (`queries.blocks` > 1) a task's head is the segment's virtual KV
    head (kv_head * blocks + block) and the schedule's num_kv_heads counts them."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    nb = queries.blocks
    pieces = sorted(graph_pieces(lens, num_kv_heads, num_ctas, min_tiles, piece_cost, queries, short_tiles),
                    key=lambda p: (p.row, p.kv_head, p.q_block, p.t_begin))
    rows = np.flatnonzero(lens > 0).astype(np.int32)
    segs = {}
    for p in pieces:
        segs.setdefault((p.row, p.kv_head * nb + p.q_block), []).append(p)
    tasks, offsets = [], [0]
    for r in rows.tolist():
        for g in range(num_kv_heads * nb):
            for split, p in enumerate(segs[(r, g)]):
                tasks.append((r, g, split, p.t_begin, p.t_end))
            offsets.append(len(tasks))
    task_arr = np.asarray(tasks, dtype=np.int32).reshape(-1, 5)
    splits = int(np.diff(offsets).max()) if len(offsets) > 1 else 1
    launch = Launch("queue", rows, splits, task_arr, np.asarray(offsets, dtype=np.int32), lens[rows].astype(np.int32))
    return Schedule("workqueue", num_kv_heads * nb, (launch,))


def setup_units(tiles: np.ndarray, n: int, work: int, piece_cost: int) -> np.ndarray:
    """Set-up units in front of each of a row's segments: piece_cost where the row's
    segments are shorter than a CTA's range (0 < tiles and tiles * n < work, the step's H *
    sum(tiles) over n active CTAs), else 0."""
    return np.where((tiles > 0) & (tiles * n < work), piece_cost, 0).astype(np.int64)


@dataclass(frozen=True)
class Cut:
    """One step's cut as every CTA computes it: rows' tiles and set-up units, their inclusive
    sum over rows, the step's units (tiles and set-ups) and its active CTAs."""
    tiles: np.ndarray    # tiles per row
    setup: np.ndarray    # set-up units in front of each of the row's segments
    inc: np.ndarray      # inclusive sum over rows of tiles + setup
    h: int               # segments per row: KV heads x query blocks
    units: int           # h * inc[-1]: what the CTA ranges share
    n: int               # active CTAs (of the tiles alone: active_ctas)

    @classmethod
    def of(cls, seq_lens, h: int, num_ctas: int, min_tiles: int, piece_cost: int,
           queries: Queries = ONE_QUERY, short_tiles: int = SHORT_TILES) -> "Cut":
        """h: KV heads; the cut's segments per row are h * queries.blocks (virtual KV heads)."""
        if not 0 <= piece_cost <= MAX_PIECE_COST:
            raise ValueError(f"piece_cost is 0..{MAX_PIECE_COST} set-up units a piece, got {piece_cost}")
        lens = np.asarray(seq_lens, dtype=np.int64)
        tiles = queries.tiles(lens)
        n = active_ctas(lens, h, num_ctas, min_tiles, queries, short_tiles)
        h *= queries.blocks
        setup = setup_units(tiles, n, int(tiles.sum()) * h, piece_cost)
        inc = np.cumsum(tiles + setup)
        return cls(tiles, setup, inc, h, int(inc[-1]) * h if len(lens) else 0, n)

    def lo(self, j: int) -> int:
        """CTA j's first unit (lo(n) = units)."""
        return j * self.units // self.n

    def cta_of(self, u: int) -> int:
        """The CTA whose range holds unit u."""
        return ((u + 1) * self.n - 1) // self.units

    def segment(self, u: int) -> tuple[int, int, int, int]:
        """(row, KV head, first unit, end unit) of the segment holding unit u."""
        r = int(np.searchsorted(self.h * self.inc, u, side="right"))
        exc = int(self.inc[r - 1]) if r else 0
        t = int(self.inc[r]) - exc
        head = (u - self.h * exc) // t
        seg_begin = self.h * exc + head * t
        return r, head, seg_begin, seg_begin + t

    def ctas(self, r: int, seg_begin: int, seg_end: int) -> tuple[int, int]:
        """The first and last CTA holding tiles of the segment [seg_begin, seg_end) of row r."""
        return self.cta_of(seg_begin + int(self.setup[r])), self.cta_of(seg_end - 1)

    def slots(self, j0: int, j1: int, seg_begin: int) -> tuple[int, ...]:
        """A cut segment's states in merge order (csrc/graph_cut.cuh's SegmentSlots): CTA j0's
        piece (slot 2 j0 when j0's range starts in the segment, else 2 j0 + 1), then 2 j for the
        later CTAs j."""
        first = 2 * j0 if self.lo(j0) >= seg_begin else 2 * j0 + 1
        return (first, *(2 * (j0 + i) for i in range(1, j1 - j0 + 1)))


def grid_merge_roles(seq_lens, num_kv_heads: int, num_ctas: int, min_tiles: int = GRAPH_MIN_TILES,
                     piece_cost: int = PIECE_COST, queries: Queries = ONE_QUERY,
                     short_tiles: int = SHORT_TILES) -> list[GridMerge]:
    """The in-grid merge's roles, as every CTA of csrc/graph_decode_kernel.cuh computes
    them from the cut: for each segment cut into more than CTA_MERGE_STATES states, the late
    CTA (j1, when its range goes on past the segment's end) and the slice count
    K = min(e, MERGE_SLICES) over the e other CTAs."""
    cut = Cut.of(seq_lens, num_kv_heads, num_ctas, min_tiles, piece_cost, queries, short_tiles)
    roles = []
    for r in np.flatnonzero(cut.tiles):
        exc = int(cut.inc[r - 1]) if r else 0
        t = int(cut.inc[r]) - exc          # units of each of the row's segments
        for head in range(cut.h):
            seg_begin = cut.h * exc + head * t
            seg_end = seg_begin + t
            j0, j1 = cut.ctas(int(r), seg_begin, seg_end)
            states = j1 - j0 + 1
            if states <= CTA_MERGE_STATES:
                continue
            late = j1 if cut.lo(j1 + 1) > seg_end else None
            e = states - (late is not None)
            roles.append(GridMerge(int(r), head, tuple(range(j0, j1 + 1)), late, min(e, MERGE_SLICES)))
    return roles
