"""What the report makes: every table and figure, the stages each reads, its caption.

Pure data, no pandas: the Snakefile reads it at parse time to make one rule per table and
figure (with `report()` captions; workflow/rules/report.smk), and pkv.report.tables
builds each: a stage table from its frame builder (pkv.report.tables.BUILDERS), a figure
from pkv.report.figures, or, where `render` names one, from that function of
pkv.report.artifacts (results folder -> bytes). A new table is one entry here plus its
builder.
"""

from __future__ import annotations

from dataclasses import dataclass

from pkv.config.stages import EXTERNAL_TITLE


@dataclass(frozen=True)
class TableSpec:
    title: str
    caption: str
    stages: tuple[str, ...]
    keys: tuple[str, ...]          # the columns that name a row (the comparison joins on them)
    latex: bool = False
    required: bool = True          # False: written (saying so) when the stage has no Parquet
    render: str = ""               # a pkv.report.artifacts function (root -> bytes) instead of a frame builder
    profiles: tuple[str, ...] = ("paper", "smoke")   # the profiles that measure its stages
    in_all: bool | str = True      # part of `snakemake all`; False: a named target only; a config
                                   # section's name (or section.key): in `all` when the run's config has it


@dataclass(frozen=True)
class FigureSpec:
    caption: str
    stages: tuple[str, ...]
    required: bool = True
    render: str = ""
    profiles: tuple[str, ...] = ("paper", "smoke")
    in_all: bool | str = True


