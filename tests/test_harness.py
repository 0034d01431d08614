import numpy as np
import pytest

from pkv.core.harness import decode_steps, peak_active, step_metadata
from pkv.core.paging import assign_pages
from pkv.core.traces import Trace


def trace(arrival, prompt, decode):
    return Trace("t", np.array(arrival), np.array(prompt), np.array(decode))


def test_continuous_batching_admission_growth_completion():
    t = trace([0, 0, 0, 5], [10, 20, 30, 40], [2, 3, 1, 1])
    steps = [(s.step, s.request_ids.tolist(), s.seq_lens.tolist()) for s in decode_steps(t, max_active=2)]
    assert steps == [
        (0, [0, 1], [11, 21]),
        (1, [0, 1], [12, 22]),   # request 0 done after its 2 tokens
        (2, [1, 2], [23, 31]),   # request 2 takes the free slot; 1 on its last token
        (5, [3], [41]),          # steps 3 and 4 are idle (3 arrives at 5) and skipped
    ]


def test_every_request_decodes_exactly_its_tokens_up_to_reserved_length():
    rng = np.random.default_rng(0)
    n = 30
    t = trace(np.sort(rng.integers(0, 40, n)), rng.integers(1, 500, n), rng.integers(1, 9, n))
    seen = {}
    for s in decode_steps(t, max_active=4):
        assert 1 <= s.active <= 4
        for r, length in zip(s.request_ids, s.seq_lens):
            seen.setdefault(int(r), []).append(int(length))
            assert t.arrival_step[r] <= s.step
    for r, lens in seen.items():
        assert lens == list(range(t.prompt_len[r] + 1, t.total_len[r] + 1))
    assert sorted(seen) == list(range(n))


def test_max_steps_and_peak_active():
    t = trace([0] * 6, [5] * 6, [10] * 6)
    assert len(list(decode_steps(t, 3, max_steps=4))) == 4
    assert peak_active(t, 3) == 3 and peak_active(t, 8) == 6
    with pytest.raises(ValueError):
        next(decode_steps(t, 0))


def test_step_metadata_views_agree():
    t = trace([0, 0, 0], [15, 16, 17], [3, 3, 3])
    a = assign_pages(t.total_len, 16, 0.5, 1)
    state = next(decode_steps(t, 3))
    meta = step_metadata(state, a)
    assert meta.seq_lens.tolist() == [16, 17, 18]
    fi = meta.flashinfer
    assert fi.indptr.tolist() == [0, 1, 3, 5] and fi.last_page_len.tolist() == [16, 1, 2]
    for i in range(3):
        np.testing.assert_array_equal(fi.indices[fi.indptr[i]:fi.indptr[i + 1]],
                                      meta.block_table[i][: fi.indptr[i + 1] - fi.indptr[i]])
