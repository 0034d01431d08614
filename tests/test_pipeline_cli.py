"""The pipeline commands' failure modes and the frozen config, without running a stage."""

import json
import subprocess
import sys

import yaml

from pkv.config.resolve import deep_merge, effective, resolve_profile


def _pkv(*args, env=None):
    return subprocess.run([sys.executable, "-m", "pkv.cli", *args], capture_output=True, text=True, env=env)


def test_nsight_without_ncu_fails_at_once_and_says_how_to_turn_it_off(tmp_path):
    done = _pkv("nsight", "--config", str(tmp_path / "config.json"), "--constants", str(tmp_path / "c.json"),
                "--out", str(tmp_path / "ncu.csv"), env={"PATH": str(tmp_path)})
    assert done.returncode == 2
    assert "`ncu`" in done.stderr and "nsight: false" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "ncu.csv").exists()


def test_freeze_config_is_canonical_json(tmp_path):
    # A real config (freeze-config refuses one every command would refuse), keys given in
    # reverse order: frozen sorted, two-space indented.
    cfg = effective(yaml.safe_load(open("config.yaml")), "smoke")
    reverse = lambda d: {k: reverse(v) for k, v in reversed(d.items())} if isinstance(d, dict) else d  # noqa: E731
    out = tmp_path / "config.json"
    assert _pkv("freeze-config", "--json", json.dumps(reverse(cfg)), "--out", str(out)).returncode == 0
    text = out.read_text()
    assert text == json.dumps(cfg, indent=2, sort_keys=True) + "\n" and text.startswith('{\n  "ablations": {\n')


def test_smoke_profile_merges_over_the_paper_config():
    config = yaml.safe_load(open("config.yaml"))
    smoke = effective(config, "smoke")
    assert smoke["profile"] == "smoke" and "smoke" not in smoke
    assert smoke["shape"]["head_dim"] < config["shape"]["head_dim"]
    assert smoke["baselines"] == ["reference"]
    # Lists replace, dicts merge: untouched keys survive.
    assert smoke["seeds"]["calibration"] == config["seeds"]["calibration"]
    assert effective(config, "paper")["shape"] == config["shape"]
    assert deep_merge({"a": {"b": 1, "c": [1, 2]}}, {"a": {"c": [3]}}) == {"a": {"b": 1, "c": [3]}}
    assert resolve_profile("auto", cuda_available=True) == "paper"
    assert resolve_profile("auto", cuda_available=False) == "smoke"
