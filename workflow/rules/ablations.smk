# Ablations: split sensitivity (Table 7), B4 split sweep, GQA sweep (Table 8),
# raggedness, and the implementation switches (fused merge, row-local bounds, early exit,
# indexed Q/O; CUDA-graph replay is the graph_s column of every row).


rule sweep_split_sensitivity:
    """Table 7: the cost-model policy at the frozen split and its neighbours on one operating point."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=job_pattern("split_sensitivity"),
    log:
        out("logs/split_sensitivity/{family}-b{max_active}.log"),
    benchmark:
        out("benchmarks/split_sensitivity/{family}-b{max_active}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure split-sensitivity --config {input.config:q} --constants {input.constants:q} "
        "--family {wildcards.family:q} --max-active {wildcards.max_active:q} --out {output.parquet:q} > {log:q} 2>&1"


rule sweep_b4:
    """The PersistentKV workqueue forced over a split grid on the B4 boundary, every held-out seed in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_outputs("b4_sweep"),
    params:
        seeds=job_values("b4_sweep", "seed"),
    log:
        out("logs/b4_sweep/b4_sweep.log"),
    benchmark:
        out("benchmarks/b4_sweep/b4_sweep.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure b4-sweep --config {input.config:q} --constants {input.constants:q} "
        "--seed {params.seeds:q} --out {output.parquet:q} > {log:q} 2>&1"


rule sweep_gqa:
    """Table 8: the serving trace at every GQA group size G of the config, in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_outputs("gqa_sweep"),
    params:
        groups=job_values("gqa_sweep", "group"),
    log:
        out("logs/gqa_sweep/gqa_sweep.log"),
    benchmark:
        out("benchmarks/gqa_sweep/gqa_sweep.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure gqa-sweep --config {input.config:q} --constants {input.constants:q} "
        "--group {params.groups:q} --out {output.parquet:q} > {log:q} 2>&1"


rule ablate_raggedness:
    """Raggedness ablation on the ablation seed: exact buckets vs masked bucket vs workqueue."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=job_pattern("raggedness"),
    log:
        out("logs/raggedness/s{seed}.log"),
    benchmark:
        out("benchmarks/raggedness/s{seed}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure raggedness --config {input.config:q} --constants {input.constants:q} "
        "--seed {wildcards.seed:q} --out {output.parquet:q} > {log:q} 2>&1"


rule ablate_implementation:
    """Implementation ablations on the ablation seed: fused merge, row-local bounds, early exit, indexed Q/O."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=job_pattern("implementation"),
    log:
        out("logs/implementation/s{seed}.log"),
    benchmark:
        out("benchmarks/implementation/s{seed}.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure implementation --config {input.config:q} --constants {input.constants:q} "
        "--seed {wildcards.seed:q} --out {output.parquet:q} > {log:q} 2>&1"
