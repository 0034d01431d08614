# Table 2: one job per (family, max_active) point x engine set, over every held-out seed in
# one process (one file per seed; any one of them as a target reruns the point's job).


rule serve_trace:
    """Table 2 and 4: the held-out traces of one (family, batch) operating point through one engine set."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=expand(out("raw/serve/{{family}}-b{{max_active}}-s{seed}-{{engine_set}}.parquet"), seed=HELDOUT),
    params:
        seeds=HELDOUT,
    log:
        out("logs/serve/{family}-b{max_active}-{engine_set}.log"),
    benchmark:
        out("benchmarks/serve/{family}-b{max_active}-{engine_set}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure serve --config {input.config:q} --constants {input.constants:q} "
        "--family {wildcards.family:q} --max-active {wildcards.max_active:q} --seed {params.seeds:q} "
        "--engine-set {wildcards.engine_set:q} --out {output.parquet:q} > {log:q} 2>&1"
