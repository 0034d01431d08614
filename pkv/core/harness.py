"""Continuous batching over a trace, on the host (paper §3.6).

At each decode step, requests that have arrived join the active set in arrival order
while it holds fewer than `max_active`; every active request decodes one token; a
request leaves after `decode_len` steps. On its k-th decode step (k = 0, 1, ...) a
request attends over prompt_len + k + 1 tokens: the new token's K,V are in the cache
before attention, so the last step reads exactly prompt_len + decode_len tokens, the
length its pages were reserved for. Idle stretches (nothing active, nothing arrived)
are skipped, so step indices can jump.

Nothing here runs unbounded: decode_steps() without max_steps refuses a trace of more
than MAX_SIMULATED_STEPS decode steps (an upper bound is known before it starts), and
peak_active() jumps from event to event (arrivals, completions), so its cost grows with
the number of requests, never with their lengths. Context lengths are int32; the trace
limits (pkv.core.traces.MAX_LEN) keep them in range.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from pkv.core.paging import FlashInferView, PageAssignment, flashinfer_view
from pkv.core.traces import MAX_LEN, Trace

MAX_SIMULATED_STEPS = 10_000_000   # decode_steps() without max_steps: at most this many steps
assert MAX_LEN < np.iinfo(np.int32).max   # seq_lens are int32


@dataclass(frozen=True)
class StepState:
    step: int
    request_ids: np.ndarray   # int64 [B], in admission order
    seq_lens: np.ndarray      # int32 [B], current context lengths

    @property
    def active(self) -> int:
        return len(self.request_ids)


def step_seed(seed: int, step: int) -> int:
    """The random seed of one decode step's inputs (queries, hidden states) in a run on `seed`:
    a different one each step, the same for every engine and layer of that step."""
    return seed * 1009 + step


def decode_steps(trace: Trace, max_active: int, max_steps: int | None = None) -> Iterator[StepState]:
    if max_active < 1:
        raise ValueError(f"max_active must be >= 1, got {max_active}")
    if max_steps is None:
        # Every emitted step decodes at least one token, so this bounds the steps emitted.
        bound = int(np.sum(trace.decode_len, dtype=np.int64))
        if bound > MAX_SIMULATED_STEPS:
            raise ValueError(f"trace {trace.name!r} decodes {bound} tokens in all; "
                             "simulating it step by step could take "
                             f"up to {bound} steps, above MAX_SIMULATED_STEPS {MAX_SIMULATED_STEPS}: pass max_steps")
    order = np.argsort(trace.arrival_step, kind="stable")
    waiting = deque(int(i) for i in order)
    active: list[int] = []
    done = {}  # request -> tokens decoded so far
    step = 0
    emitted = 0
    while (waiting or active) and (max_steps is None or emitted < max_steps):
        if not active and trace.arrival_step[waiting[0]] > step:
            step = int(trace.arrival_step[waiting[0]])
        while waiting and len(active) < max_active and trace.arrival_step[waiting[0]] <= step:
            r = waiting.popleft()
            active.append(r)
            done[r] = 0
        ids = np.array(active, dtype=np.int64)
        lens = trace.prompt_len[ids] + np.array([done[r] for r in active], dtype=np.int64) + 1
        yield StepState(step, ids, lens.astype(np.int32))
        emitted += 1
        for r in active:
            done[r] += 1
        active = [r for r in active if done[r] < trace.decode_len[r]]
        step += 1


@dataclass(frozen=True)
class StepMetadata:
    """Everything an engine needs to read the KV cache for one step, as host arrays."""

    seq_lens: np.ndarray       # int32 [B]
    block_table: np.ndarray    # int32 [B, W]
    flashinfer: FlashInferView


def step_metadata(state: StepState, assignment: PageAssignment, block_table: np.ndarray | None = None) -> StepMetadata:
    """Both views of one step; pass the assignment's precomputed block table to save work."""
    table = assignment.block_table() if block_table is None else block_table
    return StepMetadata(state.seq_lens, table[state.request_ids],
                        flashinfer_view(assignment, state.request_ids, state.seq_lens))


def peak_active(trace: Trace, max_active: int) -> int:
    """The most requests active at once under decode_steps()' batching, event by event:
    O(R log R) in the number of requests R, whatever their lengths."""
    if max_active < 1:
        raise ValueError(f"max_active must be >= 1, got {max_active}")
    order = np.argsort(trace.arrival_step, kind="stable")
    arrival, decode = trace.arrival_step, trace.decode_len
    waiting = deque(int(i) for i in order)
    leaving: list[int] = []   # heap of first steps at which an active request is gone
    step, peak = 0, 0
    while waiting or leaving:
        while leaving and leaving[0] <= step:
            heapq.heappop(leaving)
        if not leaving and waiting and arrival[waiting[0]] > step:
            step = int(arrival[waiting[0]])
        while waiting and len(leaving) < max_active and arrival[waiting[0]] <= step:
            heapq.heappush(leaving, step + int(decode[waiting.popleft()]))
        peak = max(peak, len(leaving))
        nxt = [leaving[0]] if leaving else []
        if waiting and len(leaving) < max_active:
            nxt.append(max(int(arrival[waiting[0]]), step + 1))
        if not nxt:
            break
        step = min(nxt)
    return peak
