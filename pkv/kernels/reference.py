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

from pkv.plan.device_schedule import ONE_QUERY, Queries
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


def key_mask(seq_len: int, begin: int, end: int, tokens, queries: Queries, device=None) -> torch.Tensor:
    """Which keys [begin, end) each of a row's query tokens `tokens` (indices 0..q_len-1) reads: bool
    [len(tokens), end - begin]. Token i sits at position seq_len - q_len + i and reads the keys at or
    before it and, with a window W, at or after its position - W."""
    pos = seq_len - queries.q_len + torch.as_tensor(list(tokens), device=device)[:, None]
    t = torch.arange(begin, end, device=device)[None, :]
    ok = t <= pos
    if queries.window_left >= 0:
        ok &= t >= pos - queries.window_left
    return ok


def attention_reference(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                        sm_scale: float | None = None, soft_cap: float = 0.0, return_lse: bool = False, *,
                        q_len: int = 1, window_left: int = -1, sinks: torch.Tensor | None = None):
    """softmax(q k^T / sqrt(d)) v per row over its first seq_lens[i] tokens, in FP32 (see `logits` for
    sm_scale and soft_cap); with return_lse also the natural-log LSE of the logits [B, H_qo].

    q [B * q_len, H_qo, D]: row i's q_len query tokens, token j at position seq_lens[i] - q_len + j,
    each reading the keys at or before its position (and, with window_left = W >= 0, at or after
    its position - W: `key_mask`). sinks: FP32 [H_qo] natural-log logits, one extra term
    exp(sink) in each head's softmax denominator (no value); the LSE then includes it:
    ln(sum_t exp(s_t) + exp(sink))."""
    rows_q, num_qo_heads, head_dim = q.shape
    num_kv_heads = kv.shape[2]
    group = num_qo_heads // num_kv_heads
    queries = Queries(q_len, window_left)
    out = torch.empty(rows_q, num_qo_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows_q, num_qo_heads, dtype=torch.float32, device=q.device)
    for i in range(rows_q // q_len):
        n = int(seq_lens[i])
        k, v = gather_tokens(kv, block_table[i], 0, n)
        qi = q[i * q_len:(i + 1) * q_len].float().view(q_len, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = logits(qi, k[:, None], sm_scale, soft_cap)  # [H_kv, q_len, G, n]
        mask = key_mask(n, 0, n, range(q_len), queries, q.device)[None, :, None, :]
        scores = scores.masked_fill(~mask, -math.inf)
        if sinks is not None:   # one more logit per head, with no value
            sink = sinks.float().view(num_kv_heads, 1, group, 1).expand(-1, q_len, -1, -1)
            scores = torch.cat([scores, sink], dim=-1)
            v = torch.cat([v, v.new_zeros(num_kv_heads, 1, head_dim)], dim=1)
        o = torch.softmax(scores, dim=-1) @ v[:, None]        # [H_kv, q_len, G, D]
        out[i * q_len:(i + 1) * q_len] = o.transpose(0, 1).reshape(q_len, num_qo_heads, head_dim)
        lse[i * q_len:(i + 1) * q_len] = torch.logsumexp(scores, dim=-1).transpose(0, 1).reshape(q_len, num_qo_heads)
    return (out, lse) if return_lse else out


def partial_state(q_group: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float | None = None,
                  soft_cap: float = 0.0,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, l, acc) of FP32 queries [G, D] over keys/values [n, D], the keys each query reads
    given by mask [G, n] (all when None); neutral for a query that reads none."""
    group, head_dim = q_group.shape
    if k.shape[0] == 0:
        m = torch.full((group,), -math.inf, device=q_group.device)
        return m, torch.zeros(group, device=q_group.device), torch.zeros(group, head_dim, device=q_group.device)
    x = logits(q_group, k, sm_scale, soft_cap)
    if mask is not None:
        x = x.masked_fill(~mask, -math.inf)
    m = x.max(dim=1).values
    p = torch.exp(x - torch.where(torch.isinf(m), torch.zeros_like(m), m)[:, None])   # exp(-inf) = 0 where masked
    return m, p.sum(dim=1), p @ v


def _with_sink(m: torch.Tensor, l: torch.Tensor, sink: torch.Tensor | None):
    """States m, l [S, G] with one more state per head: the sink (m = sink, l = 1, acc 0), if any."""
    if sink is None:
        return m, l
    return torch.cat([m, sink.float()[None]]), torch.cat([l, torch.ones_like(l[:1])])


def merge_states(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Exact merge of split states m, l [S, G] and acc [S, G, D] into the output [G, D]; sink [G]
    (natural-log logits), if given, adds exp(sink) to each head's denominator, once."""
    m, l = _with_sink(m, l, sink)
    m_all = m.max(dim=0).values
    # A split with m = -inf (no tokens) gets weight 0 instead of exp(nan).
    w = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - m_all))
    return (w[:acc.shape[0], :, None] * acc).sum(dim=0) / (w * l).sum(dim=0)[:, None]


