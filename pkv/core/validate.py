"""Checks at the engine boundary: bad inputs raise ValueError before any kernel runs."""

from __future__ import annotations

import numpy as np
import torch

from pkv.core.shape import Shape


def check_kv(kv: torch.Tensor, shape: Shape) -> None:
    if not isinstance(kv, torch.Tensor):
        raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    want = (2, shape.num_kv_heads, shape.page_size, shape.head_dim)
    if kv.dim() != 5 or tuple(kv.shape[1:]) != want:
        raise ValueError(f"kv must have shape [num_pages, {', '.join(map(str, want))}], got {list(kv.shape)}")
    if kv.dtype != shape.kv_torch_dtype:
        raise ValueError(f"kv dtype {kv.dtype} does not match the shape's {shape.kv_torch_dtype} "
                         f"(dtype {shape.dtype}, kv_dtype {shape.kv_dtype})")
    if not kv.is_contiguous():
        raise ValueError("kv must be contiguous")


def check_query(q: torch.Tensor, shape: Shape, batch: int, device: torch.device) -> None:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.device != device:
        raise ValueError(f"q is on {q.device} but the KV cache is on {device}")
    if q.dtype != shape.torch_dtype:
        raise ValueError(f"q dtype {q.dtype} does not match the KV cache dtype {shape.dtype}")
    want = (batch, shape.num_qo_heads, shape.head_dim)
    if tuple(q.shape) != want:
        raise ValueError(f"q must have shape {list(want)} (batch, qo heads, head_dim), got {list(q.shape)}")
    if not q.is_contiguous():
        raise ValueError("q must be contiguous")


def check_lengths(seq_lens: np.ndarray, capacity: np.ndarray) -> None:
    """Every row needs 1 <= seq_len <= the tokens its block-table row maps."""
    seq_lens = np.asarray(seq_lens)
    if seq_lens.ndim != 1 or seq_lens.shape != np.shape(capacity):
        raise ValueError(f"seq_lens must be 1-D with one entry per block-table row, got {seq_lens.shape}")
    if len(seq_lens) == 0:
        raise ValueError("a decode step needs at least one active row")
    if seq_lens.min() < 1:
        raise ValueError(f"every seq_len must be >= 1, got {int(seq_lens.min())}")
    over = np.flatnonzero(seq_lens > capacity)
    if len(over):
        i = int(over[0])
        raise ValueError(f"row {i}: seq_len {int(seq_lens[i])} is beyond its block table ({int(capacity[i])} tokens)")
