# Issue 13: the host path of one decode step per engine and batch (prepare, run launch,
# route decision) beside FlashInfer's raw plan() on the same prebuilt arrays. Writes its
# Parquet and renders results/tables/host_path.md from it (pkv.bench_host.markdown).


rule bench_host:
    input:
        config=rules.freeze_config.output.config,
        constants=rules.calibrate_device.output.constants,
    output:
        parquet=out("raw/host/host_path.parquet"),
        md=out("tables/host_path.md"),
    log:
        out("logs/bench_host.log"),
    benchmark:
        out("benchmarks/bench_host.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench host --config {input.config} --constants {input.constants} "
        "--out {output.parquet} --table {output.md} > {log} 2>&1"
