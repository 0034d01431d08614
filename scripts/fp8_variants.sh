#!/usr/bin/env bash
# Build-time variants of the FP8 kernel (PKV_NVCC_FLAGS), built in parallel, then timed on a
# few FP8 points. Usage: scripts/fp8_variants.sh "FLAGS1" "FLAGS2" ... (an empty string = default).
set -uo pipefail
out=${OUT:-fp8_variants_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cases=${CASES:-B1 32K fp8-tensor,B1 128K fp8-tensor,B8 32K fp8-tensor,B64 2K fp8-tensor}
i=0
for flags in "$@"; do
  PKV_NVCC_FLAGS="$flags" python3 -c "from pkv.kernels import ops; ops()" > "$out/build$i.log" 2>&1 &
  i=$((i+1))
done
wait
i=0
for flags in "$@"; do
  echo "== variant $i: '$flags'"; tail -3 "$out/build$i.log"
  PKV_NVCC_FLAGS="$flags" timeout 120 python3 -m pkv.kernel_sweep --suites fp8 --cases "$cases" --reps 15 \
    --engines pkv-graph --out "$out/v$i.parquet" 2>&1 | grep -E "^  pkv|^B"
  i=$((i+1))
done
