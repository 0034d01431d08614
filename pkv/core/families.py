"""The one table of synthetic trace families (numpy- and torch-free: the config schema,
the Snakefile's wildcards and the report's row order read it at parse time). A new
family is a row here plus its prompt-length rule in pkv.core.traces._prompt_lengths."""

FAMILIES = {
    "bucketed": "prompts at the four bucket lengths 8K/16K/32K/64K",
    "homogeneous": "every prompt the same length",
    "bimodal": "a mix of short and long prompts",
    "uniform": "prompt lengths uniform over a range",
    "zipf": "Zipf-distributed prompt lengths",
}
