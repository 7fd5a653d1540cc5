#!/usr/bin/env bash
# `make demo`: a first look at gpush on its embedded default: SQLite in the user's data
# directory, the local admin token in the config directory, a local server with its
# scheduler that the first command starts in the background, and a simulated fleet
# (examples/fleet.yaml: a Slurm cluster with MIG, MPS and whole GPUs, a Kubernetes
# cluster with time-slicing, MIG and whole GPUs) whose jobs run in virtual time, 60x
# faster than the wall clock. Every command it runs is printed first, to copy.
# Re-runnable: clusters are re-registered, the policy is re-applied only if it changed,
# and each run submits its jobs again.
set -euo pipefail
GPUSH=${1:-gpush}
cd "$(dirname "$0")/../.."
say() { printf '\n\033[1m%s\033[0m\n' "$*"; }
show() { printf '\033[1m$ %s\033[0m\n' "gpush $*" >&2; }
run() { show "$@"; "$GPUSH" "$@"; }

say "Register the simulated clusters and apply the policy gpush ships (admins do this once):"
run whoami
run cluster add slurm-a --kind sim --fleet examples/fleet.yaml --speed 60 --replace
run cluster add k8s-a --kind sim --fleet examples/fleet.yaml --speed 60 --replace
run policy apply policies/default.yaml -m "demo: the policy gpush ships"

say "Submit a mixed workload (each submit prints the job's id):"
run submit -f examples/train-mig.yaml
run submit -f examples/train-exclusive.yaml
elastic=$(run submit -f examples/inference-elastic.yaml); echo "$elastic"
run submit -f examples/batch-sweep.yaml
run submit --name small-serve --kind inference --isolation process --gpu-memory-gb 2 --time-limit 10m \
    -- python serve.py --port 8000
tiny=$(run submit --name tiny-mig --kind training --isolation hardware --gpu-memory-gb 4 --time-limit 4m \
    -- python train.py --small); echo "$tiny"
held=$(run submit --name too-big --kind training --gpus 16 -- python huge.py); echo "$held"

say "The local server's scheduler places them at once; a few seconds later:"
sleep 3
run list
run status "$held"
run policy explain -f examples/train-mig.yaml
run scale "$elastic" 4
run list --kind inference
run tenant list

say "Short jobs finish in virtual time (60x); their output, and the finished ones:"
sleep 4
run logs "$tiny"
run list -A --state succeeded

say "The node agent on mig-01 (NVML replayed from a recording: GPU 1 re-cut to 2g.10gb slices that slurm-a does not know):"
run agent --once --node mig-01 --recording tests/data/nvml/mig01-repartitioned.json
run inventory --cluster slurm-a
run inventory drift --severity critical
run slurm gres-conf mig-01
say "The agent reports the layout slurm-a expects: the drift is gone"
run agent --once --node mig-01 --recording tests/data/nvml/mig01.json
run inventory drift --severity critical
run mig plan --cluster slurm-a --show summary

say "What the default policy does for a day's mixed workload, beside every job on whole GPUs (virtual time):"
report="${GPUSH_DEMO_REPORT:-$(python3 -c 'import tempfile; print(tempfile.gettempdir())')/gpush-demo-report}"
run simulate --fleet examples/fleet.yaml --workload examples/workload.yaml --report "$report"
echo "plots: $report/*.png"

say "Invalid jobs are refused, naming the field (exit 2):"
set +e
run submit --kind inference --isolation none --gpus 1 -- serve
echo "exit status: $?"
set -e
run server status

say "The web dashboard of this broker (queue, jobs, inventory down to each MIG slice, tenants, admin):"
run dashboard
printf '\nNext: open the sign-in link in a browser on this machine; put .venv/bin on your PATH and try\n'
printf 'the README'"'"'s "Using gpush" commands. `gpush server stop` stops the local server (the queue\n'
printf 'stays in the database).\n'
