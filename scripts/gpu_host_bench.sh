#!/usr/bin/env bash
# Issue 13 on the GPU (from the repo root, in the environment scripts/gpu_v4.sh uses):
#   OUT=<dir> scripts/gpu_host_bench.sh [test] [host] [serve] | all      (all: ~8-10 min; split it in two calls)
#   test : build the kernels, run the v3 GPU tests (the engine split, pinned staging, validation switch on CUDA)
#   host : pkv bench host on the committed config/constants -> $OUT/host_path.{parquet,md}
#   serve: fresh calibration with the lean adapters and the fitted C_min/lambda, every serving
#          point on one held-out seed, then the router regret table, its accuracy figure and
#          the serving table -> $OUT/run/{calibration,raw,tables,figures}
# Nothing under results/ is written. Logs: $OUT/logs.tgz.
set -uo pipefail
stages=("$@"); [[ ${#stages[@]} -eq 0 || ${stages[0]} == all ]] && stages=(test host serve)
out=${OUT:-gpu_host_out}; mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ -f gpu_commit.txt ]] && export PKV_GIT_COMMIT=$(cat gpu_commit.txt)
seed=${SEED:-20260623}
config=${CONFIG:-results/config.json}; constants=${CONSTANTS:-results/calibration/constants.json}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
python3 -c "import torch, flashinfer; print('torch', torch.__version__, torch.version.cuda, 'flashinfer', flashinfer.__version__)"
t0=$(date +%s)
python3 -c "from pkv.kernels.loader import ops; ops(); print('kernels built')" 2>&1 | tee "$out/logs/build.log" | tail -3
echo "build: $(( $(date +%s) - t0 )) s"

for stage in "${stages[@]}"; do
  t0=$(date +%s)
  case $stage in
    test)
      timeout ${TEST_S:-300} python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_kernels.py \
        tests/gpu/test_launch_metadata.py 2>&1 | tee "$out/logs/tests.log" | tail -15 ;;
    host)
      timeout 240 python3 -m pkv.cli bench host --config "$config" \
        --constants "$constants" --out "$out/host_path.parquet" --table "$out/host_path.md" \
        2>&1 | tee "$out/logs/host.log" | tail -40
      cat "$out/host_path.md" ;;
    serve)
      run=$out/run; mkdir -p "$run/raw/serve"; cp "$config" "$run/config.json"
      timeout 200 python3 -m pkv.cli calibrate --config "$run/config.json" --out "$run/calibration/constants.json" \
        --raw "$run/raw/calibrate/calibration.parquet" > "$out/logs/calibrate.log" 2>&1 || { tail -20 "$out/logs/calibrate.log"; continue; }
      python3 -c "import json; d = json.load(open('$run/calibration/constants.json')); print({k: d[k] for k in ('c_min', 'launch_overhead_s', 'launch_measured_s', 'baseline_ctas_per_head', 'host_s')})"
      python3 - "$run/config.json" <<'PY' | while read -r fam b; do
import json, sys
for p in json.load(open(sys.argv[1]))["serving"]:
    print(p["family"], p["max_active"])
PY
        timeout 60 python3 -m pkv.cli measure serve --config "$run/config.json" --constants "$run/calibration/constants.json" \
          --family "$fam" --max-active "$b" --seed "$seed" --engine-set main \
          --out "$run/raw/serve/$fam-b$b-s$seed-main.parquet" > "$out/logs/serve-$fam-b$b.log" 2>&1 \
          && echo "served $fam B$b" || { echo "FAILED $fam B$b"; tail -5 "$out/logs/serve-$fam-b$b.log"; }
      done
      python3 -m pkv.cli report-router --target "$run/tables/router_regret.md" && cat "$run/tables/router_regret.md"
      python3 -m pkv.cli report-router --target "$run/figures/router_accuracy.png"
      python3 -m pkv.cli report --target "$run/tables/serving.md" > "$out/logs/report.log" 2>&1 && cat "$run/tables/serving.md" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  echo "$stage: $(( $(date +%s) - t0 )) s"
done
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
