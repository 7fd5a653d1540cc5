"""`gpush scale`: an elastic job's replicas change within its range and its tenant's quota."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.core.adapter import Scaler
from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.placement import tenants
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler

ROOT = Path(__file__).resolve().parents[2]
FLEET = (ROOT / "examples" / "fleet.yaml").read_text()
POLICY = (ROOT / "policies" / "default.yaml").read_text()
ELASTIC = {
    "kind": "inference",
    "isolation": "none",
    "gpu_memory_gb": 2,
    "elastic": {"min_replicas": 1, "max_replicas": 4},
    "command": ["serve"],
}


class Scalable:
    """A cluster whose adapter scales jobs (as the Kubernetes adapter does), around a simulated one."""

    capabilities = frozenset({Scaler})

    def __init__(self, inner, refuse: bool = False):
        self.inner, self.refuse, self.calls = inner, refuse, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def scale(self, job_id: int, replicas: int) -> None:
        from broker.core.adapter import Rejected

        if self.refuse:
            raise Rejected("the Deployment is gone")
        self.calls.append((job_id, replicas))


@pytest.fixture
def running(app, engine, sessions, clock, sdk):
    """An elastic inference job placed on k8s-a (1 replica), and the API's k8s-a adapter that scales."""
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": FLEET}, actor="root", now=clock())
        views = cluster_views(session, pool)
        policystore.apply(session, POLICY, comment="t", author="root", now=clock(), views=views, base_version=None)
    client = sdk(user="alice", tenant="ml")
    job = client.submit(ELASTIC)
    Scheduler(engine, pool, clock=clock).run_cycle()
    job = client.get(job.id)
    assert (job.state.value, job.cluster) == ("submitted", "k8s-a")
    with sessions() as session:
        (info,) = [c for c in list_clusters(session) if c.name == "k8s-a"]
    scalable = Scalable(app.state.adapters.get(info))
    app.state.adapters.override("k8s-a", scalable)
    return client, job, scalable


def test_a_running_elastic_job_scales_within_its_range(running):
    client, job, scalable = running
    one = job.gpu_equivalents
    scaled = client.scale(job.id, 3)
    assert scalable.calls == [(job.id, 3)]
    assert scaled.placement["replicas"] == 3 and scaled.gpu_equivalents == pytest.approx(3 * one)
    assert "scaled from 1 to 3 replicas by alice" in [e.reason for e in client.events(job.id)]
    client.scale(job.id, 1)
    assert client.get(job.id).gpu_equivalents == pytest.approx(one)


def test_outside_the_range_or_not_elastic_is_refused(running, sdk):
    client, job, _ = running
    from broker.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="between 1 and 4 replicas"):
        client.scale(job.id, 5)
    plain = client.submit({"kind": "training", "gpus": 1, "command": ["train"]})
    with pytest.raises(InvalidRequest, match="not elastic"):
        client.scale(plain.id, 2)


def test_a_queued_job_cannot_scale_yet(running):
    client, _, _ = running
    from broker.core.errors import Conflict

    queued = client.submit({**ELASTIC, "name": "later"})
    with pytest.raises(Conflict, match="queued: a job scales once a cluster holds it"):
        client.scale(queued.id, 2)


def test_growing_past_the_tenants_quota_is_refused_and_changes_nothing(running, sessions, clock):
    client, job, scalable = running
    with sessions() as session, session.begin():
        tenants.set_tenant(
            session, "ml", weight=None, gpu_quota=job.gpu_equivalents * 2, clear_quota=False, now=clock()
        )
    from broker.core.errors import Conflict

    with pytest.raises(Conflict, match="tenant ml at quota"):
        client.scale(job.id, 4)
    assert scalable.calls == [] and client.get(job.id).placement["replicas"] == 1
    client.scale(job.id, 2)  # exactly at the quota is allowed
    assert scalable.calls == [(job.id, 2)]


def test_a_cluster_that_refuses_leaves_the_job_as_it_was(running, app):
    client, job, scalable = running
    scalable.refuse = True
    from broker.core.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="refused to scale"):
        client.scale(job.id, 2)
    assert client.get(job.id).placement["replicas"] == 1


def test_gpush_scale_at_the_command_line_needs_a_cluster_that_can(gpush):
    result = gpush("scale", "999", "2")
    assert result.code == 3 and "no job 999" in result.err
