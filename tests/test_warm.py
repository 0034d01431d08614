"""`pkv build-kernels` (pkv.measure.warm.py): what a run loads is built side by side first."""

import json
import re
import subprocess
import sys

from pkv.bench.kernels import SUITES, suite_shapes
from pkv.config.resolve import effective, read_config_file
from pkv.engines import table
from pkv.measure import warm
from worktree import REPO, copy_worktree

PAPER = effective(read_config_file(REPO / "config.yaml"), "paper")


def test_variants_cover_every_flashinfer_module_the_run_loads():
    built = {(e, d, kv) for e, d, _, kv, _, _ in warm.variants(PAPER, suite_shapes())}
    assert {e for e, _, _ in built} - {"pkv-graph"} <= set(table.flashinfer())
    d = PAPER["shape"]["head_dim"]
    # every head_dim and KV dtype of the kernel sweep's suites, for both decode wrappers
    for case in (c for suite in SUITES.values() for c in suite()):
        for e in ("flashinfer", "flashinfer-tc"):
            assert (e, case.head_dim, case.kv_dtype) in built, case
    assert ("flashinfer-persistent", d, "auto") in built and ("pkv-graph", d, "auto") in built
    assert len(set(warm.variants(PAPER, suite_shapes()))) == len(warm.variants(PAPER, suite_shapes()))   # each once
    # The variants derive from the engine table: the decode wrappers per head_dim, the rest at the serving shape.
    assert warm.PER_HEAD_DIM == ("flashinfer", "flashinfer-tc")
    assert warm.SERVING_ONLY == ("flashinfer-persistent",)
    assert warm.PER_SHAPE == ("flashinfer-xqa",)


def test_xqa_is_built_at_every_shape_the_run_gives_it():
    """XQA compiles a module per (head_dim, dtype, KV dtype, GQA group, page size): the kernel
    sweep's cases, the serving shape in 16 bits and FP8, the GQA sweep's groups, the model step's models."""
    built = {v[1:] for v in warm.variants(PAPER, suite_shapes()) if v[0] == "flashinfer-xqa"}
    for case in (c for suite in SUITES.values() for c in suite()):
        assert (case.head_dim, case.dtype, case.kv_dtype, case.group, case.page_size) in built, case
    s = PAPER["shape"]
    g = s["num_qo_heads"] // s["num_kv_heads"]
    for kv in ("auto", "fp8"):
        assert (s["head_dim"], s["dtype"], kv, g, s["page_size"]) in built
    for group in PAPER["ablations"]["gqa_sweep"]["groups"]:
        assert (s["head_dim"], s["dtype"], "auto", group, s["page_size"]) in built
    assert ("flashinfer-xqa", 128, s["dtype"], "fp8", 8, s["page_size"]) in warm.variants(PAPER)   # llama-70b, FP8
    assert not any(v[4] == 5 for v in warm.variants(PAPER))         # the sweep's G5 only with its shapes


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
