"""The graph decode's device-side split rule (pkv.plan.device_schedule), checked on the CPU.

The kernel (csrc/graph_cut.cuh) and this module implement one rule; these tests pin its
properties: every token of every row read exactly once, ranges balanced to one tile,
at most two partial-state slots per CTA, slots the merger reads are the ones written, and
the task list executed by the reference engine equals plain attention.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pkv.core.cache import PagedCache
from pkv.core.harness import StepState
from pkv.core.paging import assign_pages
from pkv.core.shape import Shape
from pkv.engines import make_engine
from pkv.kernels.reference import attention_reference
from pkv.plan.device_schedule import (
    CTA_MERGE_STATES,
    GRAPH_MAX_ROWS,
    MERGE_SLICES,
    active_ctas,
    graph_pieces,
    graph_schedule,
    grid_ctas,
    grid_merge_roles,
)
from pkv.plan.schedule import TILE_TOKENS, num_tiles

CASES = {
    "B1 8K": [8192], "B1 1": [1], "odd": [31, 33, 1000, 7], "padding": [0, 5000, 0, 17, 0],
    "many short": list(np.random.default_rng(1).integers(1, 3000, 67)), "one long": [40_000] + [300] * 20,
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_ctas,min_tiles", [(264, 8), (264, 1), (132, 2), (7, 1)])
@pytest.mark.parametrize("piece_cost", [0, 1, 3])
def test_pieces_cover_every_token_once(name, num_ctas, min_tiles, piece_cost):
    lens = np.asarray(CASES[name])
    h = 8
    pieces = graph_pieces(lens, h, num_ctas, min_tiles, piece_cost)
    seen = defaultdict(list)
    for p in pieces:
        assert 0 <= p.t_begin < p.t_end <= lens[p.row] and p.t_begin % TILE_TOKENS == 0
        seen[(p.row, p.kv_head)].append((p.t_begin, p.t_end))
    for r, n in enumerate(lens):
        for g in range(h):
            ranges = sorted(seen.get((r, g), []))
            if n == 0:
                assert not ranges
                continue
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("piece_cost", [0, 1, 3])
def test_ranges_balanced_and_slots_consistent(name, piece_cost):
    lens = np.asarray(CASES[name])
    h, num_ctas = 8, 264
    pieces = graph_pieces(lens, h, num_ctas, piece_cost=piece_cost)
    n = active_ctas(lens, h, num_ctas)
    work = defaultdict(int)
    slots = defaultdict(list)
    for p in pieces:
        work[p.cta] += num_tiles(p.t_end - p.t_begin)  # a row's last piece may end inside its last tile
        if p.slot >= 0:
            assert p.slot in (2 * p.cta, 2 * p.cta + 1)
            slots[(p.row, p.kv_head)].append(p.slot)
    if piece_cost == 0:
        assert max(work.values()) - min(work.values()) <= 1      # balanced to one tile
        assert set(work) == set(range(n))
    else:   # balanced in tiles and set-ups (test_pieces_are_the_units_cut_equally)
        assert set(work) <= set(range(n))
    for p in pieces:
        if p.slot >= 0:   # the merger reads exactly the slots the segment's pieces wrote
            assert sorted(p.merger_slots) == sorted(slots[(p.row, p.kv_head)])
    all_slots = [s for v in slots.values() for s in v]
    assert len(all_slots) == len(set(all_slots))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_ctas,min_tiles", [(264, 8), (264, 1), (132, 2), (7, 1)])
@pytest.mark.parametrize("piece_cost", [0, 2])
def test_a_cut_segments_merge_reads_exactly_the_slots_its_pieces_wrote(name, num_ctas, min_tiles, piece_cost):
    """Every piece of a cut segment names the same merge order (its merger_slots), and it is
    exactly the set of slots the segment's pieces wrote, each once."""
    lens = np.asarray(CASES[name])
    written, orders = defaultdict(list), defaultdict(set)
    for p in graph_pieces(lens, 8, num_ctas, min_tiles, piece_cost):
        if p.slot >= 0:
            written[(p.row, p.kv_head)].append(p.slot)
            orders[(p.row, p.kv_head)].add(p.merger_slots)
    for seg, slots in written.items():
        assert len(orders[seg]) == 1 and len(slots) == len(set(slots))
        assert set(next(iter(orders[seg]))) == set(slots)


