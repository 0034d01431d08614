# Table 1: single-request native-paged baselines, 50% holes, one job per context length.


rule measure_isolated:
    """Table 1: one request of CONTEXT tokens with 50% page holes, every engine, device time per call."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=out("raw/isolated/ctx{context}.parquet"),
    log:
        out("logs/isolated/ctx{context}.log"),
    benchmark:
        out("benchmarks/isolated/ctx{context}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure isolated --config {input.config:q} --constants {input.constants:q} "
        "--context {wildcards.context:q} --out {output.parquet:q} > {log:q} 2>&1"
