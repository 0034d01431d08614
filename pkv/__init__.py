"""PersistentKV: native block-table GQA decode attention and the pipeline that measures it.

Importing this package needs neither a GPU nor FlashInfer, and imports no torch: `Shape`
loads on first use and is torch-free itself, so the pipeline's parse step and its table
and figure jobs start without torch. The CUDA kernels and the FlashInfer baselines are loaded
on first use by the engines that need them.
"""

__all__ = ["Shape", "version_line"]
__version__ = "0.2.0"


def version_line() -> str:
    """What `pkv --version` prints: the package, its commit, torch, CUDA and FlashInfer (imports torch)."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    here = Path(__file__).resolve().parent
    commit = "unknown (not a git checkout)"
    if (here.parent / ".git").exists():
        done = subprocess.run(["git", "-C", str(here.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True)
        commit = done.stdout.strip() or commit
    elif (here / "_commit.txt").is_file():   # an installed wheel: the commit it was built from (setup.py)
        commit = (here / "_commit.txt").read_text().strip()
    try:
        import torch

        torch_v, cuda = torch.__version__, torch.version.cuda or "none (CPU build of torch)"
    except ImportError:
        torch_v = cuda = "not installed"
    try:
        flashinfer = metadata.version("flashinfer-python")
    except metadata.PackageNotFoundError:
        flashinfer = "not installed"
    return f"pkv {__version__} (commit {commit}; torch {torch_v}; CUDA {cuda}; FlashInfer {flashinfer})"


def __getattr__(name: str):
    if name == "Shape":
        from pkv.core.shape import Shape

        return Shape
    raise AttributeError(f"module 'pkv' has no attribute {name!r}")
