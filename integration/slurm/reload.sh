#!/usr/bin/env bash
# Make the test cluster in STATE read a rewritten slurm.conf and gres.conf, as a site
# would restart its daemons after gpush rewrote a node's MIG layout (the Slurm adapter's
# mig_reload). Slurm 22.05 takes a node's new GRES counts only when slurmctld restarts
# (scontrol reconfigure keeps the old ones), and slurmd reads gres.conf only when it
# starts; from 23.11, scontrol reconfigure restarts both itself.
#
# Usage: reload.sh STATE NODE...
#   restarts slurmctld and the slurmd of each NODE, and waits until slurmctld answers and
#   each NODE has registered again (GPUSH_SLURM_START_TIMEOUT, 30 s). Jobs keep running:
#   slurmctld keeps its state, slurmd its steps.
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 STATE NODE..." >&2; exit 2; }
STATE=$(cd "$1" && pwd)
shift
RUN=$STATE/run
export SLURM_CONF=$STATE/etc/slurm.conf
die() { echo "reload.sh: $*" >&2; exit 1; }

alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
stop_pid() { # pidfile: SIGTERM, up to 10 s, then SIGKILL
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    alive "$pid" || return 0
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 100); do alive "$pid" || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

stop_pid "$RUN/slurmctld.pid"
slurmctld -f "$SLURM_CONF" || die "slurmctld did not start again (see $STATE/log/slurmctld.log)"
for node in "$@"; do
    stop_pid "$RUN/slurmd-$node.pid"
    slurmd -N "$node" -f "$SLURM_CONF" || die "slurmd -N $node did not start again (see $STATE/log/slurmd-$node.log)"
done

registered() { # node: slurmctld answers for it and it responds (not UNKNOWN, DOWN or NOT_RESPONDING)
    local state
    state=$(scontrol -o show node "$1" 2>/dev/null | grep -o 'State=[^ ]*') || return 1
    [[ $state != *UNKNOWN* && $state != *DOWN* && $state != *NOT_RESPONDING* && $state != *'*'* ]]
}
deadline=$(($(date +%s) + ${GPUSH_SLURM_START_TIMEOUT:-30}))
for node in "$@"; do
    until registered "$node"; do
        (($(date +%s) <= deadline)) || die "$node has not registered with slurmctld again: $(scontrol -o show node "$node" 2>&1 | grep -o 'State=[^ ]*')"
        sleep 0.2
    done
done
