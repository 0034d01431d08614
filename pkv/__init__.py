"""PersistentKV: native block-table GQA decode attention and the pipeline that measures it.

Importing this package needs neither a GPU nor FlashInfer, and imports no torch: `Shape`
(and with it torch) loads on first use, so the pipeline's parse step and its table and
figure jobs start without torch. The CUDA kernels and the FlashInfer baselines are loaded
on first use by the engines that need them.
"""

__all__ = ["Shape"]
__version__ = "0.2.0"


def __getattr__(name: str):
    if name == "Shape":
        from pkv.core.shape import Shape

        return Shape
    raise AttributeError(f"module 'pkv' has no attribute {name!r}")
