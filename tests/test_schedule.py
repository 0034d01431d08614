import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pkv.core.shape import Shape
from pkv.plan.schedule import (
    TILE_TOKENS,
    SplitPolicy,
    bucket_schedule,
    masked_schedule,
    split_bounds,
    workqueue_schedule,
)

lens_strategy = st.lists(st.integers(1, 5000), min_size=1, max_size=10).map(np.array)


def ranges_by_segment(launch, num_kv_heads):
    out = {}
    for i, row in enumerate(launch.rows):
        for g in range(num_kv_heads):
            lo, hi = launch.seg_offsets[i * num_kv_heads + g], launch.seg_offsets[i * num_kv_heads + g + 1]
            seg = launch.tasks[lo:hi]
            assert (seg[:, 0] == row).all() and (seg[:, 1] == g).all()
            assert seg[:, 2].tolist() == list(range(hi - lo))
            out[(int(row), g)] = [(int(b), int(e)) for b, e in seg[:, 3:5] if e > b]
    return out


def assert_tiles_cover(ranges, length):
    """Non-empty ranges are tile-aligned, ordered and cover [0, length) exactly once."""
    assert ranges[0][0] == 0 and ranges[-1][1] == length
    for (_, e0), (b1, _) in zip(ranges, ranges[1:]):
        assert e0 == b1 and e0 % TILE_TOKENS == 0


@settings(max_examples=80, deadline=None)
@given(lens=lens_strategy, h=st.integers(1, 4), splits=st.integers(1, 40), min_tiles=st.integers(1, 8))
def test_every_schedule_covers_every_row_and_head_exactly_once(lens, h, splits, min_tiles):
    policy = SplitPolicy(splits, min_tiles)
    for schedule in (bucket_schedule(lens, h, policy), masked_schedule(lens, h, policy),
                     workqueue_schedule(lens, h, policy)):
        covered = {}
        for launch in schedule.launches:
            covered.update(ranges_by_segment(launch, h))
        assert sorted(covered) == [(r, g) for r in range(len(lens)) for g in range(h)]
        for (r, _), ranges in covered.items():
            assert_tiles_cover(ranges, int(lens[r]))


@settings(max_examples=80, deadline=None)
@given(lens=lens_strategy, h=st.integers(1, 4), splits=st.integers(1, 40))
def test_workqueue_emits_only_non_empty_tasks_in_one_launch(lens, h, splits):
    s = workqueue_schedule(lens, h, SplitPolicy(splits, 1))
    (launch,) = s.launches
    assert launch.kind == "queue"
    assert (launch.tasks[:, 4] > launch.tasks[:, 3]).all()
    # The longest row is cut like a grid row with the operating point's split count.
    longest = int(np.argmax(lens))
    n_tiles = -(-int(lens[longest]) // TILE_TOKENS)
    chunk = -(-n_tiles // splits)
    assert len(ranges_by_segment(launch, h)[(longest, 0)]) == -(-n_tiles // chunk)
    # Equal-work chunks: no task is longer than the longest row's chunk.
    assert (launch.tasks[:, 4] - launch.tasks[:, 3]).max() <= chunk * TILE_TOKENS


@given(bound=st.integers(1, 100_000), splits=st.integers(1, 64))
def test_split_bounds_rule(bound, splits):
    tiles = -(-bound // TILE_TOKENS)
    per = -(-tiles // splits)
    s = np.arange(splits)
    b, e = split_bounds(np.full(splits, bound), splits, s)
    assert b.tolist() == [min(i * per * TILE_TOKENS, bound) for i in s]
    assert e.tolist() == [min((i + 1) * per * TILE_TOKENS, bound) for i in s]


def test_bucket_is_one_grid_per_distinct_length_longest_first():
    lens = np.array([300, 40, 300, 1000, 40])
    s = bucket_schedule(lens, 2, SplitPolicy(4, 1))
    assert [launch.rows.tolist() for launch in s.launches] == [[3], [0, 2], [1, 4]]
    assert all(launch.kind == "grid" for launch in s.launches)
    assert [launch.splits for launch in s.launches] == [4, 4, 2]  # 40 tokens = 2 tiles: at most 2 splits
    assert s.launches[1].num_tasks == 2 * 2 * 4


def test_masked_grid_has_empty_splits_that_row_local_bounds_keep_empty():
    lens = np.array([2048, 64])
    local = masked_schedule(lens, 1, SplitPolicy(8, 1)).launches[0]
    short = local.tasks[local.tasks[:, 0] == 1]
    assert (short[:, 4] > short[:, 3]).sum() == 2 and (short[:, 4] == short[:, 3]).sum() == 6
    # Without row-local bounds the short row is cut like the long one: every split reads
    # tokens of the bucket length, most of them past the row's own 64 tokens.
    padded = masked_schedule(lens, 1, SplitPolicy(8, 1), row_local=False).launches[0]
    short = padded.tasks[padded.tasks[:, 0] == 1]
    assert (short[:, 4] - short[:, 3]).sum() == 2048 and padded.bound_len.tolist() == [2048, 2048]


def test_counters_table4_columns():
    shape = Shape()  # Hq 32, Hkv 8, d 128, fp16
    lens = np.array([40000, 41000, 3000, 3100, 3200, 3300, 3400, 3500])
    policy = SplitPolicy(20, 4)
    bucket = bucket_schedule(lens, 8, policy).counters(shape, lens, num_sms=132)
    queue = workqueue_schedule(lens, 8, policy).counters(shape, lens, num_sms=132)
    assert (bucket.decode_launches, bucket.merge_launches, bucket.launches) == (8, 8, 16)
    assert (queue.decode_launches, queue.merge_launches, queue.launches) == (1, 1, 2)
    useful = int(lens.sum()) * 2 * 8 * 128 * 2
    assert bucket.useful_kv_bytes == queue.useful_kv_bytes == useful
    assert bucket.read_kv_bytes == queue.read_kv_bytes == useful  # row-local: no padded reads
    slot = 4 * (128 + 2) * 4
    assert bucket.merge_bytes == bucket.decode_ctas * slot and queue.merge_bytes == queue.decode_ctas * slot
    assert bucket.decode_ctas == 8 * 8 * 20
    assert queue.decode_ctas < bucket.decode_ctas and queue.cta_work_per_sm == queue.decode_ctas / 132
    assert bucket_schedule(lens, 8, policy).counters(shape, lens, 132, extra_launches=16).launches == 32


def test_single_split_needs_no_merge():
    lens = np.array([20, 30])
    s = workqueue_schedule(lens, 2, SplitPolicy(4))
    assert not s.launches[0].needs_merge
    c = s.counters(Shape(4, 2, 64, 16), lens, 10)
    assert (c.launches, c.merge_bytes) == (1, 0)


@pytest.mark.parametrize("bad", [np.array([]), np.array([3, 0]), np.array([[1, 2]]), np.array([1.5])])
def test_bad_lengths(bad):
    with pytest.raises(ValueError):
        workqueue_schedule(bad, 1, SplitPolicy(2))


def test_split_policy():
    p = SplitPolicy(32, 4)
    assert p.for_length(1) == 1 and p.for_length(32 * 8) == 2 and p.for_length(65536) == 32
    with pytest.raises(ValueError):
        SplitPolicy(0)
