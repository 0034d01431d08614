# PersistentKV experiment pipeline: calibrate -> freeze -> fan out -> Parquet -> report.
# `snakemake --cores 1 all` on a CUDA machine reproduces the paper's §4 into its own
# results/runs/<gpu>-<date>/ folder, with a comparison against the committed reference
# run results/; without CUDA it runs the CPU smoke profile into results/smoke/. The
# parse step imports nothing heavy (no torch, pandas or matplotlib). See docs/pipeline.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


report: "workflow/report/workflow.rst"


# Coerces command-line strings through the schema, validates (unknown keys refused at
# every level), resolves the profile and the results folder, checks the seeds.
include: "workflow/rules/common.smk"
include: "workflow/rules/calibrate.smk"
include: "workflow/rules/serve.smk"
include: "workflow/rules/isolated.smk"
include: "workflow/rules/ablations.smk"
include: "workflow/rules/mlp_proxy.smk"
include: "workflow/rules/external.smk"
include: "workflow/rules/nsight.smk"
include: "workflow/rules/kernels.smk"
include: "workflow/rules/model.smk"
include: "workflow/rules/host.smk"
include: "workflow/rules/fp8.smk"
# Last: one rule per table and figure of pkv.report.spec, reading the stages above.
include: "workflow/rules/report.smk"


# A table or figure whose inputs are gone is removed before a run that writes, never left stale.
if workflow.is_main_process and writes_results(sys.argv[1:]):
    remove_stale_reports()


# The HTML report's description names the resolved profile and results folder (the raw
# config says only `auto`); set after every check, so nothing validates or freezes it.
config["report_run"] = {"profile": PROFILE, "folder": ROOT}


rule all:
    """Every table and figure of this profile (pkv.report.spec, in_all), the Nsight capture and, for a run of your own, its comparison."""
    default_target: True
    input:
        final_outputs(),


onsuccess:
    # Where it went, as the run's last word (the results folder is named once, far above).
    print(results_summary(), file=sys.stderr)
