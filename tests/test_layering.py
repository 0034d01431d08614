"""The package's import graph: no circle between modules, no back-arrow between roles.

Every `import pkv...` in a module counts (the late ones inside functions too: a late
import hides a circle from Python, not from a reader)."""

import ast
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[1] / "pkv"


def _module(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for n in names:
            while n and n not in modules:
                n = n.rpartition(".")[0]
            if n and n != "pkv":
                out.add(n)
    return out


def graph() -> nx.DiGraph:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    g = nx.DiGraph()
    for mod, path in files.items():
        g.add_node(mod)
        for dep in _imports(path, set(files)):
            if dep != mod and not mod.startswith(dep + "."):   # a package's own __init__ is not a dependency
                g.add_edge(mod, dep)
    return g


def test_no_import_circle():
    cycles = list(nx.simple_cycles(graph()))
    assert not cycles, cycles


def _role(module: str) -> str:
    """pkv.<role>.x -> role; `python -m pkv` is the CLI; pkv/__init__ is the package's own."""
    if module == "pkv.__main__":
        return "cli"
    return module.split(".")[1] if "." in module else "pkv"


def test_roles_import_one_way():
    """Subpackages form a DAG: core <- plan <- kernels <- engines <- measure <- bench, with
    config, report and cli above them (report reads Parquet; cli dispatches)."""
    roles = nx.DiGraph()
    for a, b in graph().edges:
        ra, rb = (_role(m) for m in (a, b))
        if ra != rb:
            roles.add_edge(ra, rb)
    assert nx.is_directed_acyclic_graph(roles), list(nx.simple_cycles(roles))


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_small_modules(path):
    lines = len(path.read_text().splitlines())
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert lines <= 400 or "long because" in doc, f"{path}: {lines} lines and no reason in its docstring"


def test_the_measuring_roles_never_import_the_report():
    """The report reads what the measuring side wrote; nothing below it reaches up into it
    (a bench renders no table of its own: its table is a report target)."""
    below = {"core", "plan", "kernels", "engines", "measure", "bench", "api"}
    up = sorted((a, b) for a, b in graph().edges if _role(a) in below and _role(b) == "report")
    assert not up, up


def test_the_report_and_the_cost_model_load_no_torch():
    """Tables, figures and the router's cost model start without torch (pkv.core.shape is
    torch-free; torch_dtype imports it on first use)."""
    import subprocess
    import sys

    modules = sorted(m for m in graph().nodes if _role(m) == "report") + ["pkv.plan.costmodel", "pkv.core.shape"]
    probe = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
