# Table 2: one job per engine set over every serving point and held-out seed in one process
# (one file per point and seed; any one of them as a target reruns the engine set's job,
# `pkv measure serve` measures one point or seed alone).


rule serve_trace:
    """Table 2 and 4: the held-out traces of every (family, batch) operating point through one engine set, in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=[job_pattern("serve").format(family=f, max_active=b, seed=s, engine_set="{engine_set}") for f, b, s in SERVE_JOBS],
    params:
        families=[f for f, _, _ in SERVE_JOBS],
        batches=[b for _, b, _ in SERVE_JOBS],
        seeds=[s for _, _, s in SERVE_JOBS],
    log:
        out("logs/serve/{engine_set}.log"),
    benchmark:
        out("benchmarks/serve/{engine_set}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure serve --config {input.config:q} --constants {input.constants:q} "
        "--family {params.families:q} --max-active {params.batches:q} --seed {params.seeds:q} "
        "--engine-set {wildcards.engine_set:q} --out {output.parquet:q} > {log:q} 2>&1"
