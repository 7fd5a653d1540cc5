# gpush developer and CI entry points. `make test` works on a fresh machine:
# it creates the virtual environment, installs gpush with its test extras,
# starts PostgreSQL if it is down, and runs the fast and the integration suites.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# setuptools' build warns of every editable install in a block of asterisks that says
# nothing about gpush: kept out of a new user's first screen.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

.PHONY: help venv postgres test test-fast test-integration demo bench clean

help:
	@echo "make demo     first look: embedded broker (SQLite), example jobs, list"
	@echo "make test     everything CI runs: fast tests (SQLite) + integration (PostgreSQL)"
	@echo "make bench    submissions, scheduling at scale, placement quality, topology, Slurm (and gangs on it), Kubernetes, inventory, Ray, CLI"

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(QUIET_EDITABLE) $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

postgres:
	integration/scripts/ensure-postgres.sh

# Debian's Slurm packages for the single-machine test cluster (integration/slurm/);
# the tests start and stop the cluster themselves.
.PHONY: slurm
slurm:
	integration/slurm/install.sh

# GPUSH_CI=1: a test that skips fails unless it is marked may_skip (tests/skips.py), and the
# closing note counts the skips (0 here). A suite that collects nothing fails too (pytest's exit 5).
IN_CI  := GPUSH_CI=1
PYTEST := $(IN_CI) $(BIN)/python -m pytest

# Three workers on two cores: a third of the fast tests' time is waiting (real subprocesses,
# the scheduler's cycle intervals), which a third worker fills. On this 2-core machine:
# 188 s with -n 2, 174 s with -n 3 (the same 2,263 tests, nothing else running).
test-fast: venv
	$(PYTEST) tests -q -n 3 --durations=10

# Debian's chromium for the dashboard's browser tests (Playwright drives it).
.PHONY: browser
browser:
	integration/scripts/ensure-chromium.sh

# The Slurm tests (integration/conftest.py: `slurm`; their test clusters' ports are fixed) in
# one process, the other tests beside them on two workers, then the tests that change the
# machine (`alone`) in a pass of their own: integration/scripts/test-integration.sh.
test-integration: venv postgres slurm browser
	$(IN_CI) integration/scripts/test-integration.sh $(BIN)/python

test: test-fast test-integration

# The Kubernetes contract suite alone (it also runs in test-integration): against the test API
# server, or with GPUSH_K8S_CONTRACT=1 against the cluster KUBECONFIG names, so an admin can
# compare the two: GPUSH_K8S_CONTRACT=1 KUBECONFIG=~/.kube/config make k8s-contract
.PHONY: k8s-contract
k8s-contract: venv
	$(PYTEST) integration/k8s_contract -q

# The demo installs gpush alone (no Ray, no test tools), showing pip's progress.
DEMO_STAMP := $(VENV)/.installed-demo

$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing gpush into $(VENV) (first time only)..."
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(QUIET_EDITABLE) $(BIN)/python -m pip install --progress-bar on -e .
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@integration/scripts/demo.sh $(BIN)/gpush

bench: venv postgres slurm browser
	$(BIN)/python integration/bench/submit.py --json bench-results.json
	$(BIN)/python integration/bench/schedule.py --million --json bench-schedule.json
	$(BIN)/python integration/bench/placement.py --json bench-placement.json
	$(BIN)/python integration/bench/topology.py --json bench-topology.json
	$(BIN)/python integration/bench/slurm.py --jobs 1000 --rounds 3 --json bench-slurm.json
	$(BIN)/python integration/bench/gangs_slurm.py --json bench-gangs-slurm.json
	$(BIN)/python integration/bench/k8s.py --rounds 3 --json bench-k8s.json
	$(BIN)/python integration/bench/inventory.py --json bench-inventory.json
	$(BIN)/python integration/bench/ray.py --json bench-ray.json
	$(BIN)/python integration/bench/cli.py --json bench-cli.json
	$(BIN)/python integration/bench/dashboard.py --json bench-dashboard.json
	$(BIN)/python integration/bench/dashboard.py --postgres --json bench-dashboard-pg.json

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache bench-results.json
