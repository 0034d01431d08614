# The kernel benchmark (issue 11): device time of pkv-graph against FlashInfer's three
# decode variants over the serving range, then its table and ratio figure from Parquet.
# It needs no calibration (nothing here is routed), so it runs first and stands alone.


rule bench_kernels:
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
        "python3 -m pkv.cli bench kernels --out {output.parquet} > {log} 2>&1"


rule report_kernels:
    localrule: True
    input:
        parquet=rules.bench_kernels.output.parquet,
    output:
        table=out("tables/kernels.md"),
        figure=out("figures/kernel_ratio.png"),
    log:
        out("logs/kernels/report.log"),
    shell:
        "python3 -m pkv.report_kernels {input.parquet} --table {output.table} --figure {output.figure} > {log} 2>&1"
