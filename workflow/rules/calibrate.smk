# Freeze the resolved config, then calibrate on the calibration seed only.


rule freeze_config:
    output:
        config=out("config.json"),
    params:
        config=C,
    log:
        out("logs/freeze_config.log"),
    script:
        "../scripts/freeze_config.py"


rule calibrate_device:
    input:
        config=rules.freeze_config.output.config,
    output:
        constants=out("calibration/constants.json"),
        raw=out("raw/calibrate/calibration.parquet"),
    log:
        out("logs/calibrate.log"),
    benchmark:
        out("benchmarks/calibrate.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "{PKV} calibrate --config {input.config} --out {output.constants} --raw {output.raw} > {log} 2>&1"
