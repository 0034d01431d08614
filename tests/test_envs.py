"""envs/pkv.yaml (the rules' conda environment) pins what pyproject.toml pins."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"torch": "pytorch"}   # PyPI name -> conda-forge/pytorch channel name


def _split(spec: str) -> tuple[str, str]:
    name, constraint = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", spec).groups()
    return name.lower(), constraint.replace(" ", "")


def test_conda_env_pins_agree_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "envs" / "pkv.yaml").read_text())
    conda = dict(_split(d) for d in env["dependencies"] if isinstance(d, str))
    pip = dict(_split(d) for d in next(d["pip"] for d in env["dependencies"] if isinstance(d, dict)))
    for spec in project["dependencies"]:
        name, constraint = _split(spec)
        name = CONDA_NAMES.get(name, name)
        assert name in conda, f"{name} is a pyproject dependency but not in envs/pkv.yaml"
        assert conda[name] == constraint, f"{name}: envs/pkv.yaml has {conda[name]!r}, pyproject {constraint!r}"
    for spec in project["optional-dependencies"]["gpu"]:
        name, constraint = _split(spec)
        assert pip.get(name) == constraint, f"{name}: envs/pkv.yaml pip has {pip.get(name)!r}, pyproject {constraint!r}"
    python = _split(project["requires-python"].join(["python", ""]))[1]
    assert conda["python"] == python


def test_every_rule_uses_the_env():
    for smk in (ROOT / "workflow" / "rules").glob("*.smk"):
        text = smk.read_text()
        rules = len(re.findall(r"^\s*rule(\s+\w+)?:", text, flags=re.M))
        assert text.count('conda:\n') == text.count('"../../envs/pkv.yaml"') == rules, smk.name
