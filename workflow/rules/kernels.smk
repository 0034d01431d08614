# The kernel benchmark (issue 11): device time of pkv-graph against FlashInfer's three
# decode variants over the serving range, then its table and ratio figure from Parquet.
# Nothing here is routed, so it needs no calibration; paper profile only (GPU kernels).
# First of all (priority), every kernel the run loads is built at once (pkv/measure/warm.py).


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
