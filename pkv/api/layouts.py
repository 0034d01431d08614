"""KV cache layouts the decode reads in place, each as K and V views [num_pages, Hkv, P, D].

The kernel addresses K and V by (page, head, token) strides with the last dim contiguous
(csrc/graph_decode.h), so every layout here is a pair of strided views of the caller's
own tensors, never a copy:

| layout | one tensor | (K, V) pair, each |
| --- | --- | --- |
| `HND` (ours, FlashInfer's HND) | `[pages, 2, Hkv, P, D]` | `[pages, Hkv, P, D]` |
| `NHD` (FlashInfer's NHD) | `[pages, 2, P, Hkv, D]` | `[pages, P, Hkv, D]` |
| `vllm` (vLLM's FlashAttention backend) | `[2, blocks, P, Hkv, D]` | `[blocks, P, Hkv, D]` |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LAYOUTS = ("HND", "NHD", "vllm")
_ONE_TENSOR = {"HND": "[pages, 2, Hkv, P, D]", "NHD": "[pages, 2, P, Hkv, D]", "vllm": "[2, blocks, P, Hkv, D]"}
_PAIR = {"HND": "[pages, Hkv, P, D]", "NHD": "[pages, P, Hkv, D]", "vllm": "[blocks, P, Hkv, D]"}


@dataclass(frozen=True)
class KvView:
    """K and V of one layer as [num_pages, Hkv, P, D] views of the caller's tensors."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]


def _heads_first(t: torch.Tensor, layout: str) -> torch.Tensor:
    # [pages, P, Hkv, D] -> [pages, Hkv, P, D] as a view: the kernel takes the strides.
    return t if layout == "HND" else t.transpose(1, 2)


def kv_view(kv_cache, layout: str = "HND") -> KvView:
    """The K and V views of `kv_cache` (one tensor or a (K, V) pair) in `layout`; ValueError if it does not fit."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(kv_cache, (tuple, list)):
        if len(kv_cache) != 2 or not all(isinstance(t, torch.Tensor) for t in kv_cache):
            raise ValueError(f"a KV pair is two tensors (K, V), got {type(kv_cache).__name__} of {len(kv_cache)}")
        k, v = kv_cache
        if k.dim() != 4 or k.shape != v.shape:
            raise ValueError(f"K and V of layout {layout} must each be {_PAIR[layout]} and of one shape, "
                             f"got {list(k.shape)} and {list(v.shape)}")
        if k.dtype != v.dtype or k.device != v.device:
            raise ValueError(f"K and V must share dtype and device, got {k.dtype} on {k.device}, "
                             f"{v.dtype} on {v.device}")
        return KvView(_heads_first(k, layout), _heads_first(v, layout))
    if not isinstance(kv_cache, torch.Tensor):
        raise ValueError(f"kv_cache must be a tensor or a (K, V) pair of tensors, got {type(kv_cache).__name__}")
    if kv_cache.dim() == 4:
        raise ValueError(f"kv_cache is 4-D {list(kv_cache.shape)}: pass K and V as a pair (K, V), each {_PAIR[layout]}")
    axis = 0 if layout == "vllm" else 1
    if kv_cache.dim() != 5 or kv_cache.shape[axis] != 2:
        raise ValueError(f"kv_cache of layout {layout} must be {_ONE_TENSOR[layout]}, got {list(kv_cache.shape)}")
    k, v = kv_cache.unbind(axis)
    return KvView(_heads_first(k, layout), _heads_first(v, layout))

