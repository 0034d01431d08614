# Table 2: one job per (family, max_active) point x held-out seed x engine set.


rule serve_trace:
    """Table 2 and 4: one held-out trace of one (family, batch) operating point through one engine set."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=out("raw/serve/{family}-b{max_active}-s{seed}-{engine_set}.parquet"),
    wildcard_constraints:
        seed="|".join(HELDOUT),
    log:
        out("logs/serve/{family}-b{max_active}-s{seed}-{engine_set}.log"),
    benchmark:
        out("benchmarks/serve/{family}-b{max_active}-s{seed}-{engine_set}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure serve --config {input.config:q} --constants {input.constants:q} "
        "--family {wildcards.family:q} --max-active {wildcards.max_active:q} --seed {wildcards.seed:q} "
        "--engine-set {wildcards.engine_set:q} --out {output.parquet:q} > {log:q} 2>&1"
