#!/usr/bin/env bash
# Bring up a single-node SLURM cluster (Debian bookworm slurm-wlm 22.05 + munge) for CPU smoke tests.
# Runs as root on a fresh CI machine (no systemd as PID 1, no usable cgroups). Idempotent: a cluster
# already up with the same slurm.conf is left alone; otherwise the daemons are (re)started.
# Stop it with .ci/slurm_down.sh.
#
# Settings (environment): SLURM_CI_CPUS (CPUs the node advertises, default 4, may exceed the real
# count), SLURM_CI_TIMEOUT (seconds to wait for the node to come up idle, default 60).
set -euo pipefail

cpus=${SLURM_CI_CPUS:-4}
timeout=${SLURM_CI_TIMEOUT:-60}
node=$(hostname -s)
conf_dir=/etc/slurm
conf=$conf_dir/slurm.conf
log_dir=/var/log/slurm
ctld_log=$log_dir/slurmctld.log
slurmd_log=$log_dir/slurmd.log
munge_log=/var/log/munge/munged.log

if [ "$(id -u)" != 0 ]; then
    echo "slurm_up: must run as root" >&2
    exit 1
fi

# --- packages ---------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
    || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt_log=$(mktemp /tmp/slurm_up_apt.XXXXXX.log)
    apt_install() {
        apt-get install -y -qq --no-install-recommends -o Dpkg::Use-Pty=0 slurm-wlm munge >>"$apt_log" 2>&1
    }
    # Package lists may be missing or stale on a fresh machine: update once and retry.
    # (policy-rc.d/no systemd: the packages' postinst scripts do not start any daemon.)
    if ! apt_install; then
        if ! apt-get update -qq >>"$apt_log" 2>&1 || ! apt_install; then
            echo "slurm_up: apt-get install slurm-wlm munge failed; $apt_log:" >&2
            tail -n 30 "$apt_log" >&2
            exit 1
        fi
    fi
    rm -f "$apt_log"
fi

# --- name resolution: slurmctld and slurmd must resolve this host's short name ------------------
if ! getent hosts "$node" >/dev/null; then
    echo "127.0.0.1 $node" >>/etc/hosts
fi

# --- munge ------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
    # The Debian postinst normally creates the key; make one if it did not.
    if command -v mungekey >/dev/null; then
        runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    # A stale socket/pid from a killed munged makes a new one refuse to start: --force.
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do
        munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.1
    done
    if ! munge -n | unmunge >/dev/null; then
        echo "slurm_up: munged did not come up; $munge_log:" >&2
        tail -n 20 "$munge_log" >&2 || true
        exit 1
    fi
fi

# --- slurm.conf -------------------------------------------------------------------------------
install -d -m 0755 "$conf_dir" "$log_dir" /var/spool/slurmctld /var/spool/slurmd
new_conf=$(cat <<EOF
# Written by .ci/slurm_up.sh: single-node CPU-only cluster for CI smoke tests.
ClusterName=ci
SlurmctldHost=$node
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Step credential lifetime; it is also how long a requeued job waits before it may start again
# (default 120 s): kept short so requeue tests run quickly.
AuthInfo=cred_expire=10
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
# No cgroups in the CI container: plain /proc based process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Lets the node advertise more CPUs than it really has.
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$ctld_log
SlurmdLogFile=$slurmd_log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
SlurmdPort=6818
MinJobAge=10
JobRequeue=1
# A job that can never fit (e.g. more tasks than CPUs) is rejected at submit instead of pending forever.
EnforcePartLimits=ALL
KillWait=5
InactiveLimit=0
Waittime=0
# Run the scheduler every second, so a job whose BeginTime passed (a requeued one) starts promptly.
SchedulerParameters=sched_interval=1,bf_interval=1,batch_sched_delay=0,sched_min_interval=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
)
conf_changed=1
if [ -f "$conf" ] && [ "$(cat "$conf")" = "$new_conf" ]; then
    conf_changed=0
fi
printf '%s\n' "$new_conf" >"$conf"

node_up() {  # idle, or running jobs already (a re-run while jobs are in flight)
    sinfo -h -n "$node" -o '%T' 2>/dev/null | grep -Eqx 'idle|mixed|allocated|completing'
}

proc_alive() {  # pid; a zombie (exited, not yet reaped by PID 1) counts as gone
    [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1)" != Z ]
}

pid_alive() {  # pidfile
    [ -f "$1" ] && proc_alive "$(cat "$1")"
}

if [ "$conf_changed" = 0 ] && pid_alive /run/slurmctld.pid && pid_alive /run/slurmd.pid && node_up; then
    echo "slurm_up: cluster already up (node $node $(sinfo -h -n "$node" -o %T)); logs: $ctld_log $slurmd_log"
    exit 0
fi

# --- (re)start the daemons --------------------------------------------------------------------
for pidfile in /run/slurmd.pid /run/slurmctld.pid; do
    if pid_alive "$pidfile"; then
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 100); do proc_alive "$pid" || break; sleep 0.1; done
        proc_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
done

# Both daemonize themselves when started without -D.
slurmctld
for _ in $(seq 50); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
slurmd

deadline=$((SECONDS + timeout))
until node_up; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "slurm_up: node $node not up (idle) after ${timeout}s" >&2
        sinfo -N -l >&2 || true
        scontrol show node "$node" >&2 || true
        echo "--- $ctld_log (tail)" >&2; tail -n 30 "$ctld_log" >&2 || true
        echo "--- $slurmd_log (tail)" >&2; tail -n 30 "$slurmd_log" >&2 || true
        exit 1
    fi
    # A node left DOWN/DRAIN by an earlier run comes back with RESUME.
    if sinfo -h -n "$node" -o '%T' 2>/dev/null | grep -Eq 'down|drain'; then
        scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
    fi
    sleep 0.5
done
echo "slurm_up: node $node idle ($cpus CPUs, partition debug); conf: $conf; logs: $ctld_log $slurmd_log $munge_log"
