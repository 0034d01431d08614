# Table 3: attention + gated MLP tail (one layer, and N layers: one plan per step serves
# them all, each layer reading its own KV cache over one page table).


rule measure_mlp_proxy:
    """Table 3: attention plus a gated MLP tail at each configured layer count (each layer its own KV), every held-out seed in one process."""
    input:
        config=inp(rules.freeze_config.output.config),
        constants=inp(rules.calibrate_device.output.constants),
    output:
        parquet=stage_outputs("mlp_proxy"),
    params:
        seeds=job_values("mlp_proxy", "seed"),
    log:
        out("logs/mlp_proxy/mlp_proxy.log"),
    benchmark:
        out("benchmarks/mlp_proxy/mlp_proxy.tsv")
    resources:
        gpu=1,
    conda:
        "../../envs/pkv.yaml"
    shell:
        "python3 -m pkv.cli measure mlp-proxy --config {input.config:q} --constants {input.constants:q} "
        "--seed {params.seeds:q} --out {output.parquet:q} > {log:q} 2>&1"
