# The kernel benchmark (issue 11): device time of pkv-graph against FlashInfer's three
# decode variants over the serving range, then its table and ratio figure from Parquet.
# Nothing here is routed, so it needs no calibration; paper profile only (GPU kernels).


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
        parquet=inp(rules.bench_kernels.output.parquet),
    output:
        table=report(out("tables/kernels.md"), caption=CAPTION, category="Tables",
                     labels={"table": "kernels", "format": "Markdown"}),
        figure=report(out("figures/kernel_ratio.png"), caption=CAPTION, category="Figures",
                      labels={"figure": "kernel_ratio"}),
    params:
        caption="Decode kernels, device time: pkv-graph (v4) against FlashInfer's CUDA-core, tensor-core and "
        "persistent decode over batch x context, ragged mixes and GQA group x head_dim; the table also states "
        "the kernel issue's bars as measured. Figure: faster FlashInfer / pkv-graph over (batch, context).",
    log:
        out("logs/kernels/report.log"),
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.report.kernels {input.parquet} --table {output.table} --figure {output.figure} > {log} 2>&1"
