"""Every constant Python and the CUDA sources share, read from both sides (no GPU needed).

The kernels are torch-free C++ and the engines plain Python, so a limit or an enum
changed on one side only would fail silently at run time; here it fails loudly.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pkv.engines import graph, persistent
from pkv.plan.device_schedule import (
    CTA_MERGE_STATES,
    GRAPH_MAX_ROWS,
    MAX_COUNTER_STRIDE,
    MAX_PIECE_COST,
    MAX_SPIN_NS,
    MERGE_SLICES,
    PIECE_COST,
)
from pkv.plan.schedule import TILE_TOKENS

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = {p.name: p.read_text() for p in sorted(CSRC.glob("*")) if p.suffix in (".h", ".cuh", ".cu", ".cpp")}


def constexpr(name: str) -> int:
    hits = {f: int(m.group(1)) for f, text in SOURCES.items()
            for m in [re.search(rf"constexpr int {name} = (\d+);", text)] if m}
    assert len(hits) == 1, f"{name} defined in {sorted(hits) or 'no file'} (want exactly one)"
    return next(iter(hits.values()))


@pytest.mark.parametrize("cxx,py", [
    ("kTile", TILE_TOKENS),
    ("kGraphMaxRows", GRAPH_MAX_ROWS),
    ("kCtaMergeStates", CTA_MERGE_STATES),
    ("kMergeSlices", MERGE_SLICES),
    ("kMaxPieceCost", MAX_PIECE_COST),
    ("kMaxCounterStride", MAX_COUNTER_STRIDE),
    ("kMaxSpinNs", MAX_SPIN_NS),
    ("kMaxGroup", graph.MAX_GROUP),
    ("kMaxClusterSplits", persistent.MAX_CLUSTER_SPLITS),
    ("kMaxSegSlots", persistent.MAX_SPLITS),
    ("kFp8MaxHeadDim", max(graph.FP8_HEAD_DIMS)),
    ("kChunk", graph.PAGE_SCALE_MIN_PAGE),
])
def test_shared_limits(cxx, py):
    assert constexpr(cxx) == py


def test_out_modes():
    body = re.search(r"enum class OutMode : int \{(.*?)\};", SOURCES["pkv_decode.h"], re.S).group(1)
    modes = {name: int(v) for name, v in re.findall(r"k(\w+) = (\d+)", body)}
    assert modes == {"Direct": persistent.MODE_DIRECT, "Partial": persistent.MODE_PARTIAL,
                     "Fused": persistent.MODE_FUSED, "Cluster": persistent.MODE_CLUSTER}


def test_ctas_per_sm():
    expr = re.search(r"kCtasPerSm = D == 64 \? (\d+) : D == 128 \? (\d+) : (\d+);", SOURCES["attend.cuh"])
    assert expr, "AttendCfg::kCtasPerSm no longer reads 'D == 64 ? a : D == 128 ? b : c'"
    assert dict(zip((64, 128, 256), map(int, expr.groups()))) == graph.CTAS_PER_SM


def test_v3_group_limit():
    limits = set(re.findall(r"p\.group > (\d+)", SOURCES["pkv_decode.cu"]))
    assert limits == {str(max(persistent.GROUPS))}


def test_decode_op_takes_the_launch_builder_names():
    schema = re.search(r'm\.def\("decode\((.*?)\) -> \(\)"\);', SOURCES["binding.cpp"].replace('"\n        "', ""),
                       re.S)
    names = [a.split()[-1] for a in schema.group(1).split(", ")]
    assert names[:7] == ["q", "kv", "block_table", "meta", "out", "partial", "counters"]
    assert names[7:] == list(persistent.KERNEL_ARGS)


@pytest.mark.parametrize("arg, value", [("piece_cost", PIECE_COST)])
def test_graph_ops_default_to_the_python_constants(arg, value):
    """Both pkv-graph ops' schemas default piece_cost to pkv.plan.device_schedule's."""
    text = SOURCES["binding.cpp"].replace('"\n        "', "")
    defaults = re.findall(rf"int {arg}=(\d+)[,)]", text)
    assert len(defaults) == 2 and {int(d) for d in defaults} == {value}, defaults
