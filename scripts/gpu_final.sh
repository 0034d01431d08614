#!/usr/bin/env bash
# The session's last device call (device time left: ~6 minutes): build, the GPU tests of
# the final tree, `pkv bench host` (issue 13) and the model step (issue 12), each bounded
# so a slow stage cannot starve the next. Outputs and logs under $OUT.
stages=all
source "$(dirname "$0")/device_env.sh"
python3 -c "from pkv.kernels.loader import ops; ops(); print('kernels built')" 2>&1 | tail -5 || exit 1; lap build
timeout ${TEST_S:-80} python3 -m pytest -x -q -p no:cacheprovider tests/gpu/test_graph.py tests/gpu/test_kernels.py \
  tests/gpu/test_launch_metadata.py 2>&1 | tee "$out/gpu_tests.log" | tail -8; lap gpu-tests
timeout ${HOST_S:-60} python3 -m pkv.cli bench host --config results/config.json \
  --constants results/calibration/constants.json --out "$out/host_path.parquet" --table "$out/host_path.md" \
  > "$out/host.log" 2>&1; echo "host rc $?"; tail -25 "$out/host_path.md" 2>/dev/null || tail -5 "$out/host.log"; lap host
timeout ${MODEL_S:-150} python3 -m pkv.measure.model_step --out "$out/model_step.parquet" --budget-s ${MODEL_BUDGET:-115} \
  ${MODEL_ARGS:-} > "$out/model_step.log" 2>&1; echo "model rc $?"; tail -12 "$out/model_step.log"; lap model-step
