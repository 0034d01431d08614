"""The public decode API: `decode` (one call) and `DecodeWrapper` (per batch bucket, CUDA-graph capturable).

See docs/api.md. Both run `torch.ops.pkv_api.paged_decode` (pkv/api/op.py), a compile-safe
op: on CUDA the pkv-graph kernel, on the CPU its FP32 oracle.
"""

from pkv.api.decode import decode
from pkv.api.layouts import LAYOUTS, KvView, kv_view
from pkv.api.op import make_workspace
from pkv.api.wrapper import DecodeWrapper

__all__ = ["LAYOUTS", "DecodeWrapper", "KvView", "decode", "kv_view", "make_workspace"]
