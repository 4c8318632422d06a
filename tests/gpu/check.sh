#!/usr/bin/env bash
# The GPU check (tests/gpu/README.md): every stage runs in check.py, which prints one JSON object
# last, with "ok" per stage and overall. Arguments go to check.py (e.g. --gib 2 --backends offload).
# Needs python3 only (no `python`, no `pip` on PATH, no virtualenv); the check installs what it lacks
# into tests/gpu/.deps. Ends within --deadline (270 s; $TIMESLICED_GPU_CHECK_DEADLINE), every
# process it started stopped. Exit status: 0 all good, 1 a check failed, 2 no usable GPU (seconds).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2

python="${PYTHON:-}"
if [ -z "$python" ]; then
    for candidate in python3 python; do
        if command -v "$candidate" >/dev/null 2>&1; then
            python="$candidate"
            break
        fi
    done
fi
fail() {
    # $1: the error, as JSON string content (no quotes or backslashes in it)
    printf '{"ok": false, "stage": "preflight", "error": "%s", "stages": {"preflight": {"ok": false, "error": "%s"}}}\n' "$1" "$1"
    exit 2
}
[ -n "$python" ] || fail "no python3 on PATH: install Python 3.10 or newer (or set PYTHON=/path/to/python3)"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null ||
    fail "$("$python" -V 2>&1 | tr -d '"\\') found; the check needs Python 3.10 or newer (set PYTHON=/path/to/python3)"

export CUDA_DEVICE_ORDER="${CUDA_DEVICE_ORDER:-PCI_BUS_ID}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# check.py ends itself by its deadline (a watchdog stops everything and prints the JSON); `timeout`
# is the backstop should even that fail, 20 s later. It passes SIGTERM, SIGINT and SIGHUP on to
# check.py; --foreground keeps check.py in this terminal's process group, so Ctrl-C reaches it.
deadline="${TIMESLICED_GPU_CHECK_DEADLINE:-270}"
previous=""
for arg in "$@"; do
    case "$previous" in --deadline) deadline="$arg" ;; esac
    case "$arg" in --deadline=*) deadline="${arg#--deadline=}" ;; esac
    previous="$arg"
done
case "${deadline%%.*}" in '' | *[!0-9]*) deadline=270 ;; esac
# (GNU coreutils' timeout; a timeout without these options, e.g. busybox's, is not used.)
if timeout --foreground --kill-after=5 5 true >/dev/null 2>&1; then
    exec timeout --foreground --kill-after=5 "$(( ${deadline%%.*} + 20 ))" "$python" tests/gpu/check.py "$@"
fi
exec "$python" tests/gpu/check.py "$@"
