"""The decode API on a small paged KV cache, checked against plain attention, printing what it computed.

Runs on the CPU (the kernel's split rule through its FP32 oracle) or on a GPU when there is one:
    python3 examples/decode.py
"""

import torch

from pkv.api import decode

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
pages, page_size, num_kv_heads, num_qo_heads, head_dim = 64, 16, 8, 32, 128
kv = torch.randn(pages, 2, page_size, num_kv_heads, head_dim, dtype=torch.float16, device=device)   # FlashInfer NHD
q = torch.randn(2, num_qo_heads, head_dim, dtype=torch.float16, device=device)                    # [B, H_qo, D]
block_table = torch.randperm(pages, device=device)[:16].to(torch.int32).view(2, 8)   # each row: its 8 pages
seq_lens = torch.tensor([100, 37], dtype=torch.int32, device=device)                  # tokens per row

out, lse = decode(q, kv, block_table, seq_lens, layout="NHD", return_lse=True)

# The same attention, gathered densely: row r reads the first seq_lens[r] tokens of its pages.
group = num_qo_heads // num_kv_heads
for r, n in enumerate(seq_lens.tolist()):
    tokens = kv[block_table[r].long()].float()                 # [8 pages, 2, P, H_kv, D]
    k, v = (tokens[:, i].reshape(-1, num_kv_heads, head_dim)[:n] for i in (0, 1))   # [n, H_kv, D]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)      # one KV head per query group
    logits = torch.einsum("hd,nhd->hn", q[r].float(), k) / head_dim**0.5
    ref = torch.einsum("hn,nhd->hd", logits.softmax(-1), v)
    err = (out[r].float() - ref).abs().max().item()
    lse_err = (lse[r] - logits.logsumexp(-1)).abs().max().item()
    print(f"row {r}: {n} tokens over pages {block_table[r, :-(-n // page_size)].tolist()}; "
          f"out[{r}, 0, :4] = {[round(x, 4) for x in out[r, 0, :4].float().tolist()]}; "
          f"max |out - reference| = {err:.2e}, max |lse - reference| = {lse_err:.2e}")
print(f"decode on {device}: out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} {lse.dtype}")
