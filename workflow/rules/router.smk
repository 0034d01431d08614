# Issue 13: is the router right, and does it pay for itself? From the serving Parquet, the
# calibration sweep and the frozen constants (pkv.report_router); one output per rule.


rule report_router_regret:
    input:
        serve=serve_outputs(),
        constants=rules.calibrate_device.output.constants,
    output:
        md=out("tables/router_regret.md"),
    log:
        out("logs/report/router_regret.md.log"),
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli report-router --target {output.md} > {log} 2>&1"


rule plot_router_accuracy:
    input:
        serve=serve_outputs(),
        calibration=rules.calibrate_device.output.raw,
        constants=rules.calibrate_device.output.constants,
        config=rules.freeze_config.output.config,
    output:
        png=out("figures/router_accuracy.png"),
    log:
        out("logs/report/router_accuracy.png.log"),
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli report-router --target {output.png} > {log} 2>&1"
