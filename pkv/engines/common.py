"""Helpers every GPU engine family shares."""

from __future__ import annotations

import numpy as np
import torch


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def to_device_int32(parts: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Concatenate int32 host arrays into pinned memory and issue one async H2D copy."""
    total = sum(len(p) for p in parts)
    host = torch.empty(max(total, 1), dtype=torch.int32, pin_memory=True)
    view = host.numpy()
    pos = 0
    for p in parts:
        view[pos:pos + len(p)] = p
        pos += len(p)
    return host.to(device, non_blocking=True)

