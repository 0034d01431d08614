# The external request trace (config external.path; the Azure LLM inference 2023 trace in
# the committed config) through the file-based trace path: a named stage, its files
# raw/external/NAME.parquet (external.name, pkv.config.stages.external_identity). Where the
# config gives external.stress_scale, a second stage replays it with the prompts multiplied
# by that, a stress test: raw/external_stress/NAME.parquet (pkv.config.stages.EXTERNAL_REPLAYS).

EXTERNAL_FILE = next(iter(stage_files(C, "external")))   # NAME.parquet: the one job of the stage
EXTERNAL_NAME = EXTERNAL_FILE.removesuffix(".parquet")


rule replay_external:
    """The external request trace (config external.path) replayed through every engine."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
        trace=inp(C["external"]["path"]),
    output:
        parquet=stage_outputs("external"),
    log:
        out(f"logs/external/{EXTERNAL_NAME}.log"),
    benchmark:
        out(f"benchmarks/external/{EXTERNAL_NAME}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure external --config {input.config:q} --constants {input.constants:q} "
        "--trace {input.trace:q} --out {output.parquet:q} > {log:q} 2>&1"


if stage_files(C, "external_stress"):

    rule replay_external_stress:
        """The external request trace with its prompts multiplied by external.stress_scale: a stress test."""
        input:
            config=inp(rules.freeze_config.output.config),
            constants=inp(rules.calibrate_device.output.constants),
            trace=inp(C["external"]["path"]),
        output:
            parquet=stage_outputs("external_stress"),
        log:
            out(f"logs/external_stress/{EXTERNAL_NAME}.log"),
        benchmark:
            out(f"benchmarks/external_stress/{EXTERNAL_NAME}.tsv")
        resources:
            gpu=1,
        conda:
            "../../envs/pkv.yaml"
        shell:
            "python3 -m pkv.cli measure external-stress --config {input.config:q} --constants {input.constants:q} "
            "--trace {input.trace:q} --out {output.parquet:q} > {log:q} 2>&1"
