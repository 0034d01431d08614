#!/usr/bin/env bash
# Installs what tests/test_slurm.py needs, if missing: Debian's SLURM daemons and client
# (slurm-wlm's parts, without munge: the test cluster uses AuthType=auth/none) and
# Snakemake's SLURM executor plugin. Idempotent and quiet when everything is there.
# Starts nothing: the test fixture starts and stops its own cluster (tests/slurm/cluster.sh).
set -euo pipefail
export PATH="$PATH:/usr/sbin:/sbin"  # slurmctld and slurmd live there

need_apt=0
for exe in slurmctld slurmd sbatch squeue sinfo scontrol scancel; do
  command -v "$exe" >/dev/null || need_apt=1
done
if [ "$need_apt" = 1 ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # --no-install-recommends: no munge, no mail server, no docs.
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null
fi

if ! python3 -c 'import snakemake_executor_plugin_slurm' 2>/dev/null; then
  python3 -m pip install -q snakemake-executor-plugin-slurm
fi
echo "slurm-setup: $(slurmctld -V), snakemake-executor-plugin-slurm $(python3 -c 'from importlib.metadata import version; print(version("snakemake-executor-plugin-slurm"))')"
