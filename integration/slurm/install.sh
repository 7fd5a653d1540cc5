#!/usr/bin/env bash
# Install the Debian packages the single-machine Slurm test cluster runs on, and print
# the Slurm version they brought (Debian 12: 22.05, Debian 13: 24.11; start.sh adapts).
#
# Idempotent and fast: dpkg is asked first and nothing is touched when all is there.
# `apt-get update` runs only if an install from the current package lists fails (no
# lists yet, or lists so old that their files are gone from the mirror).
set -euo pipefail
started=$(date +%s%N)

# slurmctld, slurmd, the client commands and slurmrestd; munge for node authentication;
# slurmdbd (and the mariadb client, to create its database) for the accounting cluster.
# The auth/jwt and rest_auth/jwt plugins that slurmrestd needs are in
# slurm-wlm-jwt-plugin, not in slurmrestd itself. start.sh also uses curl (to see
# slurmrestd answer), setpriv (util-linux, to run slurmrestd unprivileged) and
# hostname -s.
PACKAGES=(slurmctld slurmd slurmdbd slurm-client slurmrestd slurm-wlm-jwt-plugin munge curl util-linux hostname mariadb-client)

missing=()
for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}\n' "$pkg" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$pkg")
done

install_missing() {
    # The packages' postinst scripts try to start the services; without systemd that
    # fails harmlessly and start.sh runs its own daemons anyway. policy-rc.d is not
    # used so that a machine that does run systemd keeps its usual behaviour.
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

if ((${#missing[@]})); then
    echo "slurm install: installing ${missing[*]}"
    if ! install_missing; then
        echo "slurm install: install from the current package lists failed; apt-get update and retry" >&2
        apt-get update -q >/dev/null
        install_missing
    fi
fi

version=$(dpkg-query -W -f='${Version}' slurmctld)
echo "slurm install: Slurm $(slurmctld -V | awk '{print $2}') (Debian package $version)," \
    "munge $(dpkg-query -W -f='${Version}' munge), took $((($(date +%s%N) - started) / 1000000)) ms"
