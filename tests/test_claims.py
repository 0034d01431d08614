"""The claims table (pkv.report.claims): its verdict rule, its numbers against the tables
that show them, and that it is a report target of the paper profile's `all` (the README links
it and quotes its verdict counts: tests/test_readme_commands.py)."""

from pathlib import Path

import pytest

from pkv.report import claims
from pkv.report.claims import NOT_MEASURED, NOT_REPRODUCED, REPRODUCED, REVERSED, STRONGER, WEAKER, route_kind, verdict
from pkv.report.spec import TABLE_SPECS, in_all
from pkv.report.tables import BUILDERS, _build_target, _load_cached, targets

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
CLAIMS_MD = RESULTS / "tables" / "claims.md"


# ---------------------------------------------------------------- the verdict rule


@pytest.mark.parametrize("paper, value, expected", [
    (1.403, 1.50, REPRODUCED),          # same side, within the factor
    (1.044, 1.001, NOT_REPRODUCED),     # this run at parity, the paper not
    (1.005, 2.142, NOT_REPRODUCED),     # the paper at parity, this run not
    (1.0, 1.01, REPRODUCED),            # both at parity
    (1.044, 0.976, REVERSED),           # opposite sides of 1
    (0.556, 1.108, REVERSED),
    (1.080, 1.930, STRONGER),           # same side, beyond the factor, further from 1
    (2.0, 1.2, WEAKER),                 # same side, beyond the factor, nearer to 1
    (0.5, 0.3, STRONGER),               # below 1 too
    (1.2, None, NOT_MEASURED),
    (1.2, float("nan"), NOT_MEASURED),
])
def test_ratio_verdict(paper, value, expected):
    assert verdict("ratio", paper, value) == expected


def test_factor_bounds_are_inclusive_both_ways():
    assert verdict("ratio", 1.2, 1.2 * claims.FACTOR) == REPRODUCED
    assert verdict("ratio", 1.6, 1.6 / claims.FACTOR) == REPRODUCED
    assert verdict("ratio", 1.6, 1.6 / claims.FACTOR - 0.01) == WEAKER


@pytest.mark.parametrize("expect, value, expected", [
    ("< 1", 0.8, REPRODUCED), ("< 1", 1.0, NOT_REPRODUCED), ("< 1", 1.5, REVERSED),
    ("> 1", 1.3, REPRODUCED), ("> 1", 0.9, REVERSED), ("> 1", None, NOT_MEASURED),
])
def test_side_verdict(expect, value, expected):
    assert verdict("side", None, value, expect) == expected


def test_no_regression_route_and_limit_verdicts():
    assert verdict("no_regression", 1.0, 0.99) == REPRODUCED
    assert verdict("no_regression", 1.0, 1.8) == REPRODUCED
    assert verdict("no_regression", 1.0, 0.9) == NOT_REPRODUCED
    assert verdict("route", None, ("FlashInfer",), "FlashInfer") == REPRODUCED
    assert verdict("route", None, ("FlashInfer", "PersistentKV workqueue"), "FlashInfer") == NOT_REPRODUCED
    assert verdict("route", None, None, "FlashInfer") == NOT_MEASURED
    assert verdict("limit", 6e-5, 2.4e-4, 2e-3) == REPRODUCED
    assert verdict("limit", 6e-5, 3e-3, 2e-3) == NOT_REPRODUCED
    with pytest.raises(ValueError, match="unknown claim kind"):
        verdict("bogus", 1.0, 1.0)


def test_route_kinds():
    assert route_kind("flashinfer-tc") == "FlashInfer"
    assert route_kind("pkv-bucket/s32 (94% of steps)") == "PersistentKV bucket"
    assert route_kind("pkv-workqueue/s8") == "PersistentKV workqueue"


def test_every_claim_has_a_kind_the_rule_knows_and_a_paper_side():
    for c in claims.CLAIMS:
        assert c.kind in ("ratio", "side", "no_regression", "route", "limit"), c.claim
        assert c.paper is not None or c.kind in ("side", "route"), c.claim   # a side or route alone: no number
        assert c.kind not in ("side", "route", "limit") or c.expect is not None, c.claim
        assert "|" not in c.claim + c.paper_text + c.why, c.claim   # a bar would break the Markdown table


# ---------------------------------------------------------------- the numbers are the tables'


@pytest.fixture(scope="module")
def measured():
    d = claims.gather(RESULTS)
    return {c.claim: c.measure(d) for c in claims.CLAIMS}


