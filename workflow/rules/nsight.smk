# Table 5: a short B8 trace under Nsight Compute (in `all` only with nsight: true), then
# its CSV parsed into one row per kernel invocation. The capture fails at once, saying
# how to turn the stage off, when `ncu` is missing.


rule capture_nsight:
    """Nsight Compute counters of the short B8 trace (needs ncu; nsight: false leaves it out)."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
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
        "python3 -m pkv.cli nsight --config {input.config:q} --constants {input.constants:q} --out {output.csv:q} > {log:q} 2>&1"


rule parse_nsight:
    """Table 5's Parquet: the ncu CSV capture parsed per kernel invocation."""
    input:
        csv=inp(rules.capture_nsight.output.csv),
        run=inp(rules.capture_nsight.output.run),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=job_pattern("nsight_kernels"),
    log:
        out("logs/nsight/parse.log"),
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli nsight-parse --csv {input.csv:q} --run {input.run:q} --constants {input.constants:q} "
        "--out {output.parquet:q} > {log:q} 2>&1"
