# Table 5 capture: a short B8 trace under Nsight Compute (in `all` only with nsight: true).
# Fails at once, saying how to turn the stage off, when `ncu` is missing. The CSV
# parser into Parquet is issue 6.


rule capture_nsight:
    input:
        config=rules.freeze_config.output.config,
        constants=rules.calibrate_device.output.constants,
    output:
        csv=out("raw/nsight/ncu.csv"),
        run=out("raw/nsight/ncu.run.parquet"),
    log:
        out("logs/nsight/ncu.log"),
    benchmark:
        out("benchmarks/nsight/ncu.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli nsight --config {input.config} --constants {input.constants} --out {output.csv} > {log} 2>&1"
