"""`decode(q, kv_cache, block_table, seq_lens, ...)`: one decode-attention call on the caller's tensors.

No plan and no host data: block_table and seq_lens stay on the device and the kernel cuts
the work from them (docs/graph-decode.md). A serving engine that calls it for every layer
of a step uses `DecodeWrapper` instead (pkv/api/wrapper.py), which keeps the workspace and
the step's metadata at fixed addresses for CUDA graphs.
"""

from __future__ import annotations

import math

import torch

from pkv.api.layouts import KvView, kv_view
from pkv.api.op import paged_decode
from pkv.engines.common import check_queries


def _check_reading(view: KvView, layout: str, num_kv_heads: int | None, page_size: int | None) -> None:
    # HND and NHD tensors have the same rank: only the caller's head count and page size tell them apart.
    got = (view.num_kv_heads, view.page_size)
    want = (num_kv_heads or got[0], page_size or got[1])
    if got != want:
        hint = " (its transpose: is the layout 'NHD' or 'HND'?)" if got == want[::-1] else ""
        raise ValueError(f"pkv decode: read as {layout}, the KV cache has {got[0]} KV heads and pages of {got[1]} "
                         f"tokens; expected {want[0]} and {want[1]}{hint}")


def run_op(q: torch.Tensor, view: KvView, block_table: torch.Tensor, seq_lens: torch.Tensor,
           workspace: torch.Tensor | None, *, sm_scale, logits_soft_cap, out, return_lse, k_scale, v_scale,
           window_left=None, q_len=1, sinks=None, pdl: bool = False):
    """The op over resolved K, V views; allocates out (and lse) when not given. Shared by decode and the wrapper."""
    for name, t in (("q", q), ("block_table", block_table), ("seq_lens", seq_lens), ("out", out)):
        if not isinstance(t, torch.Tensor) and (t is not None or name != "out"):
            raise ValueError(f"pkv decode: {name} must be a torch.Tensor on the device, got {type(t).__name__}")
    # Rows of length 0 (padding) are skipped by the kernel: in a result the op allocates they
    # read as zeros, and their lse as -inf (the log of an empty sum), never as uninitialised memory.
    if out is None:
        out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float32, device=q.device) if return_lse else None
    scale = q.shape[-1] ** -0.5 if sm_scale is None else float(sm_scale)
    window_left = -1 if window_left is None else window_left
    check_queries(q_len, window_left, sinks, q.shape[1] if q.dim() == 3 else 0, "pkv decode")   # before the op casts
    paged_decode(q, view.k, view.v, block_table, seq_lens, workspace, out, lse, scale,
                 float(logits_soft_cap or 0.0), 1.0 if k_scale is None else float(k_scale),
                 1.0 if v_scale is None else float(v_scale), window_left, q_len, sinks, bool(pdl))
    return (out, lse) if return_lse else out


def decode(q: torch.Tensor, kv_cache, block_table: torch.Tensor, seq_lens: torch.Tensor, *, layout: str = "HND",
           sm_scale: float | None = None, logits_soft_cap: float | None = None, out: torch.Tensor | None = None,
           return_lse: bool = False, k_scale: float | None = None, v_scale: float | None = None,
           num_kv_heads: int | None = None, page_size: int | None = None, window_left: int | None = None,
           sinks: torch.Tensor | None = None, q_len: int = 1, pdl: bool = False):
    """Decode attention of q_len new tokens per row (1 by default) over its paged KV.

    q [B, H_qo, D] float16/bfloat16; kv_cache one tensor or a (K, V) pair in `layout`
    (pkv.api.layouts: "HND" ours and FlashInfer's, "NHD", "vllm"), q's dtype or
    float8_e4m3fn (then k_scale / v_scale dequantize it); block_table [B, max_pages] int32
    (row r's pages in order) and seq_lens [B] int32, on q's device. Rows of length 0 are
    skipped (out and lse left as they were). sm_scale defaults to 1/sqrt(D);
    logits_soft_cap c > 0 maps each scaled logit s to c * tanh(s / c) before the softmax.
    Returns out [B, H_qo, D] (written into `out` when given) and, with return_lse, the
    natural-log log-sum-exp of the (scaled, capped) logits, float32 [B, H_qo].
    num_kv_heads / page_size, when given, are checked against the cache's reading.
    q_len (1..8): q is [B * q_len, H_qo, D], row r's tokens at r * q_len ..; token i sits at position
    seq_lens[r] - q_len + i (the row's last q_len tokens, already in the cache) and attends causally
    (keys at or before its position). window_left W (None or -1: off): a query at position p reads
    keys [p - W, p] (FlashInfer's window_left). sinks: float32 [H_qo], natural-log logits, each adding
    exp(sink) to its head's softmax denominator once; the LSE then includes that term.
    pdl=True launches the kernel as a programmatic dependent of the kernel queued before it (SM 9.0+,
    else ignored): it reads block_table, seq_lens and every token's K/V but the newest q_len of each row
    while that kernel still runs, so that kernel must not write them (docs/api.md).
    """
    view = kv_view(kv_cache, layout)
    _check_reading(view, layout, num_kv_heads, page_size)
    return run_op(q, view, block_table, seq_lens, None, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, out=out,
                  return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, window_left=window_left, q_len=q_len,
                  sinks=sinks, pdl=pdl)
