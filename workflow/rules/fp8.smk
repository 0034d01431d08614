# FP8 (e4m3) KV cache (issue 15): the kernel rows (`pkv bench kernels --suites fp8`), the
# accuracy benchmark, and the serving ablation (ablations.kv_fp8 of config.yaml: one trace
# per held-out seed from a 16-bit and from an e4m3 cache), each with its table. Named
# targets, not part of `all`: `snakemake --cores 1 results/tables/fp8_kernels.md` (and
# fp8_accuracy.md, fp8_serving.md). Paper profile: the FP8 kernels need a GPU.


rule bench_fp8_kernels:
    output:
        parquet=out("raw/kernels/fp8.parquet"),
    log:
        out("logs/kernels/fp8.log"),
    benchmark:
        out("benchmarks/kernels/fp8.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench kernels --suites fp8 --engines pkv-graph flashinfer flashinfer-tc "
        "--out {output.parquet} > {log} 2>&1"


rule bench_fp8_accuracy:
    output:
        parquet=out("raw/fp8/accuracy.parquet"),
    log:
        out("logs/fp8/accuracy.log"),
    benchmark:
        out("benchmarks/fp8/accuracy.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench fp8-accuracy --out {output.parquet} > {log} 2>&1"


rule measure_kv_fp8:
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=out("raw/kv_fp8/s{seed}.parquet"),
    wildcard_constraints:
        seed="|".join(HELDOUT),
    log:
        out("logs/kv_fp8/s{seed}.log"),
    benchmark:
        out("benchmarks/kv_fp8/s{seed}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure kv-fp8 --config {input.config} --constants {input.constants} "
        "--seed {wildcards.seed} --out {output.parquet} > {log} 2>&1"


FP8_TABLES = {
    "fp8_kernels": ("kernels", lambda wc: [inp(rules.bench_fp8_kernels.output.parquet)],
                    "FP8 (e4m3) KV cache, decode kernels: pkv-graph over an FP8 cache against FlashInfer's FP8 and "
                    "16-bit decode and pkv-graph's 16-bit decode, device time, with the FP8 issue's bars as measured."),
    "fp8_accuracy": ("accuracy", lambda wc: [inp(rules.bench_fp8_accuracy.output.parquet)],
                     "FP8 (e4m3) KV cache, accuracy: error against the FP32 reference on the original 16-bit "
                     "values per scale policy and engine, random and outlier-channel caches."),
    "fp8_serving": ("serving", lambda wc: inputs(expand(rules.measure_kv_fp8.output.parquet, seed=HELDOUT)),
                    "FP8 KV serving ablation: one held-out trace per seed from a 16-bit and an e4m3 cache, "
                    "device and wall time per step and throughput ratios over FlashInfer."),
}


rule report_fp8:
    localrule: True
    input:
        lambda wc: FP8_TABLES[wc.name][1](wc),
    output:
        table=report(out("tables/{name}.md"), caption=CAPTION, category="Tables",
                     labels={"table": "{name}", "format": "Markdown"}),
    wildcard_constraints:
        name="|".join(FP8_TABLES),
    params:
        kind=lambda wc: FP8_TABLES[wc.name][0],
        caption=lambda wc: FP8_TABLES[wc.name][2],
    log:
        out("logs/fp8/{name}.log"),
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.report.fp8 {params.kind} {input} --table {output.table} > {log} 2>&1"