TABLE_SPECS = {
    "isolated": TableSpec("Table 1: isolated native-paged decode attention, B=1, 50% holes",
                          "Median device time per call (CUDA-graph replay; CUDA events, else wall time where "
                          "not measured). "
                          "PersistentKV rows take the best split of the calibration grid (split in parentheses).",
                          ("isolated",), ("Method",), latex=True),
    "serving": TableSpec("Table 2: calibrated cost-model serving results (held-out seeds)",
                         "Adaptive route over the faster FlashInfer variant per seed and timing; mean±std over seeds. "
                         "Errors are against the correctness baseline after FP32 conversion.",
                         ("serve",), ("Trace / mode",), latex=True),
    "mlp_proxy": TableSpec("Table 3: model-level proxy, attention + gated MLP tail",
                           "Layers > 1 share one plan per step. Mean±std over seeds.", ("mlp_proxy",),
                           ("Layers", "Engine"),
                           latex=True),
    "counters": TableSpec("Table 4: scheduler-derived structural counters",
                          "Means per decode step over every held-out seed; baselines report no schedule counters (–).",
                          ("serve",), ("Trace", "Engine"), latex=True),
    "nsight": TableSpec("Table 5: Nsight Compute hardware counters",
                        "Per kernel, means over captured invocations; DRAM / roofline is read bandwidth over the "
                        "calibrated beta.",
                        ("nsight_kernels",), ("Kernel",), latex=True, required=False),
    "coverage": TableSpec("Table 6: evidence and coverage map",
                          "Status: Positive when every seed's wall ratio > 1; baseline routes are no-regression cases.",
                          ("serve", "gqa_sweep", "mlp_proxy", "external"), ("Regime",), latex=True),
    "split_sensitivity": TableSpec("Table 7: split-count sensitivity",
                                   "Cost-model policy at the frozen split and its neighbours over the faster "
                                   "FlashInfer variant.",
                                   ("split_sensitivity",), ("Trace",), latex=True),
    "gqa_sweep": TableSpec("Table 8: serving GQA/MQA sweep",
                           "Adaptive route and ungated PersistentKV workqueue over FlashInfer.",
                           ("gqa_sweep",), ("G",), latex=True),
    "b4_sweep": TableSpec("B4 split sweep: PersistentKV workqueue forced on the B4 boundary",
                          "Mean±std over held-out seeds.", ("b4_sweep",), ("Split",)),
    "raggedness": TableSpec("Raggedness ablation: exact buckets vs masked bucket vs workqueue",
                            "Per decode step means; ratios over the faster FlashInfer variant.", ("raggedness",),
                            ("Engine",)),
    "ablations": TableSpec("Implementation ablations: fused merge, row-local bounds, early exit, indexed Q/O, "
                           "CUDA-graph replay",
                           "Graph ms/step is the CUDA-graph replay of run() (no host overhead).", ("implementation",),
                           ("Engine",)),
    # Its title is the trace's own (the Parquet's trace_title, pkv.report.tables.heading);
    # this one is for files measured before traces were named.
    "external": TableSpec(EXTERNAL_TITLE, "Ratios over the faster FlashInfer variant.", ("external",), ("Engine",)),
    # The same trace, prompts multiplied by external.stress_scale (pkv.config.stages.EXTERNAL_REPLAYS);
    # titled from its Parquet too, labelled a stress test there.
    "external_stress": TableSpec(f"{EXTERNAL_TITLE}: stress test",
                                 "A stress test, not the trace as recorded: every prompt multiplied by "
                                 "external.stress_scale. Ratios over the faster FlashInfer variant.",
                                 ("external_stress",), ("Engine",), in_all="external.stress_scale"),
    "kernels": TableSpec("Decode kernels, device time",
                         "pkv-graph against FlashInfer's CUDA-core, tensor-core and persistent decode over batch x "
                         "context, ragged mixes and GQA group x head_dim; the table also states the kernel issue's "
                         "bars as measured.", ("kernels",), (), render="kernels_md", profiles=("paper",)),
    "fp8_kernels": TableSpec("FP8 (e4m3) KV cache, decode kernels",
                             "pkv-graph over an FP8 cache against FlashInfer's FP8 and 16-bit decode and pkv-graph's "
                             "16-bit decode, device time, with the FP8 issue's bars as measured.", ("fp8_kernels",), (),
                             render="fp8_kernels_md", profiles=("paper",)),
    "feature_kernels": TableSpec("Decode kernels with sliding windows, sinks and q_len, device time",
                                 "pkv-graph against the fastest FlashInfer path that ran each row's features (sliding "
                                 "window, sinks, q_len query tokens per row); a path that refused them is no "
                                 "candidate, a row that none ran has no baseline.", ("feature_kernels",), (),
                                 render="feature_kernels_md", in_all="feature_kernels"),
    "fp8_accuracy": TableSpec("FP8 (e4m3) KV cache, accuracy",
                              "Error against the FP32 reference on the original 16-bit values per scale policy and "
                              "engine, random and outlier-channel caches.", ("fp8_accuracy",), (),
                              render="fp8_accuracy_md", profiles=("paper",)),
    "fp8_serving": TableSpec("FP8 KV serving ablation",
                             "One held-out trace per seed from a 16-bit and an e4m3 cache, device and wall time per "
                             "step and throughput ratios over FlashInfer.", ("kv_fp8",), (), render="fp8_serving_md",
                             profiles=("paper",)),
    "host_path": TableSpec("Host path per decode step",
                           "Prepare, run launch and route µs per engine and batch, beside FlashInfer's raw plan() on "
                           "the same arrays.", ("host",), (), render="host_path_md"),
    "router_regret": TableSpec("Router regret",
                               "Per serving trace, the adaptive route's wall and device time against the best fixed "
                               "route in hindsight.", ("serve", "calibration"), (), render="router_regret_md"),
    "model_step": TableSpec("Model-level decode step",
                            "N decoder layers, one CUDA graph per batch bucket; pkv-graph (no host plan) against "
                            "FlashInfer's CUDA-graph path (plan() on the host each step), FlashInfer eager and the "
                            "adaptive route; serial wall, device time and pipelined throughput per step.",
                            ("model_step",), (), render="model_step_md", in_all="model_step"),
    "claims": TableSpec("Paper claims against this run",
                        "Each claim of the paper (RTX 3060) as quoted, this run's number from the same rows as the "
                        "table that shows it, and a verdict computed by the rule below.",
                        ("serve", "isolated", "mlp_proxy", "split_sensitivity", "b4_sweep", "gqa_sweep", "external",
                         "raggedness", "implementation", "nsight_kernels"), (), render="claims_md",
                        profiles=("paper",)),
}

