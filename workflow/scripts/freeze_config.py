"""Write the resolved experiment configuration (profile applied) that every command reads."""

import sys

from pkv.measure_config import write_config

with open(snakemake.log[0], "w") as log:  # noqa: F821 - injected by Snakemake
    write_config(snakemake.params.config, snakemake.output.config)  # noqa: F821
    print(f"froze profile {snakemake.params.config['profile']} to {snakemake.output.config}", file=log)  # noqa: F821
    sys.exit(0)
