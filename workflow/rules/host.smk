# Issue 13: the host path of one decode step per engine and batch (prepare, run launch,
# route decision) beside FlashInfer's raw plan() on the same prebuilt arrays. Writes its
# Parquet and renders results/tables/host_path.md from it (pkv.bench.host.markdown).


rule bench_host:
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=out("raw/host/host_path.parquet"),
        md=report(out("tables/host_path.md"), caption=CAPTION, category="Tables",
                  labels={"table": "host_path", "format": "Markdown"}),
    params:
        caption="Host path per decode step: prepare, run launch and route µs per engine and batch, beside "
        "FlashInfer's raw plan() on the same arrays.",
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
