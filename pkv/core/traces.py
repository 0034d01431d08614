"""Request traces: the synthetic families of pkv.core.families (paper §3.8), and the transform of a loaded trace.

A trace is three integer arrays (arrival_step, prompt_len, decode_len) plus a `meta`
dict saying where it came from and how it was transformed. Synthetic traces are pure
functions of their spec: the same spec gives the same arrays on any machine.

Limits (every trace, synthetic or loaded, is checked against them when it is built):
a request's prompt_len + decode_len is at most MAX_LEN tokens (2^24 = 16,777,216), a
trace has at most MAX_REQUESTS requests (2^20) and its arrival steps are at most
MAX_ARRIVAL_STEP (2^30). So every context length fits int32 through batching (seq_lens)
and paging (page ids are checked by pkv.core.paging), and the decode step index stays int32.

Request files are read by pkv.core.trace_files (load_trace).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pkv.core.families import FAMILIES  # the one table of families

BUCKETS = FAMILIES["bucketed"].params["lengths"]
MAX_LEN = 1 << 24            # tokens per request, prompt + decode
MAX_REQUESTS = 1 << 20       # requests per trace
MAX_ARRIVAL_STEP = 1 << 30   # latest arrival step


@dataclass(frozen=True)
class Trace:
    name: str
    arrival_step: np.ndarray
    prompt_len: np.ndarray
    decode_len: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        arrays = (self.arrival_step, self.prompt_len, self.decode_len)
        if len({len(a) for a in arrays}) != 1:
            raise ValueError("arrival_step, prompt_len and decode_len must have the same length")
        if len(self.prompt_len) == 0:
            raise ValueError(f"trace {self.name!r} has no requests")
        if self.prompt_len.min() < 1 or self.decode_len.min() < 1 or self.arrival_step.min() < 0:
            raise ValueError(f"trace {self.name!r} has a non-positive length or a negative arrival step")
        if len(self.prompt_len) > MAX_REQUESTS:
            raise ValueError(f"trace {self.name!r} has {len(self.prompt_len)} requests, "
                             f"above MAX_REQUESTS {MAX_REQUESTS}")
        # Each term is checked alone first: their sum must not wrap around int64 either.
        total = np.maximum(self.prompt_len, self.decode_len)
        total = np.where(total > MAX_LEN, total, self.prompt_len + self.decode_len)
        if total.max() > MAX_LEN:
            i = int(np.argmax(total))
            raise ValueError(f"trace {self.name!r}: request {i} needs {int(total[i])} tokens (prompt + decode), "
                             f"above MAX_LEN {MAX_LEN}")
        if self.arrival_step.max() > MAX_ARRIVAL_STEP:
            raise ValueError(f"trace {self.name!r}: arrival step {int(self.arrival_step.max())} is above "
                             f"MAX_ARRIVAL_STEP {MAX_ARRIVAL_STEP}")

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def total_len(self) -> np.ndarray:
        return self.prompt_len + self.decode_len

    def checksum(self) -> str:
        h = hashlib.sha256()
        for a in (self.arrival_step, self.prompt_len, self.decode_len):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()


def _trace(name: str, arrival, prompt, decode, meta: dict) -> Trace:
    as64 = lambda a: np.asarray(a, dtype=np.int64)  # noqa: E731
    return Trace(name, as64(arrival), as64(prompt), as64(decode), meta)


# ---------------------------------------------------------------- synthetic families


@dataclass(frozen=True)
class SyntheticSpec:
    """Size parameters of a synthetic trace; lengths in tokens before `scale`."""

    family: str
    seed: int
    num_requests: int = 16
    decode_min: int = 16
    decode_max: int = 64
    min_len: int = 1024
    max_len: int = 65536
    mean_arrival_gap: float = 0.0
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"unknown trace family {self.family!r}; choose one of {', '.join(FAMILIES)}")
        if FAMILIES[self.family].lengths not in LENGTH_RULES:
            raise ValueError(f"trace family {self.family!r} names the prompt-length rule "
                             f"{FAMILIES[self.family].lengths!r}, which pkv.core.traces does not have "
                             f"(rules: {', '.join(LENGTH_RULES)})")
        # Limits first: a trace of 10^12 requests is refused before anything is generated.
        if not 1 <= self.num_requests <= MAX_REQUESTS:
            raise ValueError(f"num_requests must be in 1..{MAX_REQUESTS} (MAX_REQUESTS), got {self.num_requests}")
        if not 1 <= self.decode_min <= self.decode_max <= MAX_LEN:
            raise ValueError(f"need 1 <= decode_min <= decode_max <= {MAX_LEN} (MAX_LEN), got {self.decode_min}, "
                             f"{self.decode_max}")
        if not 1 <= self.min_len <= self.max_len <= MAX_LEN:
            raise ValueError(f"need 1 <= min_len <= max_len <= {MAX_LEN} (MAX_LEN), got {self.min_len}, {self.max_len}")
        if not (0 <= self.mean_arrival_gap < math.inf and 0 < self.scale < math.inf):   # NaN fails both
            raise ValueError(f"mean_arrival_gap must be a finite number >= 0 and scale a finite number > 0, got "
                             f"{self.mean_arrival_gap}, {self.scale}")


def _cycle(spec: SyntheticSpec, rng: np.random.Generator, lengths) -> np.ndarray:
    """The given lengths in turn."""
    return np.asarray(lengths, dtype=np.int64)[np.arange(spec.num_requests) % len(lengths)]


def _constant(spec: SyntheticSpec, rng: np.random.Generator, length: int) -> np.ndarray:
    return np.full(spec.num_requests, length, dtype=np.int64)


def _bimodal(spec: SyntheticSpec, rng: np.random.Generator, long, short, every: int) -> np.ndarray:
    """Request i is long (uniform over `long`) when i % every == 0, else short (uniform over `short`)."""
    n = spec.num_requests
    long_ = rng.integers(long[0], long[1], n, endpoint=True)
    short_ = rng.integers(short[0], short[1], n, endpoint=True)
    return np.where(np.arange(n) % every == 0, long_, short_)


def _uniform(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(spec.min_len, spec.max_len, spec.num_requests, endpoint=True)


def _pareto(spec: SyntheticSpec, rng: np.random.Generator, alpha: float) -> np.ndarray:
    """Bounded Pareto on [min_len, max_len], by inverse CDF."""
    lo, hi = spec.min_len, spec.max_len
    u = rng.random(spec.num_requests)
    ratio = (lo / hi) ** alpha
    return np.floor(lo / (1.0 - u * (1.0 - ratio)) ** (1.0 / alpha)).astype(np.int64)


# The prompt-length rules a family row may name (pkv.core.families.Family.lengths).
LENGTH_RULES = {"cycle": _cycle, "constant": _constant, "bimodal": _bimodal, "uniform": _uniform,
                "pareto": _pareto}


def _prompt_lengths(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    """The family row's length rule with the row's parameters."""
    family = FAMILIES[spec.family]   # SyntheticSpec has checked the family and its rule
    return LENGTH_RULES[family.lengths](spec, rng, **family.params)


def synthetic(spec: SyntheticSpec) -> Trace:
    rng = np.random.default_rng(spec.seed)
    prompt = _prompt_lengths(spec, rng)
    prompt = np.maximum(1, np.round(prompt * spec.scale)).astype(np.int64)
    decode = rng.integers(spec.decode_min, spec.decode_max, spec.num_requests, endpoint=True)
    if spec.mean_arrival_gap > 0:
        gaps = rng.geometric(1.0 / (spec.mean_arrival_gap + 1.0), spec.num_requests) - 1
        arrival = np.cumsum(gaps) - gaps[0]
    else:
        arrival = np.zeros(spec.num_requests, dtype=np.int64)
    return _trace(f"{spec.family}-{spec.seed}", arrival, prompt, decode, {"source": "synthetic", **asdict(spec)})


# ---------------------------------------------------------------- transforms of a loaded trace


@dataclass(frozen=True)
class Transform:
    """Explicit changes to a loaded trace, recorded in `Trace.meta["transform"]`.

    Prompts are multiplied by `prompt_scale` first; then requests whose total length lies
    outside [min_len, max_len] are dropped; then the first `max_requests` (by arrival) kept.
    """

    prompt_scale: float = 1.0
    min_len: int | None = None
    max_len: int | None = None
    max_requests: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.prompt_scale <= MAX_LEN:   # NaN fails too; above MAX_LEN every request is too long
            raise ValueError(f"prompt_scale must be a number in (0, {MAX_LEN}] (MAX_LEN), got {self.prompt_scale}")
        for name in ("min_len", "max_len", "max_requests"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


def apply_transform(trace: Trace, t: Transform) -> Trace:
    prompt = np.maximum(1, np.round(trace.prompt_len * t.prompt_scale)).astype(np.int64)
    total = prompt + trace.decode_len
    keep = np.ones(len(trace), dtype=bool)
    if t.min_len is not None:
        keep &= total >= t.min_len
    if t.max_len is not None:
        keep &= total <= t.max_len
    idx = np.flatnonzero(keep)
    idx = idx[np.argsort(trace.arrival_step[idx], kind="stable")][: t.max_requests]
    if len(idx) == 0:
        raise ValueError(f"transform {t} keeps none of the {len(trace)} requests of {trace.name!r}")
    arrival = trace.arrival_step[idx] - trace.arrival_step[idx].min()
    meta = {**trace.meta, "transform": {**asdict(t), "kept": int(len(idx)), "of": len(trace)}}
    return _trace(trace.name, arrival, prompt[idx], trace.decode_len[idx], meta)
