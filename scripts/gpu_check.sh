#!/usr/bin/env bash
# The GPU check in one command, sized to run within 10 minutes on an H100 or H200:
#
#   scripts/gpu_check.sh OUT_DIR [--budget SECONDS] [--cpu-smoke] [--dry-run]
#
# Runs lipsformer.gpu_check (docs/performance.md, "The GPU check"): the environment, the eager benchmark of timm's
# Swin-T and both tiny LipsFormer models with a profile of each, tests/test_cuda.py, the compiled runs and the peak
# memory, each step under its own time limit, skipping what would not fit in the budget (540 s by default). Writes
# OUT_DIR/gpu_check.md, gpu_check.json and gpu_check.log. PYTHON names the interpreter (default: python3).
set -u

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 OUT_DIR [--budget SECONDS] [--cpu-smoke] [--dry-run]" >&2
    exit 2
fi
out_dir=$1
shift
repo=$(cd "$(dirname "$0")/.." && pwd) || exit 2
python=${PYTHON:-python3}
mkdir -p "$out_dir" || { echo "gpu_check: cannot create $out_dir" >&2; exit 2; }
out_dir=$(cd "$out_dir" && pwd)
cd "$repo" || exit 2
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# Each step has its own limit inside the budget; this one only stops the driver itself if it hangs.
hard_limit_s=${GPU_CHECK_HARD_LIMIT_S:-590}
timeout -k 10 "$hard_limit_s" "$python" -m lipsformer.gpu_check --out "$out_dir" "$@"
status=$?
if [ "$status" -ne 0 ] && [ ! -s "$out_dir/gpu_check.md" ]; then
    echo "gpu_check: the driver ended with status $status before writing its report; see $out_dir/gpu_check.log" \
        | tee "$out_dir/gpu_check.md" >&2
fi
exit "$status"
