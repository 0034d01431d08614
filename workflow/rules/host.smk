# Issue 13: the host path of one decode step per engine and batch (prepare, run launch,
# route decision) beside FlashInfer's raw plan() on the same prebuilt arrays. Writes its
# Parquet; results/tables/host_path.md is its report target (pkv.report.host).


rule bench_host:
    """Host path per decode step per engine and batch, beside FlashInfer's raw plan()."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=out("raw/host/host_path.parquet"),
    log:
        out("logs/bench_host.log"),
    benchmark:
        out("benchmarks/bench_host.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli bench host --config {input.config:q} --constants {input.constants:q} "
        "--out {output.parquet:q} > {log:q} 2>&1"
