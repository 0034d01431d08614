# Sourced by the device scripts (scripts/gpu_*.sh): output folder, import path, the commit
# the tree was sent at, stage selection and lap times. Expects $stages set by the caller.
set -uo pipefail
out=${OUT:-gpu_out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ -f gpu_commit.txt ]] && export PKV_GIT_COMMIT=$(cat gpu_commit.txt)
has() { [[ ",$stages," == *",$1,"* ]]; }
T0=$(date +%s); lap() { echo "== $1: $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader
