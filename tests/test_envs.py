"""envs/pkv.yaml (the rules' conda environment): pinned to the committed reference run's
versions, every pin inside pyproject.toml's range, and every rule using it."""

import re
from pathlib import Path

import tomllib
import yaml
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}   # conda name -> PyPI name
ENV = yaml.safe_load((ROOT / "envs" / "pkv.yaml").read_text())


def _split(spec: str) -> tuple[str, str]:
    name, constraint = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", spec).groups()
    return name.lower(), constraint.replace(" ", "")


def _pins() -> dict[str, str]:
    """PyPI name -> constraint, from the conda list and the pip list together."""
    conda = [d for d in ENV["dependencies"] if isinstance(d, str)]
    pip = [d for d in next(d["pip"] for d in ENV["dependencies"] if isinstance(d, dict)) if not d.startswith("-")]
    pins = {}
    for spec in conda + pip:
        name, constraint = _split(spec)
        # conda's `=X` pins exactly (to X or X.*): read it as ==X.
        pins[CONDA_NAMES.get(name, name)] = re.sub(r"^=(?!=)", "==", constraint)
    return pins


def _exact(pins: dict[str, str], name: str) -> str:
    assert pins[name].startswith("=="), f"{name} is not pinned exactly in envs/pkv.yaml: {pins[name]!r}"
    return pins[name][2:]


def test_every_dependency_is_in_the_env_and_inside_pyprojects_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    extras = project["optional-dependencies"]
    for spec in [*project["dependencies"], *extras["pipeline"], *extras["gpu"]]:
        name, constraint = _split(spec)
        assert name in pins, f"{name} is a pyproject dependency but not in envs/pkv.yaml"
        if pins[name].startswith("=="):
            assert Version(pins[name][2:]) in SpecifierSet(constraint), f"{name}: {pins[name]} is outside {constraint}"
    python = _exact(pins, "python")
    assert Version(python) in SpecifierSet(project["requires-python"])


def test_env_pins_the_versions_the_reference_run_used():
    from pkv.core.io import read_meta

    meta = read_meta(next((ROOT / "results" / "raw" / "serve").glob("*.parquet")))
    pins = _pins()
    assert _exact(pins, "torch") == meta["torch"]                      # 2.11.0+cu130
    assert _exact(pins, "flashinfer-python") == meta["flashinfer"]     # 0.7.2.post1
    assert _exact(pins, "cuda-version") == meta["cuda"]                # 13.0
    pip = next(d["pip"] for d in ENV["dependencies"] if isinstance(d, dict))
    cuda_tag = "cu" + meta["cuda"].replace(".", "")
    assert any(line.startswith("--extra-index-url") and line.endswith(f"/whl/{cuda_tag}") for line in pip)
    log = (ROOT / "results" / "logs" / "snakemake.log").read_text()
    assert _exact(pins, "snakemake") == re.search(r"Snakemake version: (\S+)", log).group(1)   # 9.27.1
    assert _exact(pins, "python") == re.search(r"Python version: (\S+)", log).group(1)         # 3.12.3


def test_every_rule_uses_the_env():
    for smk in (ROOT / "workflow" / "rules").glob("*.smk"):
        text = smk.read_text()
        rules = len(re.findall(r"^\s*rule(\s+\w+)?:", text, flags=re.M))
        assert text.count('conda:\n') == text.count('"../../envs/pkv.yaml"') == rules, smk.name
