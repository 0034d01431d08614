"""FP8 (e4m3) KV cache: quantize a 16-bit cache, write a page, dequantize, in plain torch.

A dequantized element is `e4m3 byte * tensor scale * page factor`:

- `tensor` policy (FlashInfer's and TensorRT-LLM's convention): one scale for all of K,
  one for all of V, `amax / 448`; no page factors.
- `page` policy: the same tensor scales times one factor per (page, K/V, kv head),
  `page amax / tensor amax` (<= 1 for pages quantized with the cache). Each page then uses
  e4m3's whole range, which matters where a page's values are far below the cache's
  largest (they would otherwise fall into e4m3's coarse subnormals).

The factors are relative so the kernel can multiply P by a page's V factor before its
fp16 pack without leaving fp16's normal range, and apply the V tensor scale once, to the
output. Everything here is plain torch and runs on the CPU: CI tests it, and the FP32
references dequantize through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0                       # largest finite e4m3fn value
E4M3_STEP = 2.0 ** -3                  # spacing of e4m3's 3-bit mantissa: round-off <= step / 2, relative
POLICIES = ("tensor", "page")
_TINY = 1e-12                          # amax of an all-zero tensor or page: any scale represents it
_CHUNK_PAGES = 2048                    # pages quantize holds in FP32 at a time: its temporaries stay small


@dataclass(frozen=True)
class KvScales:
    """How to read an e4m3 cache back: tensor scales and, for `page`, factors [pages, 2, Hkv]."""

    policy: str
    k_scale: float
    v_scale: float
    page_factors: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"FP8 scale policy must be one of {POLICIES}, got {self.policy!r}")
        if (self.page_factors is None) != (self.policy == "tensor"):
            raise ValueError("page factors go with the 'page' policy and only with it")
        if not (self.k_scale > 0 and self.v_scale > 0):
            raise ValueError(f"FP8 tensor scales must be positive, got k={self.k_scale}, v={self.v_scale}")

    def to(self, device) -> "KvScales":
        f = None if self.page_factors is None else self.page_factors.to(device)
        return KvScales(self.policy, self.k_scale, self.v_scale, f)

    def per_page(self) -> torch.Tensor:
        """Absolute scales [pages, 2, Hkv] (tensor scale x page factor), for either policy's dequantization."""
        t = torch.tensor([self.k_scale, self.v_scale], dtype=torch.float32)
        if self.page_factors is None:
            return t.view(1, 2, 1)
        return self.page_factors.float() * t.to(self.page_factors.device).view(1, 2, 1)


def _to_e4m3(x: torch.Tensor) -> torch.Tensor:
    # torch's cast does not saturate (an out-of-range value becomes NaN): clamp first.
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize(kv: torch.Tensor, policy: str = "tensor", out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, KvScales]:
    """kv [pages, 2, Hkv, P, D] (16-bit or FP32) -> (e4m3 kv of the same shape, its scales).

    Into `out` (an e4m3 tensor of kv's shape and device, e.g. a benchmark's preallocated pool)
    when given. Both passes (the amax, then the scaled cast) run over blocks of pages, so the
    FP32 temporaries are a block's, not the cache's (a multi-GB pool would otherwise allocate
    and free twice its size in FP32); max and the elementwise cast make the blocks' result
    the whole tensor's, bit for bit."""
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ValueError(f"kv must be [num_pages, 2, Hkv, P, D], got {list(kv.shape)}")
    if not kv.dtype.is_floating_point or kv.dtype == E4M3:
        raise ValueError(f"quantize takes a 16- or 32-bit cache, got {kv.dtype}")
    if policy not in POLICIES:
        raise ValueError(f"FP8 scale policy must be one of {POLICIES}, got {policy!r}")
    if out is not None and (out.shape != kv.shape or out.dtype != E4M3 or out.device != kv.device):
        raise ValueError(f"out must be a {E4M3} tensor of kv's shape {list(kv.shape)} on {kv.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    blocks = [slice(i, i + _CHUNK_PAGES) for i in range(0, kv.shape[0], _CHUNK_PAGES)]
    page_amax = []                                                    # [pages_b, 2, Hkv] each
    for b in blocks:
        x = kv[b].float()
        if not torch.isfinite(x).all():
            raise ValueError("kv holds inf or NaN: it cannot be quantized")
        page_amax.append(x.abs().amax(dim=(3, 4)))
    page_amax = torch.cat(page_amax).clamp_min(_TINY)
    amax = page_amax.amax(dim=(0, 2))                                 # [2]: K, V
    k_scale, v_scale = (float(a) / E4M3_MAX for a in amax.tolist())
    if policy == "tensor":
        scales = KvScales("tensor", k_scale, v_scale)
    else:
        scales = KvScales("page", k_scale, v_scale, (page_amax / amax.view(1, 2, 1)).contiguous())
    per = scales.per_page().to(kv.device)
    out = torch.empty(kv.shape, dtype=E4M3, device=kv.device) if out is None else out
    for b in blocks:
        out[b] = _to_e4m3(kv[b].float() / (per if policy == "tensor" else per[b])[..., None, None])
    return out, scales


def write_pages(kv8: torch.Tensor, scales: KvScales, pages: torch.Tensor, values: torch.Tensor) -> None:
    """Quantize 16-bit `values` [n, 2, Hkv, P, D] into pages `pages` [n] of `kv8`, in place.

    As a serving engine writes a page: `tensor` keeps the cache's scales (values past them
    saturate at +-448 e4m3); `page` sets the written pages' factors from their own amax.
    """
    pages = torch.as_tensor(pages, device=kv8.device).long()
    if values.shape[1:] != kv8.shape[1:] or values.shape[0] != pages.numel():
        raise ValueError(f"values {list(values.shape)} do not fit {pages.numel()} pages of {list(kv8.shape[1:])}")
    x = values.float().to(kv8.device)
    if scales.policy == "page":
        per = x.abs().amax(dim=(3, 4)).clamp_min(_TINY) / E4M3_MAX   # the pages' own scales
        tensor = torch.tensor([scales.k_scale, scales.v_scale], device=x.device).view(1, 2, 1)
        scales.page_factors[pages] = (per / tensor).to(scales.page_factors.device)
    else:
        per = scales.per_page().to(x.device).expand(len(pages), 2, kv8.shape[2])
    kv8[pages] = _to_e4m3(x / per[..., None, None])


def dequantize(kv8: torch.Tensor, scales: KvScales) -> torch.Tensor:
    """The FP32 values an e4m3 cache stands for (what the kernels compute with)."""
    if kv8.dtype != E4M3:
        raise ValueError(f"dequantize takes a float8_e4m3fn cache, got {kv8.dtype}")
    return kv8.float() * scales.per_page().to(kv8.device)[..., None, None]
