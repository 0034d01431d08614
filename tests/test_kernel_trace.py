"""The phase budget `pkv bench kernels --trace` reads from a traced call's stamps (CPU:
synthetic records with known clocks)."""

import numpy as np

from pkv.bench.kernels import DECODE_FIELDS, TRACE_CTAS, TRACE_FIELDS, trace_phases

F = {name: i for i, name in DECODE_FIELDS.items()}


def record(finer: bool) -> np.ndarray:
    rec = np.zeros((TRACE_CTAS, TRACE_FIELDS), dtype=np.int64)
    for cta in range(4):
        r = rec[cta]
        r[F["gt_start"]], r[F["gt_end"]] = 1000 + cta, 11000   # ns
        # clocks at 2 GHz (2 per ns): entry, scan, cut, pages, first KV, loop end, state, end
        for name, t in (("start", 100), ("scan", 2500), ("cut", 3700), ("pages", 7300), ("first_kv", 8500),
                        ("loop_end", 10500), ("state", 11500), ("end", 20100)):
            r[F[name]] = t
        if finer:
            r[F["lengths_in"]], r[F["piece_ready"]], r[F["bt_in"]] = 1500, 4300, 6700
        r[F["flags"]] = 1 | (1 << 8)
    return rec


def test_the_finer_stamps_split_the_scan_and_the_block_table_phase():
    ph = trace_phases(record(True), clock_ghz=2.0)
    assert abs(ph["scan"] - 1.2) < 1e-9 and abs(ph["lengths_rt"] - 0.7) < 1e-9 and abs(ph["scan_math"] - 0.5) < 1e-9
    assert abs(ph["bt"] - 1.8) < 1e-9
    assert abs(ph["setup"] - 0.3) < 1e-9 and abs(ph["bt_rt"] - 1.2) < 1e-9 and abs(ph["issue"] - 0.3) < 1e-9
    assert ph["active_ctas"] == 4 and abs(ph["start_skew"] - 0.003) < 1e-9


def test_a_build_without_them_reports_the_coarse_phases_only():
    ph = trace_phases(record(False), clock_ghz=2.0)
    assert "scan" in ph and "bt" in ph
    assert not {"lengths_rt", "scan_math", "setup", "bt_rt", "issue"} & set(ph)
