"""Helpers every GPU engine family shares."""

from __future__ import annotations

import numpy as np
import torch

from pkv.plan.device_schedule import MAX_Q_LEN


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_supported(device) -> bool:
    """Programmatic dependent launch (a kernel starting while the one before it drains) exists
    from SM 9.0 on; every engine that can launch so does where it exists (FlashInfer's rule too)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


class PinnedStaging:
    """The one host-to-device copy of a step's int32 metadata, through pinned buffers that
    are allocated once and reused across steps (what a serving engine keeps).

    A ring of `depth` buffers: a buffer is refilled only after the copy that last read it
    has completed (a CUDA event per buffer), so a plan still in flight is never clobbered.
    The device tensor a copy returns is fresh each call (the caching allocator's), so
    earlier plans keep their metadata, unless `out` names a fixed destination (a buffer a
    captured CUDA graph reads). On a CPU device it is an ordinary copy (tests).

    Into a fixed destination, the slices of buffer and destination for each (buffer, length)
    are made once and kept, so a step's upload makes no torch view: each is a dispatcher call,
    several microseconds on a cold CPU."""

    def __init__(self, device: torch.device, depth: int = 2, capacity: int = 1 << 14):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.bufs = [self._alloc(capacity) for _ in range(depth)]
        self.views = [b.numpy() for b in self.bufs]
        self.events: list = [None] * depth
        self.next = 0
        self._dest: torch.Tensor | None = None    # the destination the kept slices are of
        self._slices: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _alloc(self, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, pin_memory=self.cuda)

    def upload(self, parts: list[np.ndarray], out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate `parts` (int32-convertible) and issue one async copy to the device,
        into a new tensor or into out[:total] (returned)."""
        total = sum(len(p) for p in parts)
        view = self.fill(total)
        pos = 0
        for p in parts:
            view[pos:pos + len(p)] = p
            pos += len(p)
        return self.send(total, out)

    def fill(self, total: int) -> np.ndarray:
        """The next pinned buffer, at least `total` ints, to be written in place and then
        sent (send): it waits for the copy that last read it. What an earlier fill wrote there
        stays, so a caller that rewrites only what changed must know which buffer it has:
        every buffer of the ring holds some earlier step's content (or zeros)."""
        i = self.next
        if self.events[i] is not None:
            self.events[i].synchronize()   # the previous copy out of this buffer is done
        if len(self.views[i]) < total:
            self.bufs[i] = self._alloc(max(total, 2 * len(self.views[i])))
            self.views[i] = self.bufs[i].numpy()
            self._slices.clear()           # they were of the old buffer
        return self.views[i]

    def send(self, total: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Issue the async copy of the first `total` ints of the buffer fill() gave, into a new
        device tensor or into out[:total] (returned); the next fill() takes the next buffer."""
        i = self.next
        self.next = (i + 1) % len(self.bufs)
        if out is not None:
            if out is not self._dest:      # held, so `is` cannot match a new tensor at a reused id
                self._dest = out
                self._slices.clear()
            pair = self._slices.get((i, total))
            if pair is None:
                pair = self._slices[(i, total)] = (self.bufs[i][:total], out[:total])
            out = pair[1].copy_(pair[0], non_blocking=True)
        else:
            src = self.bufs[i][:max(total, 1)]
            out = src.to(self.device, non_blocking=True)
            if not self.cuda and out.data_ptr() == self.bufs[i].data_ptr():
                out = out.clone()   # a CPU "copy" is the pinned buffer itself
        if not self.cuda:
            return out
        if self.events[i] is None:
            self.events[i] = torch.cuda.Event()
        self.events[i].record()
        return out


def check_queries(q_len, window_left, sinks, num_qo_heads: int, who: str = "the graph decode") -> None:
    """The query options' refusals, one line each: q_len 1..MAX_Q_LEN, window_left an int >= -1
    (-1: off), sinks None or a float32 tensor [num_qo_heads]."""
    if isinstance(q_len, bool) or not isinstance(q_len, int) or not 1 <= q_len <= MAX_Q_LEN:
        raise ValueError(f"{who}: q_len is 1..{MAX_Q_LEN} query tokens per row, got {q_len!r}")
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise ValueError(f"{who}: window_left is an int >= 0 (keys [p - window_left, p]) or -1/None (off), "
                         f"got {window_left!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
                              or tuple(sinks.shape) != (num_qo_heads,)):
        got = f"{sinks.dtype} {list(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{who}: sinks must be a float32 tensor [num_qo_heads={num_qo_heads}], got {got}")
