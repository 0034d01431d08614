# Model-level decode step (issues 12, 23): N decoder layers around the decode attention,
# each layer with its own KV, one CUDA graph per batch bucket; pkv-graph (the public
# DecodeWrapper) against FlashInfer's CUDA-graph path (plan() on the host every step),
# FlashInfer eager and the adaptive route, on the 16-bit and the FP8 cache. One job for every
# held-out seed in one process over the synthetic families, one for the external trace. Shapes,
# buckets, families, steps, engines, repeats and KV dtypes: the config's required
# `model_step` section (pkv.measure.model_plan), which puts its table and figure in `all`
# (pkv.report.spec). See docs/graph-decode.md.

from pkv.config.stages import STAGES, external_identity

MODEL_STEP_RAW = f"raw/{STAGES['model_step'].folder}"   # both commands write it (pkv.config.stages)
MODEL_STEP_EXTERNAL = STAGES["model_step_external"].file.format(name=external_identity(C["external"])[0])


rule model_step:
    """Model-level decode step (pkv measure model-step): per-layer KV, one CUDA graph per bucket, every held-out seed in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_paths(C, "model_step", ROOT),
    params:
        seeds=job_values("model_step", "seed"),
    log:
        out("logs/model_step/model_step.log"),
    benchmark:
        out("benchmarks/model_step/model_step.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure model-step --config {input.config:q} --constants {input.constants:q} "
        "--seed {params.seeds:q} --out {output.parquet:q} > {log:q} 2>&1"


rule model_step_external:
    """Model-level decode step on the external request trace (pkv measure model-step-external)."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
        trace=inp(C["external"]["path"]),
    output:
        parquet=out(f"{MODEL_STEP_RAW}/{MODEL_STEP_EXTERNAL}"),
    log:
        out(f"logs/model_step/{MODEL_STEP_EXTERNAL.removesuffix('.parquet')}.log"),
    benchmark:
        out(f"benchmarks/model_step/{MODEL_STEP_EXTERNAL.removesuffix('.parquet')}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure model-step-external --config {input.config:q} --constants {input.constants:q} "
        "--trace {input.trace:q} --out {output.parquet:q} > {log:q} 2>&1"
