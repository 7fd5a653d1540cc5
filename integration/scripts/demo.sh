#!/usr/bin/env bash
# `make demo`: a first look at gpush on its embedded default (SQLite in the user's
# data directory, the local admin token in the config directory). Re-runnable: the
# example jobs carry idempotency keys, so a second run finds the same jobs.
set -euo pipefail
GPUSH=${1:-gpush}
cd "$(dirname "$0")/../.."
say() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
run() { say "$*"; "$@"; }

run "$GPUSH" whoami
run "$GPUSH" submit -f examples/train-mig.yaml
run "$GPUSH" submit -f examples/train-exclusive.yaml
run "$GPUSH" submit -f examples/inference-elastic.yaml
run "$GPUSH" submit -f examples/batch-sweep.yaml
run "$GPUSH" submit --kind training --gpus 2 --time-limit 1h --idempotency-key demo-flags -- python train.py --lr 3e-4
run "$GPUSH" list --limit 10
id=$("$GPUSH" submit --kind batch --gpus 1 --idempotency-key demo-cancel -- sleep 600)
run "$GPUSH" cancel "$id"
run "$GPUSH" events "$id"
say "$GPUSH status $id --json | head -5"; "$GPUSH" status "$id" --json | head -5
say "invalid jobs are refused, naming the field (exit 2):"
set +e
"$GPUSH" submit --kind inference --isolation none --gpus 1 -- serve
echo "exit status: $?"
set -e
printf '\nThe database is %s; `gpush server` serves the same queue over HTTP.\n' \
    "$("$GPUSH" db current --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["database"])')"
