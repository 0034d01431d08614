# Issue 13: is the router right, and does it pay for itself? From the serving Parquet, the
# calibration sweep and the frozen constants (pkv.report.router); one output per rule.
# Named targets (`snakemake --cores 1 results/tables/router_regret.md`), outside `all`.


rule report_router_regret:
    input:
        serve=inputs(serve_outputs()),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        md=report(out("tables/router_regret.md"), caption=CAPTION, category="Tables",
                  labels={"table": "router_regret", "format": "Markdown"}),
    params:
        caption="Router regret: per serving trace, the adaptive route's wall and device time against the best "
        "fixed route in hindsight.",
    log:
        out("logs/report/router_regret.md.log"),
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli report-router --target {output.md} > {log} 2>&1"


rule plot_router_accuracy:
    input:
        serve=inputs(serve_outputs()),
        calibration=inp(rules.calibrate_device.output.raw),
        constants=inp(rules.calibrate_device.output.constants),
        config=inp(rules.freeze_config.output.config),
    output:
        png=report(out("figures/router_accuracy.png"), caption=CAPTION, category="Figures",
                   labels={"figure": "router_accuracy"}),
    params:
        caption="Router accuracy: the cost model's estimate against the measured time per route, one panel per route.",
    log:
        out("logs/report/router_accuracy.png.log"),
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli report-router --target {output.png} > {log} 2>&1"
