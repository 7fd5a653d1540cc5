#!/usr/bin/env bash
# Make sure the PostgreSQL the integration tests use answers on 127.0.0.1:5432.
# Starts the machine's cluster if it is down; installs Debian's package if there is
# none. Exits non-zero (a failure, never a skip) when it cannot get one running.
set -euo pipefail
HOST=${GPUSH_PG_HOST:-127.0.0.1}
PORT=${GPUSH_PG_PORT:-5432}

ready() { pg_isready -q -h "$HOST" -p "$PORT" 2>/dev/null; }

if ready; then exit 0; fi
if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    echo "ensure-postgres: installing PostgreSQL from Debian's packages" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >/dev/null; }
fi
version=$(ls /etc/postgresql | sort -V | tail -n 1)
echo "ensure-postgres: starting PostgreSQL $version" >&2
pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
for _ in $(seq 1 60); do
    if ready; then exit 0; fi
    sleep 0.5
done
echo "ensure-postgres: PostgreSQL does not answer on $HOST:$PORT after 30 s" >&2
exit 1
