"""The GPU engine's lean launch builder reproduces pkv.plan.schedule exactly (runs on the CPU)."""

import numpy as np
import pytest

from pkv.engines.persistent import kernel_launches
from pkv.plan.schedule import SplitPolicy, bucket_schedule, masked_schedule, workqueue_schedule

BUILDERS = {"bucket": bucket_schedule, "masked": masked_schedule, "workqueue": workqueue_schedule}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("seed", range(12))
def test_matches_schedule(kind, seed):
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(1, 20))
    lens = rng.integers(1, int(rng.choice([40, 3000, 70000])), size=batch).astype(np.int32)
    if seed % 3 == 0:
        lens[: batch // 2] = lens[-1]  # repeated lengths: multi-row buckets
    h = int(rng.choice([1, 2, 8, 32]))
    policy = SplitPolicy(int(rng.integers(1, 70)), int(rng.integers(1, 5)))
    ours = kernel_launches(kind, lens, h, policy)
    ref = BUILDERS[kind](lens, h, policy).launches
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.queue == (b.kind == "queue")
        np.testing.assert_array_equal(a.rows, b.rows)
        assert a.splits == b.splits and a.num_tasks == b.num_tasks and a.needs_merge == b.needs_merge
        assert a.bound == int(lens[b.rows].max())
        if a.needs_merge or a.queue:
            np.testing.assert_array_equal(a.seg_offsets, b.seg_offsets)
        if a.queue:
            np.testing.assert_array_equal(a.tasks, b.tasks)