def test_few_segments_never_straddle():
    # 8 segments and 264 CTAs, min_tiles 8: 256 CTAs, 32 per segment, each inside one segment
    pieces = graph_pieces([8192], 8, 264, 8)
    assert active_ctas([8192], 8, 264, 8) == 256
    assert len({p.cta for p in pieces}) == len(pieces) == 256
    # the default (min_tiles 2) and 4: 264 CTAs, 33 per segment; B1 1K: 64 CTAs of 4 tiles, 128 at 2
    assert active_ctas([8192], 8, 264) == 264 == len(graph_pieces([8192], 8, 264))
    assert active_ctas([1024], 8, 264, 4) == 64
    assert active_ctas([1024], 8, 264, 2) == 128


def pieces_unit_by_unit(lens, h, num_ctas, min_tiles, piece_cost):
    """The cut spelled out unit by unit: every segment (row, KV head) in order, its set-up
    units (piece_cost where the row's segments are shorter than a CTA's range) then its tiles;
    CTA j takes units [j U / n, (j + 1) U / n); its pieces are the runs of one segment's tiles,
    a cut segment's piece in slot 2j when CTA j's range starts in that segment (in its tiles
    or its set-up units), else 2j + 1; the merge order: the first CTA's slot, then 2j."""
    lens = np.asarray(lens)
    n = active_ctas(lens, h, num_ctas, min_tiles)
    tiles = num_tiles(lens)
    work = int(tiles.sum()) * h
    units = []   # (row, head, tile index or None for a set-up unit)
    for r, t in enumerate(tiles.tolist()):
        for g in range(h if t else 0):
            units += [(r, g, None)] * (piece_cost if t * n < work else 0) + [(r, g, i) for i in range(t)]
    runs, holders = [], defaultdict(list)
    for j in range(n):
        mine = units[j * len(units) // n:(j + 1) * len(units) // n]
        for (r, g), run in itertools.groupby(mine, key=lambda x: x[:2]):
            run = [i for _, _, i in run if i is not None]
            if run:
                runs.append((j, r, g, run[0] * TILE_TOKENS, min((run[-1] + 1) * TILE_TOKENS, int(lens[r])),
                             mine[0][:2] == (r, g)))
                holders[(r, g)].append(j)
    want = []
    for j, r, g, t0, t1, starts in runs:
        ctas = holders[(r, g)]
        if len(ctas) == 1:
            want.append((j, r, g, t0, t1, -1, ()))
            continue
        slot = 2 * j if starts else 2 * j + 1
        first = next(2 * c if st else 2 * c + 1 for c, rr, gg, _, _, st in runs if (rr, gg) == (r, g))
        want.append((j, r, g, t0, t1, slot, (first, *(2 * c for c in ctas[1:]))))
    return want


def _pieces(lens, h, num_ctas, min_tiles, piece_cost):
    return [(p.cta, p.row, p.kv_head, p.t_begin, p.t_end, p.slot, p.merger_slots)
            for p in graph_pieces(lens, h, num_ctas, min_tiles, piece_cost)]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("num_ctas,min_tiles", [(264, 4), (132, 2), (7, 1)])
@pytest.mark.parametrize("piece_cost", [0, 1, 3])
def test_pieces_are_the_units_cut_equally(name, num_ctas, min_tiles, piece_cost):
    assert _pieces(CASES[name], 8, num_ctas, min_tiles, piece_cost) == \
        pieces_unit_by_unit(CASES[name], 8, num_ctas, min_tiles, piece_cost)


@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(0, 3000), min_size=1, max_size=24), h=st.sampled_from([1, 2, 8]),
       num_ctas=st.sampled_from([1, 3, 7, 64, 264]), min_tiles=st.integers(1, 8), piece_cost=st.integers(0, 4))
def test_random_steps_are_the_units_cut_equally(lens, h, num_ctas, min_tiles, piece_cost):
    """Random steps: the oracle's pieces and slots are the unit-by-unit cut's."""
    want = pieces_unit_by_unit(lens, h, num_ctas, min_tiles, piece_cost)
    assert _pieces(lens, h, num_ctas, min_tiles, piece_cost) == want


@pytest.mark.parametrize("lens", [[8192], [1024], [1024] * 32, [40_000] * 3, [16384, 20000, 1 << 17]])
def test_piece_cost_leaves_steps_of_long_segments_alone(lens):
    """Set-up units go in front of segments shorter than a CTA's range only: a step whose
    segments all span a range (B1 1K ... B32 1K, long rows) is cut as without them."""
    assert graph_pieces(lens, 8, 264, piece_cost=3) == graph_pieces(lens, 8, 264)


