# The kernel benchmark (issue 11): device time of pkv-graph against FlashInfer's three
# decode variants over the serving range, then its table and ratio figure from Parquet.
# Nothing here is routed, so it needs no calibration; paper profile only (GPU kernels).
# First of all (priority), every kernel the run loads is built at once (pkv/measure/warm.py).
# The features rows (sliding windows, sinks, q_len: `pkv bench kernels --suites features`) are a
# named target, not part of `all`: `snakemake --cores 1 results/raw/kernels/features.parquet`.

from pkv.engines.table import feature_kernels


rule build_kernels:
    """Build our extension and every FlashInfer module the run loads side by side, before anything is measured."""
    input:
        config=inp(rules.freeze_config.output.config),
    output:
        manifest=out("build/kernels.json"),
    log:
        out("logs/build/kernels.log"),
    benchmark:
        out("benchmarks/build/kernels.tsv")
    priority: 100
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli build-kernels --config {input.config:q} --out {output.manifest:q} > {log:q} 2>&1"


rule bench_kernels:
    """Kernel device time: pkv-graph against FlashInfer's decode variants over batch x context (GPU only)."""
    input:
        built=kernels_built(),
    output:
        parquet=out("raw/kernels/sweep.parquet"),
    log:
        out("logs/kernels/sweep.log"),
    benchmark:
        out("benchmarks/kernels/sweep.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench kernels --out {output.parquet:q} > {log:q} 2>&1"


rule bench_feature_kernels:
    """Windows, sinks and q_len rows: pkv-graph against every FlashInfer path that has the feature (GPU only)."""
    input:
        built=kernels_built(),
    output:
        parquet=out("raw/kernels/features.parquet"),
    log:
        out("logs/kernels/features.log"),
    benchmark:
        out("benchmarks/kernels/features.tsv")
    params:
        # a baseline that lacks a case's feature refuses it: its row holds the error, not a time
        engines=list(feature_kernels()),
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench kernels --suites features --engines {params.engines:q} "
        "--out {output.parquet:q} > {log:q} 2>&1"
