# FP8 (e4m3) KV cache (issue 15): the kernel rows (`pkv bench kernels --suites fp8`), the
# accuracy benchmark, and the serving ablation (ablations.kv_fp8 of config.yaml: one trace
# per held-out seed from a 16-bit and from an e4m3 cache), each with its table, in the paper
# profile's `all` and each a target of its own: `snakemake --cores 1 results/tables/fp8_kernels.md`
# (and fp8_accuracy.md, fp8_serving.md). Paper profile: the FP8 kernels need a GPU.

from pkv.engines.table import fp8_kernels


rule bench_fp8_kernels:
    """FP8 KV kernels: pkv-graph over an e4m3 cache against FlashInfer's FP8 and 16-bit decode (GPU only)."""
    input:
        built=kernels_built(),
    output:
        parquet=out("raw/kernels/fp8.parquet"),
    log:
        out("logs/kernels/fp8.log"),
    benchmark:
        out("benchmarks/kernels/fp8.tsv")
    params:
        # pkv-graph against FlashInfer's FP8 decode: every FP8 reader with a CUDA kernel (the engine table)
        engines=list(fp8_kernels()),
        suites=suites("fp8_kernels"),
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench kernels --suites {params.suites:q} --engines {params.engines:q} "
        "--out {output.parquet:q} > {log:q} 2>&1"


rule bench_fp8_accuracy:
    """FP8 KV accuracy: error against the FP32 reference per scale policy and engine (GPU only)."""
    input:
        built=kernels_built(),
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
        "python3 -m pkv.cli bench fp8-accuracy --out {output.parquet:q} > {log:q} 2>&1"


rule measure_kv_fp8:
    """FP8 KV serving ablation: each held-out trace from a 16-bit and an e4m3 cache, every seed in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_outputs("kv_fp8"),
    params:
        seeds=job_values("kv_fp8", "seed"),
    log:
        out("logs/kv_fp8/kv_fp8.log"),
    benchmark:
        out("benchmarks/kv_fp8/kv_fp8.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure kv-fp8 --config {input.config:q} --constants {input.constants:q} "
        "--seed {params.seeds:q} --out {output.parquet:q} > {log:q} 2>&1"
