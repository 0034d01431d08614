#!/usr/bin/env bash
# One device call for the v4 kernel work: build, pkv-graph GPU tests, a quick sweep
# against FlashInfer, an Nsight Compute diagnosis, then the v3 regression tests.
# Usage on the device (repo root, after `source .devsite/use-site`): scripts/gpu_v4.sh [stages]
# stages: comma list of build,graph,sweep,ncu,v3,full (default build,graph,sweep,ncu,v3).
stages=${1:-build,graph,sweep,ncu,v3}
source "$(dirname "$0")/device_env.sh"
if has build; then
  python3 -c "from pkv.kernels.loader import ops; ops(); print('kernels built')" 2>&1 | tail -30 || exit 1; lap build
fi
if has graph; then
  timeout 240 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_graph.py 2>&1 | tee "$out/graph_tests.log" | tail -25
  grep -q " failed" "$out/graph_tests.log" && { echo "graph tests failed: stopping"; exit 1; }; lap graph-tests
fi
if has sweep; then
  timeout ${SWEEP_S:-240} python3 -m pkv.bench.kernels --quick --reps 15 --out "$out/quick.parquet" \
    --engines "${SWEEP_ENGINES:-pkv-graph,pkv-graph[min_tiles=8],pkv-graph[ctas_per_sm=1],pkv-workqueue[splits=16],pkv-workqueue[splits=32],flashinfer,flashinfer-tc,flashinfer-persistent}" \
    2>&1 | tee "$out/sweep.log" | grep -v "^  " | tail -60; lap sweep
fi
if has full; then
  timeout ${SWEEP_S:-420} python3 -m pkv.bench.kernels --out "$out/sweep.parquet" \
    --engines "${FULL_ENGINES:-pkv-graph,pkv-graph[min_tiles=2],pkv-workqueue[splits=16],pkv-workqueue[splits=32],flashinfer,flashinfer-tc,flashinfer-persistent}" \
    2>&1 | tee "$out/sweep_full.log" | grep -v "^  " | grep -v flashinfer.jit | tail -30
  lap full-sweep
fi
if has ncu; then
  timeout 150 ncu --clock-control none --profile-from-start off --csv --nvtx \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,launch__occupancy_limit_shared_mem \
    python3 scripts/v4_diag.py > "$out/ncu.csv" 2> "$out/ncu.err"
  echo "ncu rc $?"; grep -c '"' "$out/ncu.csv"; tail -3 "$out/ncu.err"; lap ncu
fi
if has v3; then
  timeout 200 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_kernels.py tests/gpu/test_launch_metadata.py 2>&1 | tail -15
  lap v3-tests
fi
