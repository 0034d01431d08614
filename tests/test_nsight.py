"""The ncu CSV parser on a capture recorded on the H200 (pipeline's nsight rule, B8 bimodal G=4)."""

from pathlib import Path

import pytest

from pkv.measure.nsight import NcuCsvError, kernel_role, parse_ncu_csv, table5

FIXTURE = Path(__file__).parent / "data" / "ncu_b8_bimodal_h200.csv"


def test_one_row_per_invocation_with_named_unit_columns():
    f = parse_ncu_csv(FIXTURE)
    assert f["invocation"].tolist() == list(range(len(f))) and len(f) == 40
    assert f["kernel"].value_counts().to_dict() == {
        "FlashInfer merge": 16, "FlashInfer decode (CUDA cores)": 8, "PersistentKV decode": 8, "PersistentKV merge": 8}
    first = f.iloc[0]
    # Recorded as "160,416" ns and "3,052,746,060,243.37" byte/s.
    assert first["time_us"] == pytest.approx(160.416)
    assert first["dram_read_gbps"] == pytest.approx(3052.74606024337)
    assert first["grid"] == "(147, 8, 1)" and first["l2_hit_pct"] == pytest.approx(0.68)
    for col in ("sm_throughput_pct", "mem_throughput_pct", "l2_hit_pct"):
        assert f[col].between(0, 100).all()


def test_table5_layout_and_roofline_fraction():
    t = table5(parse_ncu_csv(FIXTURE), roofline_gbps=4000.0).set_index("Kernel")
    assert list(t.columns) == ["Invocations", "Time ms", "SM thr. %", "Mem. thr. %", "DRAM GB/s", "DRAM / roofline",
                               "L2 hit %"]
    row = t.loc["PersistentKV decode"]
    assert row["DRAM / roofline"] == pytest.approx(row["DRAM GB/s"] / 4000.0)
    assert 0.05 < row["Time ms"] < 1.0


def test_kernel_roles():
    assert kernel_role("void pkv::(anonymous namespace)::graph_decode_kernel<__half, 128, 1, false>(P)") == \
        "PersistentKV graph decode (pkv-graph)"
    assert (kernel_role("void flashinfer::BatchPrefillWithPagedKVCacheKernel<1>(P)")
            == "FlashInfer decode (tensor cores)")
    assert kernel_role("void flashinfer::PersistentVariableLengthMergeStatesKernel<8>(T)") == "FlashInfer merge"
    assert kernel_role("void other::thing<int>(x)") == "other::thing"


@pytest.mark.parametrize("text, needle", [
    ("==PROF== Disconnected from process 1\n", "no CSV rows"),
    ('"ID","Kernel Name"\n"0","k"\n', "missing column(s)"),
    ('"ID","Kernel Name","Grid Size","Block Size","Metric Name","Metric Unit","Metric Value"\n'
     '"0","k","(1, 1, 1)","(1, 1, 1)","gpu__time_duration.sum","fortnight","1"\n', "unit 'fortnight'"),
])
def test_bad_captures(tmp_path, text, needle):
    p = tmp_path / "ncu.csv"
    p.write_text(text)
    with pytest.raises(NcuCsvError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_ncu_csv(p)


def test_parse_command_keeps_the_profiled_runs_provenance(tmp_path):
    import json

    import pandas as pd

    from pkv.cli.main import main
    from pkv.core.io import read_meta, write_parquet

    run = tmp_path / "run.parquet"
    write_parquet(pd.DataFrame({"step": [0]}), run, {"gpu": "NVIDIA H200", "git_commit": "abc", "stage": "nsight"})
    constants = tmp_path / "constants.json"
    constants.write_text(json.dumps({"beta_bytes_per_s": 4.0e12}))
    out = tmp_path / "kernels.parquet"
    assert main(["nsight-parse", "--csv", str(FIXTURE), "--run", str(run), "--constants", str(constants),
                 "--out", str(out)]) == 0
    meta = read_meta(out)
    assert meta["gpu"] == "NVIDIA H200" and meta["git_commit"] == "abc" and meta["stage"] == "nsight_kernels"
    assert meta["roofline_gbps"] == "4000.0"
    frame = pd.read_parquet(out)
    assert len(frame) == 40 and (frame["roofline_gbps"] == 4000.0).all()
