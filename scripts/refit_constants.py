"""Refit the cost model's fitted constants from an existing calibration sweep, on the CPU.

    PYTHONPATH=. python3 scripts/refit_constants.py results/calibration/constants.json \
        results/raw/calibrate/calibration.parquet results/config.json OUT.json

Measured values (beta, SM count, the host's launch overhead) are kept; the operating
points, their host times, C_min, lambda, the baselines' CTAs and H_r are refitted with
pkv.measure.calibrate.fit_constants, as `pkv calibrate` would from the same sweep.
"""

import json
import sys

import pandas as pd

from pkv.measure.calibrate import fit_constants
from pkv.core.io import atomic_write_text
from pkv.config.resolve import load_config, shape_of


def main(constants: str, raw: str, config: str, out: str) -> None:
    cfg = load_config(config)
    shape = shape_of(cfg)
    old = json.loads(open(constants).read())
    new = fit_constants(old, pd.read_parquet(raw), cfg["baselines"], shape.kv_bytes_per_token, shape.num_kv_heads)
    atomic_write_text(out, json.dumps(new, indent=2, sort_keys=True) + "\n")
    print(f"C_min {old['c_min']:.3f} -> {new['c_min']:.3f}, lambda {old['launch_overhead_s'] * 1e6:.1f} -> "
          f"{new['launch_overhead_s'] * 1e6:.1f} us, baseline CTAs {new['baseline_ctas_per_head']}; wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
