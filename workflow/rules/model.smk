# Model-level decode step (issue 12): N decoder layers around the decode attention, one
# CUDA graph per batch bucket; pkv-graph against FlashInfer's CUDA-graph path (plan() on
# the host every step), FlashInfer eager and the adaptive route. One job per held-out
# seed over the synthetic families, one for the external (Azure) trace. Shapes, buckets
# and steps are pkv.measure.model_step's defaults (llama-1b and llama-8b, buckets 1/8/32, 16
# steps); the smoke profile runs its CPU version. See docs/graph-decode.md.

MODEL_STEP_FAMILIES = "bimodal,zipf"   # synthetic families of the model step (until config.yaml names them)


rule model_step:
    """Model-level decode step: N decoder layers in one CUDA graph per bucket, one held-out seed."""
    input:
        config=rules.freeze_config.output.config,
        constants=rules.calibrate_device.output.constants,
    output:
        parquet=out("raw/model_step/s{seed}.parquet"),
    wildcard_constraints:
        seed="|".join(HELDOUT),
    params:
        families=MODEL_STEP_FAMILIES,
    log:
        out("logs/model_step/s{seed}.log"),
    benchmark:
        out("benchmarks/model_step/s{seed}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.measure.model_step --config {input.config:q} --constants {input.constants:q} "
        "--families {params.families:q} --seeds {wildcards.seed:q} --budget-s 1e9 --out {output.parquet:q} > {log:q} 2>&1"


rule model_step_external:
    """Model-level decode step on the external request trace."""
    input:
        config=rules.freeze_config.output.config,
        constants=rules.calibrate_device.output.constants,
        trace=C["external"]["path"],
    output:
        parquet=out("raw/model_step/azure2023.parquet"),
    log:
        out("logs/model_step/azure2023.log"),
    benchmark:
        out("benchmarks/model_step/azure2023.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.measure.model_step --config {input.config:q} --constants {input.constants:q} "
        "--families azure --budget-s 1e9 --out {output.parquet:q} > {log:q} 2>&1"
