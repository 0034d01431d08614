"""`pkv build-kernels` (pkv.measure.warm.py): what a run loads is built side by side first."""

import json
import re
import subprocess
import sys

from pkv.bench.kernels import SUITES, suite_shapes
from pkv.cli.pipeline import run_suites
from pkv.config.resolve import effective, read_config_file
from pkv.engines import table
from pkv.measure import warm
from worktree import REPO, copy_worktree

RAW = read_config_file(REPO / "config.yaml")
PAPER = effective(RAW, "paper")
SWEEP = suite_shapes(run_suites(PAPER))   # what `pkv build-kernels` passes for the reference config
EVERY_FEATURE = {"feature_kernels": {"engines": list(table.feature_kernels())}}


def cases(suites):
    return [c for suite in suites for c in SUITES[suite]()]


def test_the_run_suites_are_those_of_the_kernel_stages_in_all():
    assert run_suites(PAPER) == ("homogeneous", "ragged", "shapes", "fp8")   # the committed reference config
    assert run_suites(effective(RAW, "paper", EVERY_FEATURE)) == ("homogeneous", "ragged", "shapes", "fp8", "features")
    assert run_suites(effective(RAW, "smoke")) == ("features",)   # the smoke profile's section; no GPU sweep


def test_variants_cover_every_flashinfer_module_the_run_loads():
    built = {(e, d, kv) for e, d, _, kv, *_ in warm.variants(PAPER, SWEEP)}
    assert {e for e, _, _ in built} - {"pkv-graph"} <= set(table.flashinfer())
    d = PAPER["shape"]["head_dim"]
    # every head_dim and KV dtype of the kernel sweep's suites the run measures, for both decode wrappers
    for case in cases(run_suites(PAPER)):
        for e in ("flashinfer", "flashinfer-tc"):
            assert (e, case.head_dim, case.kv_dtype) in built, case
    assert ("flashinfer-persistent", d, "auto") in built and ("pkv-graph", d, "auto") in built
    assert len(set(warm.variants(PAPER, SWEEP))) == len(warm.variants(PAPER, SWEEP))   # each once
    # The variants derive from the engine table: the decode wrappers per head_dim, the rest at the serving shape.
    assert warm.PER_HEAD_DIM == ("flashinfer", "flashinfer-tc")
    assert warm.SERVING_ONLY == ("flashinfer-persistent",)
    assert warm.PER_SHAPE == ("flashinfer-xqa",)


def test_xqa_is_built_at_every_shape_the_run_gives_it():
    """XQA compiles a module per (head_dim, dtype, KV dtype, GQA group, page size): the kernel
    sweep's cases, the serving shape in 16 bits and FP8, the GQA sweep's groups, the model step's models."""
    built = {v[1:6] for v in warm.variants(PAPER, SWEEP) if v[0] == "flashinfer-xqa"}
    for case in cases(run_suites(PAPER)):
        assert (case.head_dim, case.dtype, case.kv_dtype, case.group, case.page_size) in built, case
    s = PAPER["shape"]
    g = s["num_qo_heads"] // s["num_kv_heads"]
    for kv in ("auto", "fp8"):
        assert (s["head_dim"], s["dtype"], kv, g, s["page_size"]) in built
    for group in PAPER["ablations"]["gqa_sweep"]["groups"]:
        assert (s["head_dim"], s["dtype"], "auto", group, s["page_size"]) in built
    assert ("flashinfer-xqa", 128, s["dtype"], "fp8", 8, s["page_size"], *warm.PLAIN) in warm.variants(PAPER)
    assert not any(v[4] == 5 for v in warm.variants(PAPER))         # the sweep's G5 only with its shapes


def test_a_run_without_the_features_suite_builds_none_of_its_modules():
    """The committed reference config has no feature_kernels section: no window, sinks or q_len
    variant, and not the Gemma-3-like shape (d 256, G 2) only the features suite has."""
    built = warm.variants(PAPER, SWEEP)
    assert all(tuple(v[6:]) == warm.PLAIN for v in built)
    assert not any(v[0] == "flashinfer-xqa" and v[1:6:3] == (256, 2) for v in built)