@pytest.fixture(scope="module")
def table():
    cache: dict = {}

    def build(name):
        spec = TABLE_SPECS[name]
        return BUILDERS[name](_load_cached(RESULTS, spec.stages, spec.required, cache))
    return build


def _cell(frame, column, **where):
    for k, v in where.items():
        frame = frame[frame[k] == v]
    assert len(frame) == 1, where
    return str(frame[column].iloc[0])


@pytest.mark.parametrize("trace", ["Bucketed B1", "Bimodal B8", "Uniform B8", "Zipf B8"])
def test_serving_claims_are_table2s_cells(measured, table, trace):
    t = table("serving")
    assert measured[f"{trace} wall tok/s ratio, adaptive ÷ FlashInfer"][1].startswith(
        _cell(t, "Wall tok/s ratio", **{"Trace / mode": trace}) + " ")
    assert measured[f"{trace} CUDA tok/s ratio"][1].startswith(_cell(t, "CUDA tok/s ratio", **{"Trace / mode": trace}))


def test_other_claims_are_their_tables_cells(measured, table):
    serving = table("serving")
    assert measured["Bimodal B4: no regression against FlashInfer (wall)"][1].startswith(
        _cell(serving, "Wall tok/s ratio", **{"Trace / mode": "Bimodal B4"}))
    assert measured["Bimodal B4 route"][1] == _cell(serving, "Selected route", **{"Trace / mode": "Bimodal B4"})
    ratio = table("mlp_proxy")
    assert measured["Attention + MLP tail (1 layer, bimodal B8) wall tok/s ratio"][1].startswith(
        _cell(ratio, "Wall tok/s", Layers="1", Engine="Ratio").rstrip("×"))
    gqa = table("gqa_sweep")
    assert measured["GQA G = 4 (bimodal B8, one seed) wall tok/s ratio"][1] == _cell(gqa, "Wall tok/s ratio", G="4")
    assert measured["Ungated workqueue at G = 1 and G = 8 loses (wall)"][1] == " / ".join(
        _cell(gqa, "Ungated workqueue wall ratio", G=g) for g in ("1", "8"))
    counters = table("counters")
    launches = [_cell(counters, "Launches/step", Trace="Bimodal B8", Engine=e) for e in ("pkv-bucket", "pkv-workqueue")]
    assert f"({launches[0]} → {launches[1]})" in measured["Bimodal B8 launches/step, exact buckets ÷ workqueue"][1]
    split = _cell(table("split_sensitivity"), "Wall tok/s ratio", Trace="Bimodal B8").split(" / ")
    text = measured["Bimodal B8: every split near the frozen one stays wall-positive"][1]
    assert all(f"{r} at s" in text for r in split)
    iso = table("isolated")
    pkv = _cell(iso, "64K ms", Method="pkv-bucket, auto split").split(" ")[0]
    assert f" {pkv} ÷ " in measured["PersistentKV auto split ÷ FlashInfer latency, 64K"][1]
    assert measured["External request trace, B8, wall tok/s ratio"][1] == _cell(
        table("external"), "Wall tok/s ratio", Engine="adaptive")
    assert measured["Coarse masked bucket loses on bimodal B8 (wall)"][1].startswith(
        _cell(table("raggedness"), "Wall ratio vs FlashInfer", Engine="pkv-masked"))
    assert measured["Fused merge (atomic completion) ÷ two-kernel workqueue (wall)"][1].startswith(
        _cell(table("ablations"), "Wall vs pkv-workqueue", Engine="pkv-fused"))
    best = max(table("b4_sweep")["Wall ratio"], key=lambda c: float(c.split("±")[0])).split("±")[0]
    assert measured["Bimodal B4, forced workqueue: no robust wall win at any split"][1].startswith(f"best {best} ")
    nsight = table("nsight")
    assert f"({_cell(nsight, 'Time ms', Kernel='PersistentKV decode')} ÷ " in \
        measured["Nsight: PersistentKV decode ÷ FlashInfer decode kernel time"][1]


# ---------------------------------------------------------------- a report target, in `all`


def test_the_claims_table_is_a_report_target_of_the_paper_profile():
    spec = TABLE_SPECS["claims"]
    assert spec.render == "claims_md" and CLAIMS_MD in targets(RESULTS)
    assert in_all(spec, "paper") and not in_all(spec, "smoke")   # smoke numbers would make the verdicts meaningless
    assert _build_target(RESULTS, CLAIMS_MD, {}) == CLAIMS_MD.read_bytes()

