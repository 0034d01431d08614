import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pkv.core.paging import assign_pages, flashinfer_view

lengths = st.lists(st.integers(1, 3000), min_size=1, max_size=12)


def slots_via_block_table(table_row, seq_len, page_size):
    t = np.arange(seq_len)
    return table_row[t // page_size].astype(np.int64) * page_size + t % page_size


def slots_via_flashinfer(view, i, seq_len, page_size):
    pages = view.indices[view.indptr[i]:view.indptr[i + 1]].astype(np.int64)
    assert len(pages) == -(-seq_len // page_size)
    assert 1 <= view.last_page_len[i] <= page_size
    assert (len(pages) - 1) * page_size + view.last_page_len[i] == seq_len
    t = np.arange(seq_len)
    return pages[t // page_size] * page_size + t % page_size


@settings(max_examples=60, deadline=None)
@given(totals=lengths, page_size=st.sampled_from([1, 16, 32, 64]), holes=st.floats(0.0, 0.9),
       seed=st.integers(0, 2**31), data=st.data())
def test_both_views_name_the_same_slots(totals, page_size, holes, seed, data):
    totals = np.array(totals)
    a = assign_pages(totals, page_size, holes, seed)
    table = a.block_table()
    # A step: any subset of requests, in any order, each at any length up to its total.
    ids = np.array(data.draw(st.permutations(range(len(totals)))))[: data.draw(st.integers(1, len(totals)))]
    lens = np.array([data.draw(st.integers(1, int(totals[i]))) for i in ids])
    view = flashinfer_view(a, ids, lens)
    for i, (r, n) in enumerate(zip(ids, lens)):
        np.testing.assert_array_equal(slots_via_block_table(table[r], n, page_size),
                                      slots_via_flashinfer(view, i, n, page_size))


@settings(max_examples=60, deadline=None)
@given(totals=lengths, page_size=st.sampled_from([1, 16, 32, 64]), holes=st.floats(0.0, 0.9),
       seed=st.integers(0, 2**31))
def test_assignment_follows_section_3_7(totals, page_size, holes, seed):
    totals = np.array(totals)
    a = assign_pages(totals, page_size, holes, seed)
    counts = -(-totals // page_size)
    assert (np.diff(a.page_offsets) == counts).all()
    assert (a.reserved_len == counts * page_size).all()
    assert a.num_pages == int(np.ceil(counts.sum() / (1 - holes)))
    # Distinct physical pages inside the universe: no two requests share a page.
    assert len(np.unique(a.pages)) == len(a.pages) and a.pages.min() >= 0 and a.pages.max() < a.num_pages
    # Each request's pages are a consecutive slice of one seeded permutation of the universe.
    perm = np.random.default_rng(seed).permutation(a.num_pages)
    np.testing.assert_array_equal(a.pages, perm[: counts.sum()])


def test_granularity_rounds_to_bucket_and_holes_double_universe():
    a = assign_pages(np.array([1000, 8193]), 16, 0.5, 3, granularity=8192)
    assert a.reserved_len.tolist() == [8192, 16384]
    assert a.num_pages == 2 * (8192 + 16384) // 16


def test_block_table_padding_cycles_own_pages():
    a = assign_pages(np.array([16, 64]), 16, 0.0, 0)
    table = a.block_table()
    assert table.shape == (2, 4) and table.dtype == np.int32
    assert (table[0] == a.request_pages(0)[0]).all()
    np.testing.assert_array_equal(table[1], a.request_pages(1))


def test_same_seed_same_assignment():
    a, b = (assign_pages(np.array([50, 70, 90]), 16, 0.3, 11) for _ in range(2))
    np.testing.assert_array_equal(a.pages, b.pages)
    assert not np.array_equal(a.pages, assign_pages(np.array([50, 70, 90]), 16, 0.3, 12).pages)


@pytest.mark.parametrize("kwargs", [dict(holes=1.0), dict(holes=-0.1), dict(page_size=0), dict(granularity=24)])
def test_bad_arguments(kwargs):
    args = dict(total_lens=np.array([10]), page_size=16, holes=0.0, seed=0) | kwargs
    with pytest.raises(ValueError):
        assign_pages(**args)


def test_flashinfer_view_rejects_lengths_past_reservation():
    a = assign_pages(np.array([20]), 16, 0.0, 0)
    with pytest.raises(ValueError, match="exceeds"):
        flashinfer_view(a, np.array([0]), np.array([33]))
