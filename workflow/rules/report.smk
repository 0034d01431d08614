# Presentation: one rule per table (Markdown; LaTeX too for the paper's tables) and per
# figure, each reading Parquet only and calling `pkv report --target FILE`.

for _name, _table in TABLES.items():

    rule:
        name:
            f"report_{_name}"
        input:
            table_inputs(_name),
        output:
            md=out(f"tables/{_name}.md"),
        localrule: True
        conda:
            "../../envs/pkv.yaml"
        log:
            out(f"logs/report/{_name}.md.log"),
        shell:
            "python3 -m pkv.cli report --target {output.md} > {log} 2>&1"

    if _table.latex:

        rule:
            name:
                f"report_{_name}_latex"
            input:
                table_inputs(_name),
            output:
                tex=out(f"tables/{_name}.tex"),
            localrule: True
            conda:
                "../../envs/pkv.yaml"
            log:
                out(f"logs/report/{_name}.tex.log"),
            shell:
                "python3 -m pkv.cli report --target {output.tex} > {log} 2>&1"


for _name in FIGURES:

    rule:
        name:
            f"plot_{_name}"
        input:
            figure_inputs(_name),
        output:
            png=out(f"figures/{_name}.png"),
        localrule: True
        conda:
            "../../envs/pkv.yaml"
        log:
            out(f"logs/report/{_name}.png.log"),
        shell:
            "python3 -m pkv.cli report --target {output.png} > {log} 2>&1"
