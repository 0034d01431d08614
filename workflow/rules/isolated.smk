# Table 1: single-request native-paged baselines, 50% holes: every context length in one
# process, one file each.


rule measure_isolated:
    """Table 1: one request of each configured context length with 50% page holes, every engine, device time per call."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_outputs("isolated"),
    params:
        contexts=job_values("isolated", "context"),
    log:
        out("logs/isolated/isolated.log"),
    benchmark:
        out("benchmarks/isolated/isolated.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure isolated --config {input.config:q} --constants {input.constants:q} "
        "--context {params.contexts:q} --out {output.parquet:q} > {log:q} 2>&1"
