#!/usr/bin/env bash
# Stop the Slurm test cluster that start.sh started in STATE.
#
# Usage: stop.sh STATE [--purge]
#   --purge  also delete STATE (config, keys, job state, logs)
#
# Running jobs are cancelled first, so that no job process outlives the cluster;
# pending jobs stay in the saved state for the next start without --fresh. Daemons
# are found through their pid files and signalled only if the pid still belongs to
# a process of that name, so a reused pid is never hit. Safe to run when nothing is
# running, or twice.
set -uo pipefail

usage() { echo "usage: $0 STATE [--purge]" >&2; exit 2; }
STATE="" PURGE=0
for arg in "$@"; do
    case $arg in
        --purge) PURGE=1 ;;
        -*) usage ;;
        *) [ -z "$STATE" ] || usage; STATE=$arg ;;
    esac
done
[ -n "$STATE" ] || usage
if [ ! -d "$STATE" ]; then
    echo "stop.sh: no cluster in $STATE"
    exit 0
fi
STATE=$(cd "$STATE" && pwd)
RUN=$STATE/run
CONF=$STATE/etc/slurm.conf

# Exists and is not a zombie: without a real init, an exited daemon may stay a
# zombie for a couple of seconds until PID 1 reaps it.
alive() { [ -r "/proc/$1/status" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
# Debian installs the daemons as <name>-wlm behind an alternatives link, so the
# process name is either.
named() { local comm; comm=$(cat "/proc/$1/comm" 2>/dev/null) && [[ $comm == "$2" || $comm == "$2-wlm" ]]; }
pid_in() { [ -s "$1" ] && cat "$1"; }

stop_daemon() { # name pidfile: SIGTERM, up to 10 s to exit, then SIGKILL
    local name=$1 file=$2 pid
    pid=$(pid_in "$file") || return 0
    if alive "$pid" && named "$pid" "$name"; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
        if alive "$pid"; then
            echo "stop.sh: $(basename "$file" .pid) ($pid) still running after 10 s, killing it"
            kill -KILL "$pid" 2>/dev/null
        fi
        echo "stopped $(basename "$file" .pid) ($pid)"
    fi
    rm -f "$file"
}

# 1. Cancel running jobs while slurmctld can still do it cleanly, and wait for them.
if ctld=$(pid_in "$RUN/slurmctld.pid") && alive "$ctld" && [ -r "$CONF" ]; then
    export SLURM_CONF=$CONF
    active=RUNNING,SUSPENDED,CONFIGURING,COMPLETING
    mapfile -t running < <(squeue -h -t RUNNING,SUSPENDED,CONFIGURING -o %i 2>/dev/null)
    if ((${#running[@]})); then
        scancel "${running[@]}" && echo "cancelled running jobs: ${running[*]}"
        for _ in $(seq 100); do
            [ -z "$(squeue -h -t "$active" -o %i 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
fi

# 2. slurmrestd first; slurmctld before the slurmds, so that it saves the nodes as
# they were; munged last, as the others authenticate through it until they exit.
stop_daemon slurmrestd "$RUN/slurmrestd.pid"
stop_daemon slurmctld "$RUN/slurmctld.pid"
for f in "$RUN"/slurmd-*.pid; do
    [ -e "$f" ] && stop_daemon slurmd "$f"
done
stop_daemon slurmdbd "$RUN/slurmdbd.pid"
stop_daemon munged "$RUN/munged.pid"

# 2b. A daemon its pid file does not name: Slurm 23.11+ restarts slurmctld and slurmd in a
# new process on `scontrol reconfigure` (gpush's MIG changes run it), and a stop that
# comes while the new one has not written its pid file yet would miss it. This cluster's
# daemons are the ones started with its slurm.conf (-f CONF).
for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    named "$pid" slurmctld || named "$pid" slurmd || named "$pid" slurmrestd || continue
    { tr '\0' '\n' <"$proc/cmdline"; } 2>/dev/null | grep -qxF "$CONF" || continue
    alive "$pid" || continue
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do alive "$pid" || break; sleep 0.1; done
    alive "$pid" && kill -KILL "$pid" 2>/dev/null
    echo "stopped $(cat "/proc/$pid/comm" 2>/dev/null || echo daemon) ($pid), which no pid file named"
done

# 3. A job step that survived anyway (its slurmd was killed, say). slurmstepd is a
# daemon of its own; this cluster's are the ones that inherited SLURM_CONF=$CONF from
# their slurmd. Kill each with everything it started, by pid.
descendants() { local child; for child in $(ps -o pid= --ppid "$1"); do descendants "$child"; done; echo "$1"; }
for proc in /proc/[0-9]*; do
    pid=${proc#/proc/}
    named "$pid" slurmstepd || continue
    { tr '\0' '\n' <"$proc/environ"; } 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" || continue
    # shellcheck disable=SC2046 # one pid per word
    kill -KILL $(descendants "$pid") 2>/dev/null && echo "killed leftover job step $pid and its processes"
done

rm -f "$STATE/env.sh"   # its presence means "started and not stopped since"
if ((PURGE)); then
    rm -rf "$STATE"
    echo "removed $STATE"
fi
exit 0