def merge_lse(m: torch.Tensor, l: torch.Tensor, sink: torch.Tensor | None = None) -> torch.Tensor:
    """Natural-log LSE [G] of the logits behind split states m, l [S, G] (merge_states' weights), and
    of the sink's term when given."""
    m, l = _with_sink(m, l, sink)
    m_all = m.max(dim=0).values
    w = torch.where(torch.isinf(m), torch.zeros_like(m), torch.exp(m - m_all))
    return m_all + torch.log((w * l).sum(dim=0))


def run_schedule(
    q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, schedule: Schedule,
    sm_scale: float | None = None, soft_cap: float = 0.0, lse: torch.Tensor | None = None, *,
    queries: Queries = ONE_QUERY, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Execute every task and merge of `schedule`; returns FP32 [B * q_len, H_qo, D] (`logits` for sm_scale
    and soft_cap); `lse` [B * q_len, H_qo] FP32, if given, receives each scheduled row's natural-log LSE.

    queries: q_len query tokens per row (q holds row r's at r * q_len ..), causal, with an optional
    window (`key_mask`); a schedule of queries.blocks > 1 query blocks counts virtual KV heads
    (pkv.plan.device_schedule.graph_schedule: head h * blocks + b holds block b's tokens). sinks
    [H_qo] join each head's denominator at its merge, once (merge_states)."""
    num_qo_heads, head_dim = q.shape[1:]
    nb, ql = queries.blocks, queries.q_len
    num_kv_heads = schedule.num_kv_heads // nb
    group = num_qo_heads // num_kv_heads
    lens = seq_lens.tolist()
    out = torch.full(q.shape, math.nan, dtype=torch.float32, device=q.device)

    def rows_of(row: int, vh: int):
        """(query rows of q as (token rows, head slice), token indices) of virtual head vh of a row."""
        h, b = divmod(vh, nb)
        toks = range(b * queries.block, min(ql, (b + 1) * queries.block))
        return slice(row * ql + toks.start, row * ql + toks.stop), slice(h * group, (h + 1) * group), toks, h

    for launch in schedule.launches:
        states = []
        for row, vh, _split, begin, end in launch.tasks.tolist():
            # Tokens at or past seq_len are masked: they contribute nothing.
            end = max(begin, min(end, lens[row]))
            k, v = gather_tokens(kv, block_table[row], begin, end)
            rq, hq, toks, h = rows_of(row, vh)
            qg = q[rq, hq].float().reshape(-1, head_dim)                  # token-major: token i's G heads
            mask = key_mask(lens[row], begin, end, toks, queries, q.device).repeat_interleave(group, dim=0)
            states.append(partial_state(qg, k[h], v[h], sm_scale, soft_cap, mask))
        seg = launch.seg_offsets
        for i, row in enumerate(launch.rows.tolist()):
            for vh in range(nb * num_kv_heads):
                lo, hi = int(seg[i * nb * num_kv_heads + vh]), int(seg[i * nb * num_kv_heads + vh + 1])
                m, l, acc = (torch.stack(x) for x in zip(*states[lo:hi]))
                rq, hq, toks, _ = rows_of(row, vh)
                sink = None if sinks is None else sinks[hq].float().repeat(len(toks))
                out[rq, hq] = merge_states(m, l, acc, sink).view(len(toks), group, head_dim)
                if lse is not None:
                    lse[rq, hq] = merge_lse(m, l, sink).view(len(toks), group)
    return out


def tensor_lens(seq_lens: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.as_tensor(np.asarray(seq_lens, dtype=np.int32), device=device)
