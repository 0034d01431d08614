"""The read roofline every kernel benchmark quotes its fractions of (docs/perf-notes.md,
"The two numbers"): a streaming read of a multi-GB tensor, timed by CUDA events."""

from __future__ import annotations

import statistics

import torch

from pkv.engines.common import num_sms
from pkv.measure.timing import events_us


def read_roofline(gib: float = 4.0, reps: int = 15) -> dict[str, float]:
    """Streaming read bandwidth in GB/s over `gib` GiB: torch's sum and pkv's read probe.

    The roofline is the faster of the two (medians after warm-up): a sum is a lower
    bound on what a read-only kernel can stream."""
    result = _read_bandwidths(gib, reps)
    torch.cuda.empty_cache()   # the probed tensors went with _read_bandwidths' frame
    result["roofline"] = max(result["sum"], result["probe"])
    return result


def _read_bandwidths(gib: float, reps: int) -> dict[str, float]:
    """GB/s of each probe over a `gib` GiB tensor that lives only as long as this call."""
    from pkv.kernels.loader import ops

    x = torch.randn(int(gib * 2**30) // 4, device="cuda")
    blocks = 8 * num_sms(x.device)
    sink = torch.empty(blocks * 512, dtype=torch.int32, device="cuda")
    probes = {"sum": lambda: x.sum(), "probe": lambda: ops().read_probe(x, sink, blocks)}
    result = {}
    for name, fn in probes.items():
        times = [events_us(fn) for _ in range(reps + 3)][3:]
        result[name] = gib * 2**30 / (statistics.median(times) * 1e-6) / 1e9
    return result
