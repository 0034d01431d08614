#!/usr/bin/env bash
# Build-time variants of the FP8 kernel (PKV_NVCC_FLAGS), built in parallel, then timed on a
# few FP8 points. Usage: scripts/fp8_variants.sh "FLAGS[|ENGINE]" ... (empty FLAGS = the default
# build; ENGINE defaults to pkv-graph, e.g. "pkv-graph[ctas_per_sm=3]").
set -uo pipefail
out=${OUT:-fp8_variants_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
cases=${CASES:-B1 32K fp8-tensor,B1 128K fp8-tensor,B8 32K fp8-tensor,B64 2K fp8-tensor}
i=0
for v in "$@"; do
  PKV_NVCC_FLAGS="${v%%|*}" python3 -c "from pkv.kernels.loader import ops; ops()" > "$out/build$i.log" 2>&1 &
  i=$((i+1))
done
wait
i=0
for v in "$@"; do
  flags=${v%%|*}; engine=pkv-graph; [[ "$v" == *"|"* ]] && engine=${v#*|}
  echo "== variant $i: '$flags' $engine"; grep -E "error" "$out/build$i.log" | head -3
  PKV_NVCC_FLAGS="$flags" timeout 120 python3 -m pkv.bench.kernels --suites fp8 --cases "$cases" --reps 15 \
    --engines "$engine" --out "$out/v$i.parquet" 2>&1 | grep -E "^  pkv|^B|Error"
  i=$((i+1))
done
