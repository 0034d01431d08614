"""FP32 references on any device: plain GQA attention (Eq. 1) and the task-list engine.

`run_schedule` executes a `pkv.plan.schedule.Schedule` exactly as the CUDA kernels do: each
task computes a partial online-softmax state (m, l, acc) over its token range of one
row and KV head, empty tasks leave neutral states, and a segmented merge combines the
slots of each (row, kv head). It is the oracle the kernels are tested against and the
engine the CPU smoke pipeline runs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pkv.plan.schedule import Schedule


def gather_tokens(kv: torch.Tensor, block_table_row: torch.Tensor, begin: int,
                  end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens [begin, end) of one row as FP32 [kv_heads, n, head_dim]."""
    page_size = kv.shape[3]
    t = torch.arange(begin, end, device=kv.device)
    pages = block_table_row[t // page_size].long()
    k = kv[pages, 0, :, t % page_size, :].float()  # [n, H_kv, D]
    v = kv[pages, 1, :, t % page_size, :].float()
    return k.transpose(0, 1), v.transpose(0, 1)


def logits(q: torch.Tensor, k: torch.Tensor, sm_scale: float | None = None, soft_cap: float = 0.0) -> torch.Tensor:
    """The scaled logits q k^T * sm_scale (1/sqrt(d) by default), soft-capped to cap * tanh(s / cap) when cap > 0."""
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
    return soft_cap * torch.tanh(s / soft_cap) if soft_cap else s


def attention_reference(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        sm_scale: float | None = None, soft_cap: float = 0.0, return_lse: bool = False):
    """softmax(q k^T / sqrt(d)) v per row over its first seq_lens[i] tokens, in FP32 (see `logits` for
    sm_scale and soft_cap); with return_lse also the natural-log LSE of the logits [B, H_qo]."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    group = num_qo_heads // num_kv_heads
    out = torch.empty(batch, num_qo_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_qo_heads, dtype=torch.float32, device=q.device)
    for i in range(batch):
        k, v = gather_tokens(kv, block_table[i], 0, int(seq_lens[i]))
        qi = q[i].float().view(num_kv_heads, group, head_dim)
        scores = logits(qi, k, sm_scale, soft_cap)  # [H_kv, G, n]
        out[i] = (torch.softmax(scores, dim=-1) @ v).reshape(num_qo_heads, head_dim)
        lse[i] = torch.logsumexp(scores, dim=-1).reshape(num_qo_heads)
    return (out, lse) if return_lse else out


def partial_state(q_group: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                  soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) of FP32 queries [G, D] over keys/values [n, D]; neutral when n == 0."""
    group, head_dim = q_group.shape
    if k.shape[0] == 0:
        m = torch.full((group,), -math.inf, device=q_group.device)
        return m, torch.zeros(group, device=q_group.device), torch.zeros(group, head_dim, device=q_group.device)
    x = logits(q_group, k, sm_scale, soft_cap)
    m = x.max(dim=1).values
    p = torch.exp(x - m[:, None])
    return m, p.sum(dim=1), p @ v


def merge_states(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Exact merge of split states m, l [S, G] and acc [S, G, D] into the output [G, D]."""
    m_all = m.max(dim=0).values
    # A split with m = -inf (no tokens) gets weight 0 instead of exp(nan).
    w = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - m_all))
    return (w[:, :, None] * acc).sum(dim=0) / (w * l).sum(dim=0)[:, None]


def merge_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE [G] of the logits behind split states m, l [S, G] (merge_states' weights)."""
    m_all = m.max(dim=0).values
    w = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - m_all))
    return m_all + torch.log((w * l).sum(dim=0))


def run_schedule(
    q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, schedule: Schedule,
    sm_scale: float | None = None, soft_cap: float = 0.0, lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Execute every task and merge of `schedule`; returns FP32 [B, H_qo, D] (`logits` for sm_scale and
    soft_cap); `lse` [B, H_qo] FP32, if given, receives each scheduled row's natural-log LSE."""
    batch, num_qo_heads, head_dim = q.shape
    num_kv_heads = schedule.num_kv_heads
    group = num_qo_heads // num_kv_heads
    lens = seq_lens.tolist()
    out = torch.full((batch, num_qo_heads, head_dim), math.nan, dtype=torch.float32, device=q.device)
    for launch in schedule.launches:
        slots = launch.num_tasks
        m = torch.empty(slots, group, device=q.device)
        l = torch.empty(slots, group, device=q.device)
        acc = torch.empty(slots, group, head_dim, device=q.device)
        for slot, (row, g, _split, begin, end) in enumerate(launch.tasks.tolist()):
            # Tokens at or past seq_len are masked: they contribute nothing.
            k, v = gather_tokens(kv, block_table[row], begin, max(begin, min(end, lens[row])))
            qg = q[row, g * group:(g + 1) * group].float()
            m[slot], l[slot], acc[slot] = partial_state(qg, k[g], v[g], sm_scale, soft_cap)
        seg = launch.seg_offsets
        for i, row in enumerate(launch.rows.tolist()):
            for g in range(num_kv_heads):
                lo, hi = int(seg[i * num_kv_heads + g]), int(seg[i * num_kv_heads + g + 1])
                out[row, g * group:(g + 1) * group] = merge_states(m[lo:hi], l[lo:hi], acc[lo:hi])
                if lse is not None:
                    lse[row, g * group:(g + 1) * group] = merge_lse(m[lo:hi], l[lo:hi])
    return out


def tensor_lens(seq_lens: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.as_tensor(np.asarray(seq_lens, dtype=np.int32), device=device)
