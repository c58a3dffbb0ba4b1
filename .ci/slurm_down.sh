#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by .ci/slurm_up.sh (slurmd, slurmctld, munged).
# Jobs still queued or running are killed. Packages, slurm.conf and the logs stay in place.
# Set SLURM_CI_PURGE_STATE=1 to also remove the saved controller state (job queue, job ids).
set -euo pipefail

proc_alive() {  # pid; a zombie (exited, not yet reaped by PID 1) counts as gone
    [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1)" != Z ]
}

stop_pidfile() {  # pidfile name
    local pidfile=$1 name=$2 pid
    [ -f "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if proc_alive "$pid"; then
        kill "$pid"
        for _ in $(seq 100); do proc_alive "$pid" || break; sleep 0.1; done
        if proc_alive "$pid"; then
            echo "slurm_down: $name ($pid) did not stop on SIGTERM: SIGKILL" >&2
            kill -9 "$pid" 2>/dev/null || true
        fi
    fi
    rm -f "$pidfile"
}

if command -v scancel >/dev/null && scontrol ping >/dev/null 2>&1; then
    # Cancel every job and give them KillWait (5 s) + a margin to end, so no slurmstepd is left over.
    scancel --quiet "--user=$(id -un)" 2>/dev/null || true
    for _ in $(seq 30); do
        [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
        sleep 0.5
    done
fi
stop_pidfile /run/slurmd.pid slurmd
stop_pidfile /run/slurmctld.pid slurmctld
stop_pidfile /run/munge/munged.pid munged
if [ "${SLURM_CI_PURGE_STATE:-0}" = 1 ]; then
    rm -rf /var/spool/slurmctld/* /var/spool/slurmd/*
fi
echo "slurm_down: stopped"
