"""The kernels' JIT loader (pkv.kernels.loader) without a GPU: a built library of this
tree's key is loaded directly (no ninja check per process); one that does not load is
removed and rebuilt; a missing one is built."""

from __future__ import annotations

import pytest
import torch
import torch.utils.cpp_extension

from pkv.kernels import loader


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """A pretend sm_90 machine whose home (the build cache) is tmp_path; records the calls."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(loader.Path, "home", classmethod(lambda cls: tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda **kw: calls.append(("build", kw["name"])))
    key = loader.source_hash((9, 0))
    so = tmp_path / ".cache" / "pkv" / key / f"pkv_ext_{key}.so"
    return calls, so, monkeypatch


def test_a_built_library_loads_without_a_build(gpu):
    calls, so, monkeypatch = gpu
    so.parent.mkdir(parents=True)
    so.write_bytes(b"built")
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append(("load", path)))
    loader.ops.__wrapped__()
    assert calls == [("load", str(so))]


def test_a_library_that_does_not_load_is_rebuilt(gpu):
    calls, so, monkeypatch = gpu
    so.parent.mkdir(parents=True)
    so.write_bytes(b"truncated")

    def broken(path):
        raise OSError("file too short")

    monkeypatch.setattr(torch.ops, "load_library", broken)
    loader.ops.__wrapped__()
    assert calls == [("build", so.stem)] and not so.exists()


def test_no_library_is_built(gpu, capsys):
    calls, so, _ = gpu
    loader.ops.__wrapped__()
    assert calls == [("build", so.stem)]
    assert "building the CUDA kernels for sm_90" in capsys.readouterr().err


def test_the_build_key_follows_torch_cuda_and_the_toolkit(monkeypatch, tmp_path):
    key = loader.source_hash((9, 0))
    monkeypatch.setattr(torch, "__version__", "0.0.0-other")
    assert loader.source_hash((9, 0)) != key
    monkeypatch.undo()
    (tmp_path / "version.json").write_text('{"cuda": {"version": "99.1.0"}}')
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", str(tmp_path))
    assert loader.toolkit_version() == "99.1.0" and loader.source_hash((9, 0)) != key
    monkeypatch.setattr(torch.utils.cpp_extension, "CUDA_HOME", None)   # no toolkit found: still a key
    assert loader.toolkit_version() == ""

