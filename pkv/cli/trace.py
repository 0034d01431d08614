"""`pkv trace show`: a readable summary of a synthetic trace or a request file."""

from __future__ import annotations

import argparse

import numpy as np

from pkv.cli.args import integer, positive_number, seed
from pkv.core.harness import peak_active
from pkv.core.trace_files import MAX_STEP_MS, TIME_UNITS, columns, load_trace, parse_columns
from pkv.core.traces import FAMILIES, MAX_LEN, MAX_REQUESTS, SyntheticSpec, Trace, Transform, apply_transform, synthetic


def add_commands(sub) -> None:
    trace = sub.add_parser("trace", help="inspect request traces").add_subparsers(dest="trace_command", required=True)
    show = trace.add_parser("show", help="summarize a synthetic trace or a request file")
    src = show.add_mutually_exclusive_group(required=True)
    src.add_argument("--family", choices=FAMILIES, help="synthetic trace family")
    src.add_argument("--file", help="CSV, JSON or JSONL request file (native, Azure, Mooncake or BurstGPT columns, "
                     "detected; any other with --columns)")
    # Limits as the trace's own (pkv.core.traces): checked here, before anything is generated.
    show.add_argument("--seed", type=seed, default=20260623, help="synthetic trace seed")
    show.add_argument("--num-requests", type=integer(1, MAX_REQUESTS), default=16, help="synthetic trace: requests")
    show.add_argument("--decode-min", type=integer(1, MAX_LEN), default=16,
                      help="synthetic trace: shortest decode length")
    show.add_argument("--decode-max", type=integer(1, MAX_LEN), default=64,
                      help="synthetic trace: longest decode length")
    show.add_argument("--step-ms", type=positive_number(MAX_STEP_MS), default=100.0,
                      help="step length for timestamped files, at most a day")
    show.add_argument("--columns", type=_column_map, help="read --file by these columns: prompt=NAME,decode=NAME"
                      "[,time=NAME[:s|ms]] (a time without :s or :ms takes --time-unit)")
    show.add_argument("--time-unit", choices=sorted(TIME_UNITS), help="unit of the --columns time column")
    show.add_argument("--prompt-scale", type=positive_number(MAX_LEN), default=1.0,
                      help=f"multiply prompt lengths (recorded); a request stays at most {MAX_LEN} tokens")
    show.add_argument("--min-len", type=integer(1, MAX_LEN), help="drop requests shorter than this (total tokens)")
    show.add_argument("--max-len", type=integer(1, MAX_LEN), help="drop requests longer than this (total tokens)")
    show.add_argument("--max-requests", type=integer(1, MAX_REQUESTS), help="keep the first N requests by arrival")
    show.add_argument("--max-active", type=integer(1, MAX_REQUESTS), default=8,
                      help="continuous-batching limit for the peak-active figure")
    show.add_argument("--num-qo-heads", type=integer(1, 1024), default=32, help="query heads (for the KV-bytes figure)")
    show.add_argument("--num-kv-heads", type=integer(1, 1024), default=8, help="KV heads (for the KV-bytes figure)")
    show.add_argument("--head-dim", type=integer(1, 1024), default=128, help="head dimension (for the KV-bytes figure)")
    show.add_argument("--page-size", type=integer(1, 1024), default=16, help="tokens per KV page")
    show.add_argument("--dtype", default="float16", help="KV cache dtype (for the KV-bytes figure)")
    show.set_defaults(func=show_trace)


def _column_map(text: str) -> dict[str, str]:
    try:
        return parse_columns(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _layout(args: argparse.Namespace):
    if args.columns is None:
        if args.time_unit is not None:
            raise ValueError("--time-unit is the unit of a --columns time column; give --columns too")
        return None
    if not args.file:
        raise ValueError("--columns reads a request file; give --file")
    return columns(**args.columns, time_unit=args.time_unit)


def _load(args: argparse.Namespace) -> Trace:
    transform = Transform(args.prompt_scale, args.min_len, args.max_len, args.max_requests)
    layout = _layout(args)
    if args.file:
        trace = load_trace(args.file, step_ms=args.step_ms, layout=layout)
    else:
        trace = synthetic(SyntheticSpec(args.family, args.seed, args.num_requests, args.decode_min, args.decode_max))
    return trace if transform == Transform() else apply_transform(trace, transform)


def summarize(trace: Trace, shape, max_active: int) -> str:
    q = (0, 50, 90, 99, 100)
    source = " ".join(str(trace.meta[k]) for k in ("source", "schema") if k in trace.meta)   # file mooncake
    lines = [f"trace        {trace.name}  ({source}, sha256 {trace.checksum()[:16]})",
             f"requests     {len(trace)}"]
    for label, values in (("prompt_len", trace.prompt_len), ("decode_len", trace.decode_len),
                          ("total_len", trace.total_len)):
        pct = np.percentile(values, q).round().astype(int)
        lines.append(f"{label:<12} " + "  ".join(f"p{p}={v}" for p, v in zip(q, pct)))
    lines.append(f"arrivals     steps {int(trace.arrival_step.min())}..{int(trace.arrival_step.max())}")
    lines.append(f"peak active  {peak_active(trace, max_active)} (max_active {max_active})")
    tokens = int(trace.total_len.sum())
    lines.append(f"KV tokens    {tokens:,} reserved in total")
    lines.append(f"KV bytes     {tokens * shape.kv_bytes_per_token / 2**30:.3f} GiB "
                 f"(Hkv {shape.num_kv_heads}, d {shape.head_dim}, {shape.dtype})")
    if "transform" in trace.meta:
        lines.append(f"transform    {trace.meta['transform']}")
    return "\n".join(lines)


def show_trace(args: argparse.Namespace) -> int:
    from pkv.core.shape import Shape

    shape = Shape(args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size, args.dtype)
    print(summarize(_load(args), shape, args.max_active))
    return 0
