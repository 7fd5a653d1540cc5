#!/usr/bin/env bash
# Start gpush's single-machine Slurm test cluster in STATE, from nothing, and wait
# until it is usable. Three nodes, each its own slurmd on this host, with fake GPUs:
#
#   mig01  two A100-40GB in MIG mode: gpu:1g.5gb:7 (GPU 0) + gpu:3g.20gb:2 (GPU 1)
#   mps01  one A100 shared through MPS: gpu:a100:1 + mps:100
#   gpu01  two whole A100s: gpu:a100:2
#   gpu02  (with --whole-nodes=2) two more whole A100s, for multi-node jobs
#   nvl01  (with --topology) four H100s in two NVLink pairs, GPUs 0+2 and 1+3 (gres.conf
#          Links=; no Cores=, so that Slurm picks GPUs by Links= alone), two sockets
#
# Partitions: gpu (default, every node), mig, mps, exclusive (the whole-GPU nodes: gpu01,
# and gpu02 .. with --whole-nodes).
# Daemons: munged (own key and socket), slurmctld, three slurmd, slurmrestd (JWT)
# on 127.0.0.1 and a unix socket; with --accounting also slurmdbd on MariaDB. No
# systemd, no cgroups.
#
# Usage: start.sh STATE [--fresh] [--accounting] [--whole-nodes=N] [--topology=tree|block]
#   --fresh       forget the jobs and node state of an earlier run in STATE (job ids
#                 restart at 1; with --accounting the accounting database too);
#                 without it a restart keeps them, as a real cluster does.
#   --accounting  what a real site runs: slurmdbd storing into MariaDB (a database and
#                 user of its own, created here), AccountingStorageEnforce=associations,
#                 limits,qos and gres/gpu counted as a TRES, so that only users with an
#                 association may run jobs and account limits (GrpTRES=gres/gpu=N)
#                 hold. The cluster is registered; accounts and users are the
#                 caller's to add (sacctmgr). MariaDB must answer at GPUSH_MARIADB_HOST
#                 (127.0.0.1):GPUSH_MARIADB_PORT (3306) to GPUSH_MARIADB_ADMIN (root,
#                 no password), which may create databases and users.
#   --whole-nodes=N  N nodes of two whole A100s (gpu01 .. gpuNN; default 1), in the
#                 gpu partition: a multi-node job of whole GPUs needs two. One by
#                 default, so that the suites' jobs that wait for, or preempt, the
#                 whole GPUs find them on gpu01 alone.
#   --topology=tree|block  the network in topology.conf, and the node nvl01: tree
#                 (TopologyPlugin=topology/tree): switch leaf1 over the whole-GPU nodes
#                 and nvl01, leaf2 over mig01 and mps01, spine over both; block (24.11
#                 on, topology/block): block b1 of the whole-GPU nodes and nvl01, b2 of
#                 mig01 and mps01.
# Ports (TCP, 127.0.0.1): GPUSH_SLURMCTLD_PORT (6817), GPUSH_SLURMD_PORT (6821; the
# nodes take it, +1, +2, and one more per extra whole-GPU node), GPUSH_SLURMRESTD_PORT (6820). A second cluster on the
# same machine needs another STATE and other ports.
# GPUSH_SLURM_START_TIMEOUT (30): seconds to wait for the nodes and slurmrestd.
# GPUSH_SLURMDBD_PORT (6819): slurmdbd's port with --accounting.
#
# Everything (config, keys, sockets, pid files, logs, spool, fake /dev) lives under
# STATE; /etc is not touched. On success it writes STATE/env.sh; on failure it exits
# non-zero with the tail of the logs and leaves no daemon behind.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
started=$(date +%s%N)

