#!/usr/bin/env bash
# A newer Slurm for the test cluster: Debian's packages of another release (trixie:
# Slurm 24.11; sid: the newest Debian carries) in a chroot made with debootstrap from
# the mirror this machine's apt uses, so that start.sh runs the same three-node cluster
# on that Slurm beside the host's 22.05.
#
# Usage: chroot.sh build SUITE      make (or reuse) the chroot; prints its ROOT
#        chroot.sh mount ROOT       mount /proc, /dev, /sys and the host's /tmp in it
#        chroot.sh umount ROOT      undo that (only the one who mounted should: clusters of
#                                   another test run may be using the chroot)
#        chroot.sh users ROOT NAME...  give the chroot the host's users NAME (same uid/gid)
#
# ROOT is GPUSH_SLURM_CHROOTS (/var/cache/gpush/slurm-chroots)/SUITE. A chroot is built
# once (about 2 minutes and 300 MB: debootstrap --variant=minbase with Slurm's packages)
# and reused while its stamp names the same packages. The host's /tmp is bind-mounted at
# the same path, so that the cluster's STATE, its sockets and the tests' work
# directories are one path on both sides: the broker on the host reaches slurmrestd by
# port and runs the CLI as `chroot ROOT sbatch ...` (the Slurm adapter's command_prefix).
#
# A ROOT with anything mounted in it is never deleted: it would delete the host's /tmp.
set -euo pipefail

die() { echo "chroot.sh: $*" >&2; exit 1; }
usage() { sed -n '8,12p' "$0" >&2; exit 2; }

# Slurm's daemons, client and REST server, the JWT plugin, slurmdbd, munge (sid's
# packages no longer pull it in), and what start.sh uses: curl, setpriv (util-linux),
# hostname, and the mariadb client for --accounting.
PACKAGES=slurm-wlm,slurmrestd,slurm-wlm-jwt-plugin,slurmdbd,munge,curl,util-linux,hostname,mariadb-client
CHROOTS=${GPUSH_SLURM_CHROOTS:-/var/cache/gpush/slurm-chroots}

mirror() { # the Debian mirror the host's apt uses
    local uri
    uri=$(grep -hoE '^(deb|URIs:) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null |
        grep -oE 'https?://[^ ]+' | head -n 1) || true
    echo "${uri:-http://deb.debian.org/debian}"
}

mounted_under() { # ROOT -> the mount points at or below it
    awk -v root="$1" '$5 == root || index($5, root "/") == 1 {print $5}' /proc/self/mountinfo
}

build() {
    local suite=$1 root=$CHROOTS/$1 stamp want started
    stamp=$root/.gpush-stamp
    want="$suite $PACKAGES"
    if [ -s "$stamp" ] && [ "$(<"$stamp")" = "$want" ]; then
        echo "$root"
        return
    fi
    [ -z "$(mounted_under "$root")" ] || die "$root has mounts ($(mounted_under "$root" | tr '\n' ' ')): run chroot.sh umount $root first"
    command -v debootstrap >/dev/null || {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap >/dev/null ||
            { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; }
    } || die "could not install debootstrap"
    started=$(date +%s)
    mkdir -p "$CHROOTS"
    rm -rf --one-file-system "$root.tmp"
    echo "chroot.sh: building Slurm's $suite packages into $root (debootstrap, about 2 minutes)" >&2
    debootstrap --variant=minbase --include="$PACKAGES" "$suite" "$root.tmp" "$(mirror)" >"$CHROOTS/$suite.log" 2>&1 ||
        die "debootstrap $suite failed: $(tail -n 5 "$CHROOTS/$suite.log")"
    rm -rf --one-file-system "$root"
    mv "$root.tmp" "$root"
    echo "$want" >"$stamp"
    echo "chroot.sh: $suite built in $(($(date +%s) - started)) s: Slurm $(chroot "$root" slurmctld -V | awk '{print $2}')" >&2
    echo "$root"
}

mount_all() { # prints "mounted" if it mounted anything, "already mounted" if not
    local root=$1 dir did=""
    [ -x "$root/usr/sbin/slurmctld" ] || die "$root is not a Slurm chroot (chroot.sh build SUITE)"
    mountpoint -q "$root/proc" || { mount -t proc proc "$root/proc"; did=1; }
    for dir in /dev /sys /tmp; do
        mkdir -p "$root$dir"
        mountpoint -q "$root$dir" || { mount --bind "$dir" "$root$dir"; did=1; }
    done
    if [ -n "$did" ]; then echo mounted; else echo "already mounted"; fi
    # The chroot resolves this host's name as the host does (slurm.conf's SlurmctldHost).
    cp /etc/hosts "$root/etc/hosts"
}

umount_all() {
    local root=$1 dir
    for dir in tmp sys dev proc; do
        ! mountpoint -q "$root/$dir" || umount -l "$root/$dir"
    done
}

users() {
    local root=$1 name line
    shift
    for name in "$@"; do
        grep -q "^$name:" "$root/etc/passwd" && continue
        line=$(getent passwd "$name") || die "no user $name on this host"
        group=$(getent group "$(id -g "$name")")
        grep -q "^${group%%:*}:" "$root/etc/group" || echo "$group" >>"$root/etc/group"
        echo "$line" >>"$root/etc/passwd"
    done
}

[ $# -ge 2 ] || usage
case $1 in
    build) build "$2" ;;
    mount) mount_all "$2" ;;
    umount) umount_all "$2" ;;
    users) shift; users "$@" ;;
    *) usage ;;
esac
