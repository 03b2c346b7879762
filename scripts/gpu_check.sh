#!/usr/bin/env bash
# The GPU check in one command, sized to end within 9 minutes on an H100 or H200:
#
#   scripts/gpu_check.sh OUT_DIR [--budget SECONDS] [--steps KINDS] [--cpu-smoke] [--dry-run]
#
# Runs lipsformer.instruments.gpu_check (docs/performance.md, "The GPU check"): the environment, the eager benchmark of
# timm's Swin-T and ConvNeXt-T and both tiny LipsFormer models with a profile of each, the training of Swin-T and the
# LipsFormer models compiled in the default mode and with CUDA graphs, eager training with cuDNN's autotuning off, the q/k normalisation op against
# PyTorch's, the peak memory and tests/test_cuda.py, each step under its own time limit, skipping what would not fit
# in the budget (510 s by default); the driver ends itself 30 s after its budget should it hang. Both
# numbers are the driver's (DEFAULT_BUDGET_S, HARD_LIMIT_MARGIN_S; --help prints them). Writes OUT_DIR/gpu_check.md,
# gpu_check.json and gpu_check.log; a driver that ends before its first report (a bad option) leaves gpu_check.md with
# its status and error output instead, unless OUT_DIR holds an earlier run's report, which is left as it was.
# PYTHON names the interpreter (default: python3).
set -u

if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: $0 OUT_DIR [--budget SECONDS] [--steps KINDS] [--cpu-smoke] [--dry-run]" >&2
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

# The driver's error output is shown as it comes and kept, for a report of a driver that ends before writing one; the
# marker tells this run's report from an earlier run's.
errors=$(mktemp) || exit 2
marker=$(mktemp) || exit 2
trap 'rm -f "$errors" "$marker"' EXIT
{ "$python" -m lipsformer.instruments.gpu_check --out "$out_dir" "$@" 2>&1 1>&3 | tee "$errors" >&2; } 3>&1
status=${PIPESTATUS[0]}
report="$out_dir/gpu_check.md"
if [ "$status" -ne 0 ] && [ -s "$report" ] && [ "$report" -nt "$marker" ]; then
    if [ "$status" -eq 142 ]; then  # SIGALRM: the driver's own limit
        echo "gpu_check: the driver overran its budget and ended itself (status $status); this report holds the" \
            "steps that ended before." | tee -a "$report" >&2
    fi
elif [ "$status" -ne 0 ] && [ -e "$report" ]; then
    echo "gpu_check: the driver ended with status $status before writing its report; $report is an earlier" \
        "run's, left as it was." >&2
elif [ "$status" -ne 0 ]; then
    {
        echo "gpu_check: the driver ended with status $status before writing its report."
        if [ -s "$out_dir/gpu_check.log" ] && [ "$out_dir/gpu_check.log" -nt "$marker" ]; then
            echo "Its steps' output: $out_dir/gpu_check.log"
        fi
        echo "Its error output (the last 40 lines):"
        tail -n 40 "$errors"
    } > "$report"
fi
exit "$status"