def test_the_features_suite_builds_the_xqa_and_planned_modules_its_cases_ask_for():
    """With the section, every case of the features suite finds its XQA module (shape, sliding
    window, q_len: sinks are a run argument) and, for each planned decode wrapper, its module
    (head_dim, KV dtype, window, sinks; q_len is a plan() argument)."""
    cfg = effective(RAW, "paper", EVERY_FEATURE)
    built = set(warm.variants(cfg, suite_shapes(run_suites(cfg))))
    for c in cases(("features",)):
        sliding = c.window_left >= 0
        assert ("flashinfer-xqa", c.head_dim, c.dtype, c.kv_dtype, c.group, c.page_size, sliding, c.q_len,
                False) in built, c
        for e in warm.PER_HEAD_DIM:
            assert (e, c.head_dim, c.dtype, c.kv_dtype, warm.BUILD_GROUP, warm.BUILD_PAGE, sliding, 1, c.sinks) in built
    assert {v[7] for v in built if v[0] == "flashinfer-xqa"} == {1, 2, 4, 8}      # the speculative q_lens
    assert not any(v[7] > 1 for v in built if v[0] in warm.PER_HEAD_DIM)        # no duplicate per q_len
    assert len(built) == len(warm.variants(cfg, suite_shapes(run_suites(cfg))))  # each once
    assert built > set(warm.variants(PAPER, SWEEP))                              # and all the rest


def test_the_features_variants_are_the_engines_the_config_names():
    cfg = effective(RAW, "paper", {"feature_kernels": {"engines": ["pkv-graph", "flashinfer-xqa"]}})
    built = warm.variants(cfg, suite_shapes(run_suites(cfg)))
    featured = {v[0] for v in built if tuple(v[6:]) != warm.PLAIN}
    assert featured == {"flashinfer-xqa"}


def test_the_model_steps_windowed_and_speculative_layers_are_built():
    """A model step of gpt-oss-20b-like layers (window 128 on alternate layers, sinks) at q_len 1
    and 4: XQA at its shape, windowed and full, each q_len."""
    ms = {**PAPER["model_step"], "shapes": ["gpt-oss-20b"], "q_lens": [1, 4], "kv_dtypes": ["auto"]}
    built = set(warm.variants({**PAPER, "model_step": ms}))
    for sliding in (False, True):
        for q_len in (1, 4):
            assert ("flashinfer-xqa", 64, "float16", "auto", 8, 16, sliding, q_len, False) in built
        assert ("flashinfer-tc", 64, "float16", "auto", 4, 16, sliding, 1, True) in built


def test_a_variant_records_its_features_and_a_plain_one_has_none():
    """build_one takes the six fields of a plain variant too (tests/gpu's XQA warm-up); without
    CUDA it records the failure, not a crash."""
    done = warm.build_one(("flashinfer-xqa", 128, "float16", "auto", 4, 16))
    assert (done["sliding"], done["q_len"], done["sinks"]) == warm.PLAIN and done["error"]
    done = warm.build_one(("flashinfer-xqa", 64, "float16", "auto", 8, 16, True, 4, True))
    assert (done["sliding"], done["q_len"], done["sinks"]) == (True, 4, True)


def test_without_cuda_it_records_that_nothing_was_built(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(PAPER))
    out = tmp_path / "kernels.json"
    done = subprocess.run([sys.executable, "-m", "pkv.cli", "build-kernels", "--config", str(config),
                           "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = json.loads(out.read_text())
    assert manifest["built"] == [] and "no CUDA" in manifest["note"] and manifest["provenance"]["gpu"] == "cpu"


def test_the_paper_run_builds_first(tmp_path):
    tree = copy_worktree(tmp_path, "results/")
    r = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--config", "profile=paper",
                        "run=reference", "--", "all"], cwd=tree, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert dict(re.findall(r"^(\w+)\s+(\d+)$", r.stdout, flags=re.M)).get("build_kernels") == "1"
    rules = (REPO / "workflow/rules/kernels.smk").read_text() + (REPO / "workflow/rules/calibrate.smk").read_text()
    assert rules.count("priority: 100") == 2      # freeze_config, then build_kernels, before any measuring job
