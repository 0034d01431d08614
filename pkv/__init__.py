"""PersistentKV: native block-table GQA decode attention and the pipeline that measures it.

Importing this package needs neither a GPU nor FlashInfer; the CUDA kernels and the
FlashInfer baselines are loaded on first use by the engines that need them.
"""

from pkv.shape import Shape

__all__ = ["Shape"]
__version__ = "0.1.0"
