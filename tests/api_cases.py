"""Inputs of the public decode API's tests, on the CPU (tests/test_api.py) and the GPU
(tests/gpu/test_api_gpu.py): one definition of a paged case and of the layouts' copies."""

from __future__ import annotations

import numpy as np
import torch


def make_case(lens, hq: int, hkv: int, d: int, p: int = 16, dtype=torch.float16, seed: int = 0, device="cpu",
              q_len: int = 1):
    """(kv [pages, 2, Hkv, P, D] in our layout, a block table of shuffled pages, seq_lens, q
    [len(lens) * q_len, hq, d])."""
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
    q = torch.randn(len(lens) * q_len, hq, d, generator=gen, device=device).to(dtype)
    return kv, torch.as_tensor(table, device=device), torch.tensor(lens, dtype=torch.int32, device=device), q


def in_layout(kv, layout: str, pair: bool):
    """Our kv [pages, 2, Hkv, P, D] as a fresh tensor (or K, V pair) of `layout`."""
    t = {"HND": kv, "NHD": kv.transpose(2, 3), "vllm": kv.transpose(2, 3).transpose(0, 1)}[layout].contiguous()
    if not pair:
        return t
    return (t[0], t[1]) if layout == "vllm" else (t[:, 0].contiguous(), t[:, 1].contiguous())


# The window / sinks / q_len grid both feature tests run (tests/test_features.py on the CPU oracle,
# tests/gpu/test_features_gpu.py on the kernel): (name, lens, hq, hkv, d, page, q_len, window_left,
# sinks, soft cap). Odd lengths, a padding row, windows larger and smaller than the row and
# starting mid-page and mid-tile, q_len 1..8 with ragged rows, G x q_len over one pass's rows
# (several query blocks), sinks with and without a soft cap. `scale` multiplies the long rows
# (the GPU runs them longer, so that they split across CTAs).
def feature_cases(scale: int = 1):
    long = [300 * scale + 7, 1500 * scale + 3]
    return [
        ("window-small", [1, 17, 0, *long], 8, 2, 64, 16, 1, 37, False, 0.0),
        ("window-0", [5, 33, *long], 8, 2, 64, 16, 1, 0, False, 0.0),
        ("window-large", [3, 100, *long], 8, 2, 128, 16, 1, 100000, False, 0.0),
        ("window-page", [64, 65, *long], 16, 2, 128, 64, 1, 128, False, 30.0),
        ("sinks", [1, 17, 0, *long], 8, 2, 64, 16, 1, -1, True, 0.0),
        ("sinks-cap", [2, 45, *long], 32, 4, 128, 16, 1, -1, True, 30.0),
        ("qlen2", [2, 17, 0, *long], 8, 2, 64, 16, 2, -1, False, 0.0),
        ("qlen3-window", [3, 40, *long], 12, 4, 128, 16, 3, 50, False, 0.0),
        ("qlen4-g8", [4, 4, 99, *long], 16, 2, 128, 16, 4, -1, True, 0.0),     # G8 x 4: two blocks
        ("qlen8-g4", [8, 31, 0, *long], 8, 2, 64, 1, 8, 200, True, 20.0),      # G4 x 8: two blocks, page 1
        ("qlen8-g16", [9, 500, *long], 32, 2, 128, 16, 8, 64, False, 0.0),     # G16: one token a block
        ("qlen5-g3-d256", [5, 77, *long], 6, 2, 256, 16, 5, 33, True, 0.0),    # d256: 8 rows a pass
        ("qlen7-g1", [7, 8, *long], 4, 4, 64, 16, 7, -1, True, 0.0),
    ]