usage() { echo "usage: $0 STATE [--fresh] [--accounting] [--whole-nodes=N] [--topology=tree|block]" >&2; exit 2; }
STATE="" FRESH=0 ACCOUNTING=0 WHOLE_NODES=1 TOPOLOGY=""
for arg in "$@"; do
    case $arg in
        --fresh) FRESH=1 ;;
        --accounting) ACCOUNTING=1 ;;
        --whole-nodes=[1-9]) WHOLE_NODES=${arg#--whole-nodes=} ;;
        --topology=tree | --topology=block) TOPOLOGY=${arg#--topology=} ;;
        -*) usage ;;
        *) [ -z "$STATE" ] || usage; STATE=$arg ;;
    esac
done
[ -n "$STATE" ] || usage
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)

die() { echo "start.sh: $*" >&2; exit 1; }

CTLD_PORT=${GPUSH_SLURMCTLD_PORT:-6817}
NODE_PORT=${GPUSH_SLURMD_PORT:-6821}
REST_PORT=${GPUSH_SLURMRESTD_PORT:-6820}
DBD_PORT=${GPUSH_SLURMDBD_PORT:-6819}
WHOLE=()
for ((i = 1; i <= WHOLE_NODES; i++)); do WHOLE+=("gpu$(printf %02d "$i")"); done
NODES=(mig01 mps01 "${WHOLE[@]}")
NVLINK=()
[ -z "$TOPOLOGY" ] || NVLINK=(nvl01)
NODES+=("${NVLINK[@]}")
ETC=$STATE/etc RUN=$STATE/run LOG=$STATE/log DEV=$STATE/dev
CONF=$ETC/slurm.conf
MUNGE_SOCKET=$STATE/munge/munge.socket.2
REST_SOCKET=$RUN/restd/slurmrestd.sock

