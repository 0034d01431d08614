"""Engine and runner names are written in one place, pkv/engines/table.py: what a consumer
needs to know of an engine is a field of its row, and an engine a stage or a report needs
in a role (the router, the reference, the workqueue, the plan-free kernel) is a table
constant. The scan below reads every string constant of pkv/ but the table's."""

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from pkv.engines import table

PKG = Path(__file__).resolve().parents[1] / "pkv"
TABLE = PKG / "engines" / "table.py"

# Words that are an engine's name and also name something else, in the files that use them so.
OTHER_MEANINGS = {
    "flashinfer": ("the flashinfer package: its module and the provenance key of its version",
                   {"core/io.py", "report/compare.py", "report/notes.py", "report/fp8.py", "report/host.py",
                    "report/kernels.py", "report/features.py", "bench/splits.py", "cli/worker_serve.py"}),
    "reference": ("the reference run (config run=reference, pkv compare's reference side)",
                  {"config/runs.py", "report/compare.py"}),
}


def _strings(source: str):
    """(line, value) of every string constant of `source` but its docstrings (prose)."""
    tree = ast.parse(source)
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    strings = [node for node in ast.walk(tree)
               if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]
    for node in sorted(strings, key=lambda n: (n.lineno, n.col_offset)):
        yield node.lineno, node.value


def engine_names(source: str, path: str = "") -> list[tuple[int, str]]:
    """The engine specs ("pkv-fused", "adaptive:objective=overlapped") and runner names written
    in `source` (a file `path` under pkv/), but a word used there in another of its meanings."""
    spec = re.compile(table.spec_pattern())
    return [(line, value) for line, value in _strings(source)
            if (spec.match(value) or value in table.RUNNERS)
            and path not in OTHER_MEANINGS.get(value, ("", set()))[1]]


def test_no_engine_name_outside_the_table():
    found = [f"{path.relative_to(PKG.parent)}:{line}: {value!r}"
             for path in sorted(PKG.rglob("*.py")) if path != TABLE
             for line, value in engine_names(path.read_text(), str(path.relative_to(PKG)))]
    assert not found, "engine names outside pkv/engines/table.py (use a field or a role of the table):\n" + \
        "\n".join(found)


def test_the_scan_finds_a_name():
    source = '"""pkv-fused in a docstring is prose."""\nif name == "pkv-fused" or x in ("flashinfer-graph",):\n' \
             '    make_engine("adaptive:objective=overlapped")\nmeta.get("flashinfer")\nprint("pkv-graph: no")\n'
    assert engine_names(source) == [(2, "pkv-fused"), (2, "flashinfer-graph"), (3, "adaptive:objective=overlapped"),
                                     (4, "flashinfer")]
    assert engine_names(source, "core/io.py") == engine_names(source)[:3]   # the package's name there


def test_roles_are_rows_of_their_kind():
    assert table.is_router(table.ROUTER)
    reference = table.info(table.REFERENCE)
    assert reference.cpu and reference.fp8 and table.REFERENCE not in table.deployable()
    workqueue = table.info(table.WORKQUEUE)
    assert workqueue.route and workqueue.split_route == "workqueue" and workqueue.merge == "segmented"
    assert table.info(table.PKV_KERNEL).plan_free and table.info(table.PKV_KERNEL).route


def test_the_fields_say_what_differs():
    pkv = {n: table.info(n) for n in table.names("pkv")}
    assert {e.split_route for e in pkv.values()} == {"workqueue", "bucket"}
    assert all(e.merge in ("segmented", "fused") for e in pkv.values())
    assert all(bool(e.buckets) == (e.split_route == "bucket") for e in pkv.values())
    assert table.the(buckets="masked") == "pkv-masked" and table.the(buckets="exact") == "pkv-bucket"
    assert table.the(merge="fused") == "pkv-fused" and table.the(tensor_cores=True) == "flashinfer-tc"
    assert [n for n, e in table.ENGINES.items() if e.plan_free] == [table.PKV_KERNEL, "flashinfer-xqa"]
    assert "flashinfer-xqa" not in table.planned() and "flashinfer-tc" in table.planned()
    with pytest.raises(ValueError, match="not one"):
        table.the(merge="segmented")
    with pytest.raises(ValueError, match="not one"):
        table.the(buckets="ragged")


def test_route_keys_and_frozen_splits():
    """The cost model files a route's times under its kind, a baseline's under its name;
    each scheduled engine runs at the frozen split of its row's split_route."""
    from router_constants import cpu_constants

    k = cpu_constants(operating_points={"bimodal-b8": {"workqueue": 12, "bucket": 5}})

    assert {table.route_key(n) for n in table.pkv_routes()} == set(table.pkv_routes().values())
    assert all(table.route_key(n) == n for n in (*table.baselines(), table.REFERENCE))
    routes = {table.info(r).kind: r for r in table.pkv_routes()}
    for name in table.names("pkv"):
        route = routes[table.info(name).split_route]       # a scheduled engine runs at a route's split
        assert k.split("bimodal-b8", table.info(name).split_route) == k.split("bimodal-b8", table.route_key(route))
    assert table.info(table.the(merge="fused")).split_route == table.info(table.WORKQUEUE).kind
    assert table.info(table.the(buckets="masked")).split_route == table.info(table.the(buckets="exact")).kind

def test_every_route_and_baseline_has_its_paper_name():
    """The claims name a router's routes as the paper does; a baseline or route row without
    that name would show a raw label where the paper's words are compared."""
    from pkv.report.claims import route_kind

    for name in (table.REFERENCE, *table.baselines(), *table.pkv_routes()):
        assert table.info(name).paper_route, name
    assert route_kind("pkv-bucket/s8") == "PersistentKV bucket" and route_kind("flashinfer-tc") == "FlashInfer"
    assert route_kind(f"{table.WORKQUEUE}/s16 (forced)") == "PersistentKV workqueue"
    assert route_kind("pkv-masked/s4") == "pkv-masked" and route_kind("vllm") == "vllm"


def test_persistentkv_labels():
    assert table.persistentkv("pkv-masked:row_local=false") and table.persistentkv(table.PKV_KERNEL)
    assert not any(table.persistentkv(n) for n in ("flashinfer", "sdpa-repack", "adaptive", "vllm-paged", ""))


def test_engines_and_runners_are_named_by_their_rows():
    """make_engine names an engine by the row it built; a runner class by the row naming it."""
    import importlib

    from pkv.core.cache import PagedCache
    from pkv.core.harness import StepState
    from pkv.core.paging import assign_pages
    from pkv.core.shape import Shape
    from pkv.engines import make_engine

    cache = PagedCache.random(Shape(8, 2, 16, 4), assign_pages(np.array([40, 9]), 4, 0.0, 0))
    step = StepState(0, np.array([0, 1]), np.array([40, 9], dtype=np.int32))
    for name in table.cpu_engines():
        if table.is_router(name):
            continue
        engine = make_engine(name, cache)
        assert engine.name == name and engine.prepare(step).route.partition("/")[0] == name
    for name, row in table.RUNNERS.items():
        module, _, cls = row.runner.partition(":")
        assert getattr(importlib.import_module(module), cls).name == name
