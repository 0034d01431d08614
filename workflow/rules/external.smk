# The external request trace (Azure LLM inference 2023) through the file-based trace path.


rule replay_external:
    """The external request trace (config external.path) replayed through every engine."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
        trace=inp(C["external"]["path"]),
    output:
        parquet=out("raw/external/azure2023.parquet"),
    log:
        out("logs/external/azure2023.log"),
    benchmark:
        out("benchmarks/external/azure2023.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure external --config {input.config:q} --constants {input.constants:q} "
        "--trace {input.trace:q} --out {output.parquet:q} > {log:q} 2>&1"
