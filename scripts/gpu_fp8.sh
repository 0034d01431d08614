#!/usr/bin/env bash
# One device call for the FP8 KV work: build, FP8 and v4 GPU tests, the FP8 kernel rows
# against FlashInfer, the accuracy table's data, an Nsight Compute look at the FP8 kernel.
# Usage on the device (repo root, after `source .devsite/use-site`): scripts/gpu_fp8.sh [stages]
# stages: comma list of build,tests,graph,speed,acc,ncu (default build,tests,speed,acc).
stages=${1:-build,tests,speed,acc}
source "$(dirname "$0")/device_env.sh"
if has build; then
  python3 -c "from pkv.kernels.loader import ops; ops(); print('kernels built')" 2>&1 | tail -30 || exit 1; lap build
fi
if has tests; then
  timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8.py 2>&1 | tee "$out/fp8_tests.log" | tail -30
  lap fp8-tests
fi
if has graph; then
  timeout 200 python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_graph.py 2>&1 | tee "$out/graph_tests.log" | tail -8
  lap graph-tests
fi
if has speed; then
  timeout ${SPEED_S:-300} python3 -m pkv.bench.kernels --suites fp8 --reps ${REPS:-15} --out "$out/fp8_sweep.parquet" \
    --engines "${SPEED_ENGINES:-pkv-graph,flashinfer,flashinfer-tc}" 2>&1 | tee "$out/fp8_sweep.log" | grep -v flashinfer.jit | tail -70
  lap speed
fi
if has acc; then
  timeout ${ACC_S:-150} python3 -m pkv.cli bench fp8-accuracy --out "$out/fp8_accuracy.parquet" 2>&1 | tee "$out/fp8_accuracy.log" | tail -5
  lap accuracy
fi
if has ncu; then
  timeout 150 ncu --clock-control none --csv -k regex:graph_decode --launch-skip 4 --launch-count 6 \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed_pipe_tensor.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__average_warp_latency_issue_stalled_barrier,launch__registers_per_thread \
    python3 -m pkv.bench.kernels --suites fp8 --reps 2 --engines pkv-graph --out "$out/ncu_sweep.parquet" > "$out/ncu.csv" 2> "$out/ncu.err"
  echo "ncu rc $?"; tail -3 "$out/ncu.err"; lap ncu
fi
