# Model-level decode step (issue 12): N decoder layers around the decode attention, one
# CUDA graph per batch bucket; pkv-graph against FlashInfer's CUDA-graph path (plan() on
# the host every step), FlashInfer eager and the adaptive route. One job per held-out
# seed over the synthetic families, one for the external (Azure) trace. Shapes, buckets
# and steps are pkv.measure.model_step's defaults (llama-1b and llama-8b, buckets 1/8/32, 16
# steps); the smoke profile runs its CPU version. See docs/graph-decode.md.

MODEL_STEP_FAMILIES = "bimodal,zipf"   # synthetic families of the model step (until config.yaml names them)


rule model_step:
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
        "python3 -m pkv.measure.model_step --config {input.config} --constants {input.constants} "
        "--families {params.families} --seeds {wildcards.seed} --budget-s 1e9 --out {output.parquet} > {log} 2>&1"


rule model_step_external:
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
        "python3 -m pkv.measure.model_step --config {input.config} --constants {input.constants} "
        "--families azure --budget-s 1e9 --out {output.parquet} > {log} 2>&1"


# Table and figure: named targets (`snakemake --cores 1 results/tables/model_step.md`), not
# yet part of `all`: the committed reference run holds the model step of fewer seeds than
# the fan-out names (results/README.md says which).
rule report_model_step:
    input:
        inputs(model_step_outputs()),
    output:
        md=report(out("tables/model_step.md"), caption=CAPTION, category="Tables",
                  labels={"table": "model_step", "format": "Markdown"}),
    params:
        caption="Model-level decode step: N decoder layers, one CUDA graph per batch bucket; pkv-graph (no host "
        "plan) against FlashInfer's CUDA-graph path (plan() on the host each step), FlashInfer eager and the "
        "adaptive route; serial wall, device time and pipelined throughput per step.",
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    log:
        out("logs/report/model_step.md.log"),
    shell:
        "python3 -m pkv.report.model --target {output.md} > {log} 2>&1"


rule plot_model_step:
    input:
        inputs(model_step_outputs()),
    output:
        png=report(out("figures/model_step.png"), caption=CAPTION, category="Figures",
                   labels={"figure": "model_step"}),
    params:
        caption="Model-level decode step time over context length, per engine, one panel per model shape.",
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    log:
        out("logs/report/model_step.png.log"),
    shell:
        "python3 -m pkv.report.model --target {output.png} > {log} 2>&1"
