# Presentation: one rule per table (Markdown; LaTeX too for the paper's tables) and per
# figure, each reading Parquet only and calling `pkv report --target FILE` (no torch), and
# each marked for `snakemake --report` with its caption. For a paper run of your own, one
# more table: the run beside the committed reference run (`pkv compare`).



for _name, _table in TABLE_SPECS.items():

    rule:
        """A table of pkv.report.spec (Markdown, and LaTeX for a paper table), built by `pkv report --target` from Parquet."""
        name:
            f"report_{_name}"
        input:
            table_inputs(_name),
        output:
            **table_outputs(_name, _table),
        params:
            caption=f"{caption_title(_name, _table)}. {_table.caption}",
        localrule: True
        conda:
            "../../envs/pkv.yaml"
        log:
            out(f"logs/report/{_name}.log"),
        shell:
            "python3 -m pkv.cli report --target {output:q} > {log:q} 2>&1"


for _name, _figure in FIGURE_SPECS.items():

    rule:
        """A figure of pkv.report.spec (PNG), built by `pkv report --target` from Parquet."""
        name:
            f"plot_{_name}"
        input:
            figure_inputs(_name),
        output:
            png=report(out(f"figures/{_name}.png"), caption=CAPTION, category="Figures", labels={"figure": _name}),
        params:
            caption=_figure.caption,
        localrule: True
        conda:
            "../../envs/pkv.yaml"
        log:
            out(f"logs/report/{_name}.png.log"),
        shell:
            "python3 -m pkv.cli report --target {output.png:q} > {log:q} 2>&1"


rule compare_reference:
    """A run of your own beside the committed reference run: every table's ratios side by side."""
    input:
        comparison_inputs(),
        reference=ancient(f"{REFERENCE_ROOT}/config.json"),
    output:
        md=report(out("tables/comparison.md"), caption=CAPTION, category="Comparison", labels={"table": "comparison"}),
    params:
        caption=f"This run's tables beside the committed reference run's ({REFERENCE_ROOT}/), ratios side by side.",
    localrule: True
    conda:
        "../../envs/pkv.yaml"
    log:
        out("logs/report/comparison.md.log"),
    shell:
        "python3 -m pkv.cli compare --reference \"$(dirname {input.reference:q})\" --out {output.md:q} > {log:q} 2>&1"
