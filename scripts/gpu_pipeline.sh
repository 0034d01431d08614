#!/usr/bin/env bash
# One device call: the paper profile of the pipeline under a wall-clock limit, then
# everything it made (results/, logs) packed into one tarball under $OUT.
# Usage (repo root): scripts/gpu_pipeline.sh LIMIT_S [extra snakemake args and targets]
set -uo pipefail
limit=${1:-540}; shift || true
out=${OUT:-gpu_pipeline_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1
[[ -f gpu_commit.txt ]] && export PKV_GIT_COMMIT=$(cat gpu_commit.txt)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
t0=$(date +%s)
timeout "$limit" snakemake --cores 8 --resources gpu=1 --keep-going --config profile=paper "$@" \
  > "$out/snakemake.log" 2>&1
echo "snakemake exit $? after $(( $(date +%s) - t0 )) s"
grep -E "Error|error:|Finished job|steps of" "$out/snakemake.log" | tail -30
tar -czf "$out/results.tgz" results .snakemake/log 2>/dev/null
ls -la "$out"
