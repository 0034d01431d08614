# Freeze the resolved config, then calibrate on the calibration seed only.


rule freeze_config:
    """Write the resolved config (profile applied) every job reads; its hash is in every Parquet file."""
    output:
        config=out("config.json"),
    params:
        config=config_json(),
    log:
        out("logs/freeze_config.log"),
    localrule: True
    priority: 100   # then build_kernels: the run's JIT builds before any measuring job
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli freeze-config --json {params.config:q} --out {output.config:q} > {log:q} 2>&1"


rule calibrate_device:
    """Fit and freeze the cost-model constants on the calibration seed only (constants.json and the sweep's Parquet)."""
    input:
        config=inp(rules.freeze_config.output.config),
        built=kernels_built(),
    output:
        constants=out("calibration/constants.json"),
        raw=job_pattern("calibrate"),
    log:
        out("logs/calibrate.log"),
    benchmark:
        out("benchmarks/calibrate.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli calibrate --config {input.config:q} --out {output.constants:q} --raw {output.raw:q} > {log:q} 2>&1"
