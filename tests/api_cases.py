"""Inputs of the public decode API's tests, on the CPU (tests/test_api.py) and the GPU
(tests/gpu/test_api_gpu.py): one definition of a paged case and of the layouts' copies."""

from __future__ import annotations

import numpy as np
import torch


def make_case(lens, hq: int, hkv: int, d: int, p: int = 16, dtype=torch.float16, seed: int = 0, device="cpu"):
    """(kv [pages, 2, Hkv, P, D] in our layout, a block table of shuffled pages, seq_lens, q)."""
    rng = np.random.default_rng(seed)
    need = [-(-n // p) for n in lens]
    width, pages = max(max(need), 1), sum(need) + 3
    perm = rng.permutation(pages)
    table = np.zeros((len(lens), width), dtype=np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n]
        at += n
    gen = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(pages, 2, hkv, p, d, generator=gen, device=device).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=gen, device=device).to(dtype)
    return kv, torch.as_tensor(table, device=device), torch.tensor(lens, dtype=torch.int32, device=device), q


def in_layout(kv, layout: str, pair: bool):
    """Our kv [pages, 2, Hkv, P, D] as a fresh tensor (or K, V pair) of `layout`."""
    t = {"HND": kv, "NHD": kv.transpose(2, 3), "vllm": kv.transpose(2, 3).transpose(0, 1)}[layout].contiguous()
    if not pair:
        return t
    return (t[0], t[1]) if layout == "vllm" else (t[:, 0].contiguous(), t[:, 1].contiguous())