@pytest.mark.parametrize("name", ["B8 bimodal 512/24K", "1x32K + 31 short", "B16 uniform 1-8K", "1x128K + 7x1K"])
def test_piece_cost_evens_tiles_plus_pieces(name):
    """What set-up units are for (docs/perf-notes.md): with a set-up of one tile a piece, the busiest
    CTA's tiles + pieces come closer to the mean than the tiles-only cut leaves them."""
    from pkv.bench.kernels import ragged

    lens = next(c.lens for c in ragged() if c.name == name)

    def busiest(piece_cost):
        load = defaultdict(int)
        for p in graph_pieces(lens, 8, 264, piece_cost=piece_cost):
            load[p.cta] += num_tiles(p.t_end - p.t_begin) + 1
        return max(load.values()) / np.mean(list(load.values()))

    assert busiest(1) < busiest(0) - 0.02 and busiest(1) < 1.03


def test_piece_cost_is_bounded():
    with pytest.raises(ValueError, match="piece_cost"):
        graph_pieces([100, 5000], 8, 264, piece_cost=65)


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="at most"):
        graph_pieces(np.ones(GRAPH_MAX_ROWS + 1, dtype=np.int64), 8, 264)


@pytest.mark.parametrize("piece_cost", [0, 2])
def test_cpu_engine_matches_reference(piece_cost):
    lens = np.array([5000, 31, 1, 700, 2048, 33])
    shape = Shape(20, 4, 64, 16, "float32")
    cache = PagedCache.random(shape, assign_pages(lens, 16, 0.5, 3), seed=3)
    step = StepState(0, np.array([4, 1, 0, 3, 5]), np.array([2000, 31, 4999, 1, 33], dtype=np.int32))
    q = cache.query(5, 1)
    engine = make_engine("pkv-graph", cache, piece_cost=piece_cost)
    out = engine.run(q, engine.prepare(step))
    ids = torch.as_tensor(step.request_ids)
    ref = attention_reference(q, cache.kv, cache.block_table[ids], torch.as_tensor(step.seq_lens))
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
    sched = graph_schedule(step.seq_lens, 4, engine.num_ctas, engine.min_tiles, piece_cost)
    assert sched.launches[0].num_tasks == len(graph_pieces(step.seq_lens, 4, engine.num_ctas, engine.min_tiles,
                                                           piece_cost))
    with pytest.raises(ValueError, match="piece_cost"):
        make_engine("pkv-graph", cache, piece_cost=-1)
    with pytest.raises(ValueError, match="counter_stride"):
        make_engine("pkv-graph", cache, counter_stride=33)
    with pytest.raises(ValueError, match="spin_ns"):
        make_engine("pkv-graph", cache, spin_ns=-5)


def test_padded_step_and_capacity_on_cpu():
    lens = np.array([100, 200, 300])
    cache = PagedCache.random(Shape(8, 2, 64, 16, "float32"), assign_pages(lens, 16, 0.0, 0))
    engine = make_engine("pkv-graph", cache, max_rows=3)
    step = StepState(0, np.array([2, 0]), np.array([300, 5], dtype=np.int32))
    plan = engine.prepare(step, rows=3)
    # [lengths | request ids] at the kernel's fixed address, padding rows zero
    assert engine.meta[:6].tolist() == [300, 5, 0, 2, 0, 0]
    out = engine.run(cache.query(3, 0), plan)
    assert out.shape[0] == 3
    with pytest.raises(ValueError, match="exceeds its capacity of 3 rows"):
        engine.prepare(step, rows=4)


@pytest.mark.parametrize("name", [*CASES, "B4 near 33K", "bimodal B8"])
@pytest.mark.parametrize("num_ctas,min_tiles", [(264, 4), (264, 1), (132, 2), (40, 1)])
@pytest.mark.parametrize("piece_cost", [0, 1, 3])
def test_in_grid_merge_never_waits_with_work_left(name, num_ctas, min_tiles, piece_cost):
    """The in-grid merge: a CTA may wait for a segment's other CTAs only where that segment's
    piece ends its range. The rule every CTA computes (grid_merge_roles: the late CTA is j1 when
    its range goes on) must name the CTAs with pieces left, read off the cut itself (exactly
    those with piece_cost 0; with set-up units a late CTA's range may go on into set-up units
    only, so it waits for nothing and merges nothing without need); the B4 case is a serving
    step whose waits would chain through the grid if a CTA with pieces left waited."""
    lens = np.asarray({"B4 near 33K": [32786, 32801, 32780, 32783],
                       "bimodal B8": [512, 24576, 700, 30000, 1500, 26000, 480, 31000]}.get(name) or CASES[name])
    h = 8
    pieces = graph_pieces(lens, h, num_ctas, min_tiles, piece_cost)
    last = {p.cta: (p.row, p.kv_head) for p in pieces}          # each CTA's last piece
    ctas = defaultdict(list)
    for p in pieces:
        if p.slot >= 0:
            ctas[(p.row, p.kv_head)].append(p.cta)
    roles = grid_merge_roles(lens, h, num_ctas, min_tiles, piece_cost)
    assert {(g.row, g.kv_head) for g in roles} == {k for k, v in ctas.items() if len(v) > CTA_MERGE_STATES}
    for g in roles:
        assert g.ctas == tuple(ctas[(g.row, g.kv_head)])
        with_work_left = [j for j in g.ctas if last[j] != (g.row, g.kv_head)]
        late = [g.late] if g.late is not None else []
        assert with_work_left == late if piece_cost == 0 else set(with_work_left) <= set(late)
        assert g.late in (None, g.ctas[-1])
        assert 1 <= g.slices <= min(MERGE_SLICES, len(g.ctas) - (g.late is not None))
    if name == "B4 near 33K" and (num_ctas, min_tiles) == (264, 4):
        assert any(g.late is not None for g in roles)          # the straddling CTAs that must not wait



