# PersistentKV experiment pipeline: calibrate -> freeze -> fan out -> Parquet -> report.
# `snakemake --cores 1 all` on a CUDA machine reproduces the paper's §4; without CUDA it
# runs the CPU smoke profile into results/smoke/. See docs/pipeline.md.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/isolated.smk"
include: "workflow/rules/ablations.smk"
include: "workflow/rules/mlp_proxy.smk"
include: "workflow/rules/external.smk"
include: "workflow/rules/nsight.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
