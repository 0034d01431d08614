# The kernel benchmark (issue 11): device time of pkv-graph against FlashInfer's decode variants
# over the serving range, then its table and ratio figure from Parquet. Nothing here is routed,
# so it needs no calibration; paper profile only (GPU kernels). First of all (priority), every
# kernel the run loads is built at once (pkv/measure/warm.py). The features rows (sliding
# windows, sinks, q_len; issue 50) are in `all` where the config has a feature_kernels section
# (the smoke profile's does: pkv-graph's CPU task list, no FlashInfer on a CPU); without it they
# are a named target: `snakemake --cores 1 results/tables/feature_kernels.md`.


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
    params:
        suites=suites("kernels"),
    shell:
        "python3 -m pkv.cli bench kernels --suites {params.suites:q} --out {output.parquet:q} > {log:q} 2>&1"


rule bench_feature_kernels:
    """Windows, sinks and q_len rows: pkv-graph against every FlashInfer path that has the feature (GPU; CPU smoke)."""
    input:
        config=inp(rules.freeze_config.output.config),
        built=kernels_built(),
    output:
        parquet=out("raw/kernels/features.parquet"),
    log:
        out("logs/kernels/features.log"),
    benchmark:
        out("benchmarks/kernels/features.tsv")
    params:
        suites=suites("feature_kernels"),
        # a baseline that lacks a case's feature refuses it: its row holds the error, not a time
        engines=feature_engines(),
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench kernels --config {input.config:q} --suites {params.suites:q} "
        "--engines {params.engines:q} --out {output.parquet:q} > {log:q} 2>&1"