# Short steps: a step of at most short_tiles tiles a CTA over half the grid runs on half of it.
@pytest.mark.parametrize("lens,short_tiles,want", [
    ([1024], 8, 128),         # 256 tiles: half the grid (132), 8 segments -> 128 CTAs of 2 tiles
    ([1024] * 2, 0, 256),     # off: the full grid, a multiple of the 16 segments
    ([1024] * 2, 8, 128),     # on: half of it
    ([4096], 8, 128),         # 1024 tiles <= 8 x 132: half the grid, 16 CTAs a segment
    ([4096], 4, 264),         # 1024 tiles > 4 x 132: the full grid
    ([2048] * 8, 8, 256),     # 4096 tiles: the full grid, a multiple of the 64 segments
    ([0, 300, 0], 8, 80),     # 80 tiles: fewer than half the grid; padding rows hold no segment
])
def test_short_steps_take_half_the_grid(lens, short_tiles, want):
    """8 KV heads on a 264-CTA grid (132 SMs x 2), min_tiles 1."""
    assert active_ctas(np.asarray(lens), 8, 264, 1, short_tiles=short_tiles) == want


@settings(max_examples=200, deadline=None)
@given(work=st.integers(1, 20_000), segments=st.integers(1, 600), num_ctas=st.sampled_from([1, 2, 8, 64, 264, 396]),
       min_tiles=st.integers(1, 8), short_tiles=st.sampled_from([0, 4, 8, 64]))
def test_short_steps_only_ever_halve_the_grid(work, segments, num_ctas, min_tiles, short_tiles):
    """Off, the rule is the full-grid cut; on, a step over half the grid is untouched and a short
    one gets the cut of a half-size grid (never fewer than one CTA)."""
    segments = min(segments, work)
    full = grid_ctas(work, segments, num_ctas, min_tiles, 0)
    n = min(num_ctas, -(-work // min_tiles))
    if segments <= n:
        n = n // segments * segments
    assert full == n
    half = max(num_ctas // 2, 1)
    got = grid_ctas(work, segments, num_ctas, min_tiles, short_tiles)
    short = work <= short_tiles * half
    assert got == (grid_ctas(work, segments, half, min_tiles, 0) if short and full > half else full)
    assert 1 <= got <= num_ctas


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(0, 3000), min_size=1, max_size=24), h=st.sampled_from([1, 2, 8]),
       num_ctas=st.sampled_from([8, 64, 264]), short_tiles=st.sampled_from([4, 8, 16]),
       piece_cost=st.sampled_from([0, 8]))
def test_short_steps_cover_every_token_once(lens, h, num_ctas, short_tiles, piece_cost):
    """With short steps on, the pieces still cover each row's tiles exactly once, CTAs 0..n-1."""
    if sum(lens) == 0:
        lens = [*lens[:-1], 1]
    pieces = graph_pieces(np.asarray(lens), h, num_ctas, 1, piece_cost, short_tiles=short_tiles)
    n = active_ctas(np.asarray(lens), h, num_ctas, 1, short_tiles=short_tiles)
    assert {p.cta for p in pieces} <= set(range(n))
    seen = defaultdict(list)
    for p in pieces:
        seen[(p.row, p.kv_head)].append((p.t_begin, p.t_end))
    for r, length in enumerate(lens):
        for g in range(h):
            ranges = sorted(seen.get((r, g), []))
            assert (not ranges) if length == 0 else (ranges[0][0] == 0 and ranges[-1][1] == length)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("bad", [-1, 2.5, "8"])
def test_the_engine_refuses_a_bad_short_tiles(bad):
    shape = Shape(num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16)
    cache = PagedCache.random(shape, assign_pages([300, 300], 16, 0.0, 3), seed=3)
    with pytest.raises(ValueError, match="short_tiles"):
        make_engine("pkv-graph", cache, short_tiles=bad)
