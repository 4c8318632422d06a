#!/usr/bin/env bash
# The GPU check: the quick pytest checks, then the measured run (tests/gpu/README.md).
# Arguments go to check.py (e.g. --gib 2 --rounds 5 --backends offload). Prints one JSON
# object last. Under 5 minutes on one H100/H200-class GPU; needs no network.
# Exit status: 0 all good, 1 a check failed, 2 no usable GPU (within seconds).
set -euo pipefail
cd "$(dirname "$0")/../.."

export TIMESLICED_GPU_TESTS=1
export CUDA_DEVICE_ORDER="${CUDA_DEVICE_ORDER:-PCI_BUS_ID}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"

if ! "$python" -c "import timesliced, pytest" 2>/dev/null; then
    echo '{"ok": false, "stage": "preflight", "error": "timesliced or pytest is not installed: pip install -e '"'"'.[cuda,test]'"'"' first"}'
    exit 2
fi

# 1. Quick checks (well under a minute); without a GPU every one is skipped, with the reason.
tests=0
# (the two-job runs are left to check.py, which does them in full)
timeout --kill-after=5 100 "$python" -m pytest tests/gpu -q -rs -m gpu -p no:cacheprovider -k "not two_jobs" || tests=$?

# 2. The measured run; its own deadline (185 s) keeps it inside this timeout.
check=0
timeout --kill-after=5 200 "$python" tests/gpu/check.py "$@" || check=$?

if [ "$check" -ne 0 ]; then
    exit "$check"
fi
if [ "$tests" -ne 0 ]; then
    echo "gpu check: the pytest checks failed (exit status $tests)" >&2
    exit 1
fi
