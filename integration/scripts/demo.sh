#!/usr/bin/env bash
# `make demo`: a first look at gpush on its embedded default: SQLite in the user's data
# directory, the local admin token in the config directory, and a simulated fleet
# (examples/fleet.yaml: a Slurm cluster with MIG, MPS and whole GPUs, a Kubernetes
# cluster with time-slicing, MIG and whole GPUs) whose jobs run in virtual time, 60x
# faster than the wall clock. Re-runnable: clusters are re-registered, the policy is
# re-applied only if it changed, and the example jobs carry idempotency keys.
set -euo pipefail
GPUSH=${1:-gpush}
cd "$(dirname "$0")/../.."
say() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }
run() { say "$*"; "$@"; }

run "$GPUSH" whoami
run "$GPUSH" cluster add slurm-a --kind sim --fleet examples/fleet.yaml --speed 60 --replace
run "$GPUSH" cluster add k8s-a --kind sim --fleet examples/fleet.yaml --speed 60 --replace
run "$GPUSH" cluster list
run "$GPUSH" policy apply policies/default.yaml -m "demo: the policy gpush ships"

say "a mixed workload"
"$GPUSH" submit -f examples/train-mig.yaml
"$GPUSH" submit -f examples/train-exclusive.yaml
"$GPUSH" submit -f examples/inference-elastic.yaml
"$GPUSH" submit -f examples/batch-sweep.yaml
"$GPUSH" submit --name small-serve --kind inference --isolation process --gpu-memory-gb 2 \
    --idempotency-key demo-mps -- python serve.py --port 8000
"$GPUSH" submit --name tiny-mig --kind training --isolation hardware --gpu-memory-gb 4 \
    --idempotency-key demo-tiny-mig -- python train.py --small
held=$("$GPUSH" submit --name too-big --kind training --gpus 16 --idempotency-key demo-too-big -- python huge.py)

run "$GPUSH" scheduler run --cycles 2 --interval 1
run "$GPUSH" list --limit 20
run "$GPUSH" status "$held"
run "$GPUSH" policy explain -f examples/train-mig.yaml
run "$GPUSH" tenant list
run "$GPUSH" cluster list
say "a few wall-clock seconds later, short jobs have finished in virtual time"
sleep 3
run "$GPUSH" scheduler run --cycles 1
run "$GPUSH" list --state succeeded --state running

say "the node agent on mig-01 (NVML replayed from a recording: GPU 1 re-cut to 2g.10gb slices that slurm-a does not know)"
run "$GPUSH" agent --once --node mig-01 --recording tests/data/nvml/mig01-repartitioned.json
run "$GPUSH" inventory --cluster slurm-a
run "$GPUSH" inventory drift --severity critical
run "$GPUSH" slurm gres-conf mig-01
say "the agent reports the layout slurm-a expects: the drift is gone"
run "$GPUSH" agent --once --node mig-01 --recording tests/data/nvml/mig01.json
run "$GPUSH" inventory drift --severity critical
run "$GPUSH" mig plan --cluster slurm-a --show summary

say "what the default policy does for a day's mixed workload, beside every job on whole GPUs (virtual time)"
report="${GPUSH_DEMO_REPORT:-$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/gpush-demo-report}"
run "$GPUSH" simulate --fleet examples/fleet.yaml --workload examples/workload.yaml --report "$report"
echo "plot: $report/allocation.png"

say "invalid jobs are refused, naming the field (exit 2):"
set +e
"$GPUSH" submit --kind inference --isolation none --gpus 1 -- serve
echo "exit status: $?"
set -e
printf '\nThe database is %s; `gpush server` serves the same queue over HTTP and runs the scheduler.\n' \
    "$("$GPUSH" db current --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["database"])')"
