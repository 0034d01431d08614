#!/usr/bin/env bash
# One device call: build the kernels, run the GPU tests, run the kernel benchmark.
# Usage (from the repo root): scripts/gpu_check.sh [build|test|bench|all] [extra args for pkv bench splits]
# Logs and results go to $OUT (or ./gpu_check_out) as one tarball plus the bench table.
set -uo pipefail
stage=${1:-all}; shift || true
out=${OUT:-gpu_check_out}; mkdir -p "$out/logs"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# The device's copy of the tree may carry no git history: take the commit from a carried file.
[[ -f gpu_commit.txt ]] && export PKV_GIT_COMMIT=$(cat gpu_commit.txt)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"

t0=$(date +%s)
python3 -c "from pkv.kernels.loader import ops; ops(); print('kernels built')" 2>&1 | tee "$out/logs/build.log" || exit 1
echo "build: $(( $(date +%s) - t0 )) s"

if [[ $stage == test || $stage == all ]]; then
  t0=$(date +%s)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/test_csrc_compile.py 2>&1 | tee "$out/logs/tests.log" | tail -40
  echo "tests: $(( $(date +%s) - t0 )) s"
fi

if [[ $stage == bench || $stage == all ]]; then
  t0=$(date +%s)
  timeout 300 python3 -m pkv.cli bench splits "$@" 2>&1 | tee "$out/logs/bench.log"
  echo "bench: $(( $(date +%s) - t0 )) s"
  cp results/raw/kernels/v3-kernels.parquet results/tables/kernels-v3.md "$out/" 2>/dev/null
  cat results/tables/kernels-v3.md 2>/dev/null
fi
tar -czf "$out/logs.tgz" -C "$out" logs && rm -rf "$out/logs"
