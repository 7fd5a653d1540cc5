"""The scheduling tests' fleet: examples/fleet.yaml's clusters, simulated, under the default policy."""

from __future__ import annotations

import pytest

from broker.core.clusters import AdapterPool, add_cluster
from tests.scheduling.test_cycle import DEFAULT_POLICY, FLEET, apply_policy


@pytest.fixture
def fleet(sessions, clock):
    """slurm-a and k8s-a of examples/fleet.yaml registered, the default policy active."""
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": FLEET}, actor="root", now=clock())
    apply_policy(sessions, pool, clock, DEFAULT_POLICY)
    return pool