FIGURE_SPECS = {
    "serving_ratios": FigureSpec("Each router engine (adaptive, adaptive:objective=overlapped) and pkv-graph where "
                                 "measured, over the faster FlashInfer variant per serving trace, one panel per "
                                 "engine, by timing (wall, CUDA events, CUDA-graph replay); bars are means over "
                                 "held-out seeds, error bars their std.", ("serve",)),
    "latency_vs_context": FigureSpec("Isolated decode attention (B=1, 50% holes): median latency per call against "
                                     "context length (left), and the faster FlashInfer variant's latency over each "
                                     "other engine's (right, > 1: faster), PersistentKV at its best split.",
                                     ("isolated",)),
    "split_sensitivity": FigureSpec("Wall throughput ratio against the forced split count: the cost-model policy "
                                    "(ablation seed) and the B4 workqueue sweep (held-out seeds).",
                                    ("split_sensitivity", "b4_sweep")),
    "launches_per_step": FigureSpec("Kernel launches per decode step by engine and serving trace.", ("serve",)),
    "coverage": FigureSpec("Wall throughput ratio over FlashInfer for every engine and regime (serving and GQA sweep).",
                           ("serve", "gqa_sweep")),
    "nsight": FigureSpec("Nsight Compute: time and DRAM read bandwidth per kernel against the read roofline.",
                         ("nsight_kernels",), required=False),
    "kernel_ratio": FigureSpec("Faster FlashInfer decode ÷ pkv-graph, device time, over (batch, context).",
                               ("kernels",), render="kernel_ratio_png", profiles=("paper",)),
    "router_accuracy": FigureSpec("Router accuracy: the cost model's estimate against the measured time per route, "
                                  "one panel per route.", ("serve", "calibration"), render="router_accuracy_png"),
    "model_step": FigureSpec("Model-level decode step: median serial wall time per step (host prepare + launch + "
                             "synchronize) against the KV tokens the step reads per layer, one line per engine; one "
                             "row of panels per model shape and KV dtype, one column per batch bucket. Device times "
                             "and ratios are in the table.", ("model_step",), render="model_step_png",
                             in_all="model_step"),
}

# Stages measured once per held-out seed: a table over them flags any seed that is missing.
PER_SEED_STAGES = ("serve", "b4_sweep", "mlp_proxy")


def in_all(spec: TableSpec | FigureSpec, profile: str, config: dict | None = None) -> bool:
    """Whether `snakemake all` of `profile` (its resolved `config`) makes this table or figure.
    An optional stage's (the model step's, the external stress test's) is in `all` when the
    config has its section or key."""
    if isinstance(spec.in_all, str):
        return profile in spec.profiles and config is not None and configured(spec, config)
    return spec.in_all and profile in spec.profiles


def stages_in_all(profile: str, config: dict) -> tuple[str, ...]:
    """The stages the tables and figures of `snakemake all` read, for `profile` and its resolved
    `config`, in spec order: what the run measures (and what `pkv build-kernels` builds for)."""
    specs = [*TABLE_SPECS.values(), *FIGURE_SPECS.values()]
    return tuple(dict.fromkeys(s for spec in specs if in_all(spec, profile, config) for s in spec.stages))


def configured(spec: TableSpec | FigureSpec, config: dict) -> bool:
    """Whether `config` has what an optional stage's table or figure needs (its in_all: a section,
    or section.key); True for the others."""
    if not isinstance(spec.in_all, str):
        return True
    node = config
    for key in spec.in_all.split("."):
        node = node.get(key) if isinstance(node, dict) else None
    return node is not None