command -v slurmctld >/dev/null || die "Slurm is not installed: run integration/slurm/install.sh"
# slurm.conf takes paths unquoted
[[ $STATE != *[[:space:]]* ]] || die "STATE must not contain white space: '$STATE'"
# A unix socket path longer than sun_path (108 bytes) cannot be bound.
((${#REST_SOCKET} < 100)) || die "STATE path too long for a unix socket: $REST_SOCKET"

# --- Slurm version: Debian 12 ships 22.05, Debian 13 ships 24.11. The differences
# that matter here are handled below, each where it applies.
SLURM_VERSION=$(slurmctld -V | awk '{print $2}')             # e.g. 22.05.8
IFS=. read -r v_major v_minor _ <<<"$SLURM_VERSION"
VERSION_NUM=$((10#$v_major * 100 + 10#$v_minor))             # 22.05 -> 2205, 24.11 -> 2411


# Where Debian puts the plugins (/usr/lib/<triplet>/slurm-wlm); needed to pick the
# slurmrestd plugins that this build really has.
PLUGIN_DIR=""
for d in /usr/lib/*/slurm-wlm /usr/lib64/slurm /usr/lib/slurm; do
    [ -e "$d/auth_munge.so" ] && { PLUGIN_DIR=$d; break; }
done
[ -n "$PLUGIN_DIR" ] || die "no Slurm plugin directory found (auth_munge.so)"
newest_plugin_version() { # glob-prefix -> newest "v0.0.NN" among PLUGIN_DIR/<prefix>v0_0_NN.so
    local f best=""
    for f in "$PLUGIN_DIR/$1"v0_0_*.so; do
        [ -e "$f" ] || continue
        f=${f##*/"$1"}; f=${f%.so}; f=${f//_/.}
        [ -z "$best" ] || [ "${f##*.}" -gt "${best##*.}" ] && best=$f
    done
    echo "$best"
}
# slurmrestd loads every OpenAPI plugin it finds unless told otherwise, and the
# slurmdbd ones (openapi/dbv0.0.3x in 22.05, openapi/slurmdbd later) are fatal
# without slurmdbd in 22.05 ("slurm not configured with slurmdbd"). So name the
# plugin for slurmctld's endpoints explicitly:
#   22.05: one plugin per API version, openapi/v0.0.36..38; the newest is the API.
#   23.11+ (24.11 on Debian 13): a single openapi/slurmctld, with the API versions
#          provided by the data_parser plugins (24.11: v0.0.40, v0.0.41, v0.0.42).
if [ -e "$PLUGIN_DIR/openapi_slurmctld.so" ]; then
    REST_PLUGINS=openapi/slurmctld
    REST_API=$(newest_plugin_version data_parser_)
else
    REST_API=$(newest_plugin_version openapi_)
    REST_PLUGINS=openapi/$REST_API
fi
[ -n "$REST_API" ] || die "Slurm $SLURM_VERSION: no OpenAPI plugin in $PLUGIN_DIR (is slurmrestd installed?)"

# slurmrestd refuses to run as root, as SlurmUser (root here) or with their groups.
# The packages create the user "slurm"; nobody will do where they did not.
REST_USER=${GPUSH_SLURMRESTD_USER:-slurm}
id -u "$REST_USER" >/dev/null 2>&1 || REST_USER=nobody
REST_GROUP=$(id -gn "$REST_USER")

# --- stop what an earlier run in this STATE left running; forget it if --fresh
"$HERE/stop.sh" "$STATE" >/dev/null
rm -f "$STATE/env.sh"
((FRESH)) && rm -rf "$STATE/ctld" "$STATE/spool" "$STATE/jobcomp.txt" "$LOG"

# Another process on one of our ports would make a daemon exit after a while with a
# less obvious message; say it up front.
port_taken() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
PORTS=("$CTLD_PORT" "$REST_PORT")
for ((i = 0; i < ${#NODES[@]}; i++)); do PORTS+=($((NODE_PORT + i))); done
((ACCOUNTING)) && PORTS+=("$DBD_PORT")
for port in "${PORTS[@]}"; do
    ! port_taken "$port" ||
        die "port $port on 127.0.0.1 is already in use; choose others with GPUSH_SLURMCTLD_PORT, GPUSH_SLURMD_PORT, GPUSH_SLURMRESTD_PORT, GPUSH_SLURMDBD_PORT"
done

mkdir -p "$ETC" "$RUN/restd" "$LOG" "$DEV" "$STATE/ctld" "$STATE/spool" "$STATE/munge"
# slurmrestd runs unprivileged: it reads slurm.conf, talks to munged through its
# socket and creates its own socket in run/restd.
chmod 755 "$STATE" "$ETC" "$RUN" "$LOG" "$STATE/munge"
chmod 700 "$STATE/ctld"
chown "$REST_USER:$REST_GROUP" "$RUN/restd"

# --- fake GPU device files. With AutoDetect=off and no cgroups, Slurm only checks
# that each File= exists and takes the number at the end of its name as the device
# index. Character devices like the real ones where mknod is allowed, plain files
# where it is not (unprivileged containers).
devfile() { [ -e "$1" ] || mknod -m 666 "$1" c "$2" "$3" 2>/dev/null || touch "$1"; }
for n in "${NODES[@]}"; do mkdir -p "$DEV/$n"; devfile "$DEV/$n/nvidiactl" 195 255; done
devfile "$DEV/mig01/nvidia0" 195 0
devfile "$DEV/mig01/nvidia1" 195 1
devfile "$DEV/mps01/nvidia0" 195 0
for n in "${WHOLE[@]}"; do devfile "$DEV/$n/nvidia0" 195 0; devfile "$DEV/$n/nvidia1" 195 1; done
for n in "${NVLINK[@]}"; do for i in 0 1 2 3; do devfile "$DEV/$n/nvidia$i" 195 "$i"; done; done
# A MIG instance is reached through its access capability file, one File= per
# instance. The driver numbers them (mig-minors) as 3 + 135 * gpu + 9 * instance.
# A layout an A100-40GB really accepts: GPU 0 as seven 1g.5gb (GPU instances 7..13),
# GPU 1 as two 3g.20gb (GPU instances 1 and 2).
mkdir -p "$DEV/mig01/nvidia-caps"
mig_caps() { # gpu instance... -> comma-separated cap files, created on the way
    local gpu=$1 gi minor files=""
    shift
    for gi in "$@"; do
        minor=$((3 + 135 * gpu + 9 * gi))
        devfile "$DEV/mig01/nvidia-caps/nvidia-cap$minor" 237 "$minor"
        files+="${files:+,}$DEV/mig01/nvidia-caps/nvidia-cap$minor"
    done
    echo "$files"
}
MIG_1G_5GB=$(mig_caps 0 7 8 9 10 11 12 13)
MIG_3G_20GB=$(mig_caps 1 1 2)

# --- keys: munge's, so that no system munged is needed or disturbed, and the HS256
# key with which slurmctld signs and checks the JWTs of `scontrol token`.
if [ ! -s "$STATE/munge/munge.key" ]; then
    dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 400 "$STATE/munge/munge.key"
fi
if [ ! -s "$ETC/jwt_hs256.key" ]; then
    dd if=/dev/urandom of="$ETC/jwt_hs256.key" bs=32 count=1 status=none
    chmod 600 "$ETC/jwt_hs256.key"
fi

# --- configuration
node_line() { # name slurmd-port-offset gres [cpu layout]
    echo "NodeName=$1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((NODE_PORT + $2))" \
        "${4:-CPUs=16} RealMemory=64000 Gres=$3 State=UNKNOWN"
}
# --- accounting (--accounting): slurmdbd and its MariaDB database, one per cluster
# port so that several test clusters can share the server. The database user's
# password is made here and kept in slurmdbd.conf (0600), as on a real site.
ACCOUNTING_CONF=""
if ((ACCOUNTING)); then
    command -v slurmdbd >/dev/null || die "slurmdbd is not installed: run integration/slurm/install.sh"
    command -v mariadb >/dev/null || die "the mariadb client is not installed: run integration/slurm/install.sh"
    DB_NAME=gpush_slurm_acct_$CTLD_PORT DB_USER=gpush_slurm_$CTLD_PORT
    DB_HOST=${GPUSH_MARIADB_HOST:-127.0.0.1} DB_PORT=${GPUSH_MARIADB_PORT:-3306}
    sql() { timeout 20 mariadb -u "${GPUSH_MARIADB_ADMIN:-root}" -h "$DB_HOST" -P "$DB_PORT" --batch -e "$1"; }
    sql "SELECT 1" >/dev/null ||
        die "MariaDB does not answer at $DB_HOST:$DB_PORT as ${GPUSH_MARIADB_ADMIN:-root}: start it (start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd) or set GPUSH_MARIADB_HOST/PORT/ADMIN"
    [ -s "$ETC/slurmdbd.pass" ] || { head -c 18 /dev/urandom | base64 | tr -d '/+=' >"$ETC/slurmdbd.pass"; chmod 600 "$ETC/slurmdbd.pass"; }
    DB_PASS=$(<"$ETC/slurmdbd.pass")
    ((FRESH)) && sql "DROP DATABASE IF EXISTS $DB_NAME"
    sql "CREATE DATABASE IF NOT EXISTS $DB_NAME;
         CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
         CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
         ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
         ALTER USER '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
         GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
         GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'127.0.0.1';" ||
        die "could not create database $DB_NAME and user $DB_USER in MariaDB"
    # slurmdbd reads slurmdbd.conf beside slurm.conf (SLURM_CONF's directory), and
    # refuses one that others may read: it holds the database password.
    cat >"$ETC/slurmdbd.conf" <<EOF
# Written by integration/slurm/start.sh for Slurm $SLURM_VERSION; rewritten at each start.
AuthType=auth/munge
# the cluster's own munged, not the system's: sacctmgr and slurmctld use this socket
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$RUN/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=$DB_HOST
StoragePort=$DB_PORT
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=$DB_NAME
EOF
    chmod 600 "$ETC/slurmdbd.conf"
    ACCOUNTING_CONF="# --accounting: jobs are recorded by slurmdbd, and only users with an association
# (sacctmgr add user NAME account=ACCOUNT) may run them; account and QOS limits hold.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# The munge socket for slurmdbd connections is not AuthInfo's but this one: without it
# slurmctld and sacctmgr look for the system's munged and retry for ever.
AccountingStoragePass=$MUNGE_SOCKET
AccountingStorageEnforce=associations,limits,qos
AccountingStorageTRES=gres/gpu,gres/mps
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30"
fi

# --- the network (--topology): topology.conf beside slurm.conf, which names the plugin
TOPOLOGY_CONF=""
rm -f "$ETC/topology.conf"
if [ -n "$TOPOLOGY" ]; then
    GROUP1=$(IFS=,; echo "${WHOLE[*]},${NVLINK[*]}")
    if [ "$TOPOLOGY" = tree ]; then
        printf '%s\n' "# Written by integration/slurm/start.sh (--topology=tree)." \
            "SwitchName=leaf1 Nodes=$GROUP1" "SwitchName=leaf2 Nodes=mig01,mps01" \
            "SwitchName=spine Switches=leaf1,leaf2" >"$ETC/topology.conf"
    else
        ((VERSION_NUM >= 2411)) || die "--topology=block needs Slurm 24.11 or later (this is $SLURM_VERSION)"
        printf '%s\n' "# Written by integration/slurm/start.sh (--topology=block)." \
            "BlockName=b1 Nodes=$GROUP1" "BlockName=b2 Nodes=mig01,mps01" "BlockSizes=2" >"$ETC/topology.conf"
    fi
    TOPOLOGY_CONF="TopologyPlugin=topology/$TOPOLOGY"
fi

# Options whose default is "none" (accounting storage, job accounting, switch, task
# and MPI plugins) are left out on purpose: newer Slurm builds dropped several
# */none plugin files, and the defaults mean the same in every version.
cat >"$CONF" <<EOF
# Written by integration/slurm/start.sh for Slurm $SLURM_VERSION; rewritten at each start.
ClusterName=gpush
# the short host name, as slurmctld compares it with gethostname()
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=$CTLD_PORT
# root, so that the daemons need no other user; slurmrestd runs as $REST_USER
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
AuthAltTypes=auth/jwt
AuthAltParameters=jwt_key=$ETC/jwt_hs256.key
StateSaveLocation=$STATE/ctld
# several slurmd on one host: %n (the node name) keeps their files apart
SlurmdSpoolDir=$STATE/spool/%n
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
# no cgroups: job processes are tracked through /proc
ProctrackType=proctrack/linuxproc
# no slurmdbd, so no sacct: finished jobs are written to a text file and stay
# visible in squeue for MinJobAge seconds
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE/jobcomp.txt
MinJobAge=300
# slurmctld's background loop wakes once a second; with batch_sched_delay=0 each
# wake-up starts new batch jobs, so a job runs 0-1 s after sbatch.
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0,sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job without --mem would otherwise take the whole node's memory
DefMemPerCPU=1000
# the nodes are declared bigger than this machine: trust slurm.conf
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=30
MessageTimeout=10
KillWait=2
InactiveLimit=0
GresTypes=gpu,mps
$ACCOUNTING_CONF
$(node_line mig01 0 gpu:1g.5gb:7,gpu:3g.20gb:2)
$(node_line mps01 1 gpu:a100:1,mps:100)
$(for ((i = 0; i < WHOLE_NODES; i++)); do node_line "${WHOLE[i]}" $((2 + i)) gpu:a100:2; done)
$(for n in "${NVLINK[@]}"; do node_line "$n" $((2 + WHOLE_NODES)) gpu:h100:4 "Sockets=2 CoresPerSocket=8 ThreadsPerCore=1"; done)
$TOPOLOGY_CONF
PartitionName=gpu Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=INFINITE State=UP
PartitionName=mig Nodes=mig01 MaxTime=INFINITE State=UP
PartitionName=mps Nodes=mps01 MaxTime=INFINITE State=UP
PartitionName=exclusive Nodes=$(IFS=,; echo "${WHOLE[*]}") MaxTime=INFINITE State=UP
EOF

cat >"$ETC/gres.conf" <<EOF
# Written by integration/slurm/start.sh: fake device files, nothing is probed.
AutoDetect=off
NodeName=mig01 Name=gpu Type=1g.5gb File=$MIG_1G_5GB
NodeName=mig01 Name=gpu Type=3g.20gb File=$MIG_3G_20GB
NodeName=mps01 Name=gpu Type=a100 File=$DEV/mps01/nvidia0
NodeName=mps01 Name=mps Count=100 File=$DEV/mps01/nvidia0
$(for n in "${WHOLE[@]}"; do echo "NodeName=$n Name=gpu Type=a100 File=$DEV/$n/nvidia0,$DEV/$n/nvidia1"; done)
$(for n in "${NVLINK[@]}"; do
    # one line per GPU: Links= counts the NVLinks to each GPU of the node (-1: itself)
    echo "NodeName=$n Name=gpu Type=h100 File=$DEV/$n/nvidia0 Links=-1,0,2,0"
    echo "NodeName=$n Name=gpu Type=h100 File=$DEV/$n/nvidia1 Links=0,-1,0,2"
    echo "NodeName=$n Name=gpu Type=h100 File=$DEV/$n/nvidia2 Links=2,0,-1,0"
    echo "NodeName=$n Name=gpu Type=h100 File=$DEV/$n/nvidia3 Links=0,2,0,-1"
done)
EOF

# No cgroup-based plugin is configured, but slurmd of 24.x initialises the cgroup
# plugin anyway and fails where it cannot use cgroups (containers, no delegation):
# "disabled" turns that off. 22.05 does not know "disabled" and never reads the file
# with this slurm.conf, so it gets the neutral default.
if ((VERSION_NUM >= 2405)); then CGROUP_PLUGIN=disabled; else CGROUP_PLUGIN=autodetect; fi
cat >"$ETC/cgroup.conf" <<EOF
# Written by integration/slurm/start.sh for Slurm $SLURM_VERSION.
CgroupPlugin=$CGROUP_PLUGIN
EOF

# slurmrestd, unprivileged, must reach slurm.conf and the munge socket: a STATE under
# a private directory (pytest's 0700 basetemp, say) makes it retry for a minute and
# die. Say so now.
setpriv --reuid="$REST_USER" --regid="$REST_GROUP" --init-groups test -r "$CONF" ||
    die "user $REST_USER (slurmrestd's) cannot read $CONF: every directory above $STATE must be searchable by others"

# --- from here on, a failure prints the logs and stops whatever did start, so that
# nothing is left half-running.
gone() { # pidfile -> true if the daemon wrote its pid and has exited since
    local pid
    [ -s "$1" ] || return 1
    pid=$(<"$1")
    # an exited daemon can stay a zombie for a while when PID 1 reaps late
    [ ! -r "/proc/$pid/status" ] || grep -q '^State:[[:space:]]*Z' "/proc/$pid/status"
}
give_up() {
    echo "start.sh: $1" >&2
    sinfo -N -o '%N %t %E' >&2 2>/dev/null || true
    for f in "$LOG"/*.log; do
        echo "--- tail of $f" >&2
        tail -n 15 "$f" >&2
    done
    "$HERE/stop.sh" "$STATE" >&2
    exit 1
}

# --- daemons. munged, slurmctld and slurmd daemonize and write their pid files.
export SLURM_CONF=$CONF
# --force: start even if munged dislikes the permissions of a parent directory
munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE/munge/munge.key" \
    --pid-file="$RUN/munged.pid" --log-file="$LOG/munged.log" --seed-file="$STATE/munge/munged.seed" ||
    give_up "munged did not start"
if ((ACCOUNTING)); then
    slurmdbd || give_up "slurmdbd did not start"
    # sacctmgr waits for ever on a slurmdbd that does not answer: bound each call.
    sacctmgr_() { timeout 15 sacctmgr -i "$@"; }
    deadline=$(($(date +%s) + ${GPUSH_SLURM_START_TIMEOUT:-30}))
    until sacctmgr_ -n list cluster format=cluster >/dev/null 2>&1; do
        ! gone "$RUN/slurmdbd.pid" || give_up "slurmdbd exited"
        (($(date +%s) <= deadline)) || give_up "slurmdbd does not answer sacctmgr"
        sleep 0.2
    done
    # slurmctld registers itself only with a cluster the database knows.
    sacctmgr_ -n list cluster format=cluster | grep -qw gpush ||
        sacctmgr_ add cluster gpush >/dev/null || give_up "sacctmgr add cluster gpush failed"
fi
# a configuration error makes these exit before they daemonize
slurmctld -f "$CONF" || give_up "slurmctld did not start"
for n in "${NODES[@]}"; do
    mkdir -p "$STATE/spool/$n"
    slurmd -N "$n" -f "$CONF" || give_up "slurmd -N $n did not start"
done
# slurmrestd stays in the foreground: run it in a session of its own, unprivileged.
# SLURM_JWT=daemon makes it pass each client's token on to slurmctld (auth/jwt).
rm -f "$REST_SOCKET"
SLURM_JWT=daemon setsid setpriv --reuid="$REST_USER" --regid="$REST_GROUP" --init-groups \
    slurmrestd -f "$CONF" -a rest_auth/jwt -s "$REST_PLUGINS" \
    "unix:$REST_SOCKET" "127.0.0.1:$REST_PORT" </dev/null >>"$LOG/slurmrestd.log" 2>&1 &
echo $! >"$RUN/slurmrestd.pid"

# --- wait until every node is idle and slurmrestd answers; give up at once if a
# daemon died.
nodes_idle() { [ "$(sinfo -h -N -p gpu -o '%t' 2>/dev/null | grep -cxE 'idle|mix|alloc')" = "${#NODES[@]}" ]; }
rest_answers() { # any HTTP status will do: it proves slurmrestd accepts and parses requests
    [ "$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --unix-socket "$REST_SOCKET" \
        "http://localhost/slurm/$REST_API/ping" 2>/dev/null)" != 000 ]
}
timeout_s=${GPUSH_SLURM_START_TIMEOUT:-30}
deadline=$(($(date +%s) + timeout_s))
until nodes_idle && rest_answers; do
    for daemon in munged slurmctld "${NODES[@]/#/slurmd-}" slurmrestd; do
        ! gone "$RUN/$daemon.pid" || give_up "$daemon exited"
    done
    (($(date +%s) <= deadline)) || give_up "cluster not up after ${timeout_s}s (GPUSH_SLURM_START_TIMEOUT)"
    sleep 0.1
done

{
    echo "# Written by integration/slurm/start.sh: source it to use this cluster."
    printf 'export %s=%q\n' \
        GPUSH_SLURM_STATE "$STATE" \
        SLURM_CONF "$CONF" \
        SLURMRESTD_URL "http://127.0.0.1:$REST_PORT" \
        SLURMRESTD_SOCKET "$REST_SOCKET" \
        GPUSH_SLURM_VERSION "$SLURM_VERSION" \
        GPUSH_SLURMRESTD_API "$REST_API" \
        GPUSH_SLURM_LOG_DIR "$LOG" \
        GPUSH_SLURM_JOBCOMP "$STATE/jobcomp.txt" \
        GPUSH_SLURM_DEV_DIR "$DEV" \
        GPUSH_SLURMCTLD_PORT "$CTLD_PORT" \
        GPUSH_SLURMD_PORT "$NODE_PORT" \
        GPUSH_SLURMRESTD_PORT "$REST_PORT" \
        GPUSH_SLURM_ACCOUNTING "$ACCOUNTING" \
        GPUSH_SLURMDBD_PORT "$DBD_PORT"
} >"$STATE/env.sh"

sinfo -N -o '%N %P %t %G' | sort -u
echo "Slurm $SLURM_VERSION test cluster up in $((($(date +%s%N) - started) / 1000000)) ms;" \
    "REST API $REST_API on http://127.0.0.1:$REST_PORT; source $STATE/env.sh"
