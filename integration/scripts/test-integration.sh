#!/usr/bin/env bash
# make test-integration: the integration suite in three passes.
#
#   1. The Slurm tests (marked `slurm`: integration/conftest.py) in one process, since their
#      test clusters take fixed ports; beside them
#   2. the other tests, on two pytest-xdist workers (its default --dist load: tests/dist.py).
#      On a 2-core machine shared with other test runs (load 4 to 6) they took 6 to 10
#      minutes in three runs, against 11 in one process, using under one core on average;
#   3. then the tests that change the machine under every other one (`alone`: they restart
#      PostgreSQL, fill a disk), in a pass of their own, once both others have passed.
#
# The Slurm pass writes its report to a file, shown once the other pass is done, so that
# the two reports do not mix. Ctrl-C stops both passes (each stops its own clusters and
# servers).
#
# Usage: integration/scripts/test-integration.sh PYTHON   (the Makefile sets GPUSH_CI=1)
set -u
python=${1:?usage: test-integration.sh PYTHON}
pytest=("$python" -m pytest integration -q)

log=$(mktemp --tmpdir gpush-slurm-tests.XXXXXX)
trap 'rm -f "$log"' EXIT

# A command a script runs in the background ignores Ctrl-C unless it undoes that: this one
# must get it, to stop its Slurm test clusters.
(
    trap - INT
    exec "${pytest[@]}" -m "slurm and not alone" --durations=15
) >"$log" 2>&1 &
slurm=$!
echo "test-integration.sh: the Slurm tests run in one process beside these (their report: $log)"

"${pytest[@]}" -n 2 -m "not slurm and not alone" --durations=15
rest=$?

if kill -0 "$slurm" 2>/dev/null; then
    echo "test-integration.sh: waiting for the Slurm tests (tail -f $log)"
fi
wait "$slurm"
slurm_status=$?
echo "==== the Slurm tests (one process) ===="
cat "$log"
rm -f "$log"

if [ "$rest" -ne 0 ] || [ "$slurm_status" -ne 0 ]; then
    echo "test-integration.sh: failed (the other tests: exit $rest; the Slurm tests: exit $slurm_status)" >&2
    exit 1
fi
exec "${pytest[@]}" -m alone
