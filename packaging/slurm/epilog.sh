#!/bin/bash
# Slurm Epilog for nodes that run packaging/slurm/timesliced.sbatch: nothing of a job's daemon outlives it.
#
# Install on every compute node, e.g. as /etc/slurm/epilog.d/timesliced.sh with
# `Epilog=/etc/slurm/epilog.d/*` in slurm.conf. What Slurm documents about an Epilog (slurm.conf(5) and
# the "Prolog and Epilog Guide"):
# - slurmd runs it as SlurmdUser (normally root) on every node of the allocation when the job ends,
#   with no search path set, hence PATH below; the node stays COMPLETING until it is done;
# - it sees SLURM_JOB_ID, SLURM_JOB_UID, SLURM_JOB_USER and SLURMD_NODENAME;
# - a non-zero exit drains the node, so it fails only when files it must remove stay.
#
# The batch script stops its daemons itself; this catches what a killed batch script could not: a
# daemon still running (its pid file is in the state dir; it gets SIGTERM, then SIGKILL after 10 s), the
# state dir $TIMESLICED_TMP/timesliced-$SLURM_JOB_ID and the simulated GPU memory
# $TIMESLICED_SHM/timesliced-$SLURM_JOB_ID-* (tmpfs files hold host memory until removed).
# Keep TIMESLICED_TMP and TIMESLICED_SHM as the batch script has them (defaults /tmp and /dev/shm).
set -euo pipefail
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
TIMESLICED_TMP="${TIMESLICED_TMP:-/tmp}"
TIMESLICED_SHM="${TIMESLICED_SHM:-/dev/shm}"

: "${SLURM_JOB_ID:?slurmd sets SLURM_JOB_ID for the prolog and the epilog}"
: "${SLURM_JOB_UID:?slurmd sets SLURM_JOB_UID for the prolog and the epilog}"
case "$SLURM_JOB_ID" in
"" | *[!0-9]*)
	echo "timesliced: unexpected SLURM_JOB_ID '$SLURM_JOB_ID'; nothing cleaned" >&2
	exit 0 # never drain a node over a job that is not ours to judge
	;;
esac

# --- timesliced_cleanup: the same in prolog.sh and epilog.sh (tests/packaging/test_slurm.py checks) ---
# Stops what is left of job $1's daemons (user id $2) on this node and removes their files.
timesliced_cleanup() {
	local job="$1" uid="$2" base pidfile pid
	base="$TIMESLICED_TMP/timesliced-$job"
	for pidfile in "$base"/*/daemon.pid; do
		[ -f "$pidfile" ] || continue
		pid="$(cat "$pidfile")"
		case "$pid" in '' | *[!0-9]*) continue ;; esac
		# Only a timesliced daemon of the job's user: the pid may belong to someone else by now.
		if [ ! -d "/proc/$pid" ] || [ "$(stat -c %u "/proc/$pid")" != "$uid" ]; then
			continue
		fi
		tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'timesliced.* serve ' || continue
		echo "timesliced: stopping the daemon $pid that job $job left running" >&2
		kill -TERM "$pid" 2>/dev/null || true # it saves its journal and removes its socket
		local tenths=0
		while timesliced_alive "$pid" && ((tenths < 100)); do
			sleep 0.1
			tenths=$((tenths + 1))
		done
		if timesliced_alive "$pid"; then
			kill -KILL "$pid" 2>/dev/null || true
		fi
	done
	# --one-file-system: never follow a mount someone placed inside the state dir.
	rm -rf --one-file-system "$base"
	rm -rf --one-file-system "$TIMESLICED_SHM/timesliced-$job-"*
}

# Whether process $1 exists and is not a zombie (a zombie has exited; only its parent's wait is missing).
timesliced_alive() {
	[ -r "/proc/$1/stat" ] || return 1
	local state
	state="$(sed 's/^.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)"
	[ -n "$state" ] && [ "$state" != Z ]
}
# --- end of timesliced_cleanup ---

timesliced_cleanup "$SLURM_JOB_ID" "$SLURM_JOB_UID"
