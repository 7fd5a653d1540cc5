"""Tenants' quotas reach the clusters that keep them on their side too (TenantQuotaKeeper):
the scheduling cycle hands them over every cycle, a cluster that fails to take them is
reported without stopping the cycle, and `GET /v1/clusters/{name}/tenant-quotas` (`gpush
tenant quota-yaml`) shows what a cluster renders. The simulated fleet stands in for the
clusters; integration/test_k8s_tenants.py does the same with Kubernetes' ResourceQuotas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from broker.core.adapter import Rejected, TenantQuotaKeeper, declared
from broker.core.clusters import list_clusters
from broker.core.errors import InvalidRequest, NotAllowed, NotFound
from broker.placement import tenants
from broker.scheduling.cycle import Scheduler
from tests.scheduling.test_cycle import job, submit

FLEET = (Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml").read_text()


class Rendered:
    def __init__(self, quotas: dict[str, float]):
        self.quotas = dict(quotas)

    def to_yaml(self) -> str:
        return "".join(f"# {tenant}: {quota:g}\n" for tenant, quota in sorted(self.quotas.items()))


class KeepsQuotas:
    """A simulated cluster that also keeps tenants' quotas: records what it is handed."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = inner.name
        self.capabilities = declared(inner) | {TenantQuotaKeeper}
        self.applied: list[dict[str, float]] = []
        self.refuse: str | None = None

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def tenant_quotas(self, quotas):
        return Rendered(quotas)

    def apply_tenant_quotas(self, plan: Rendered) -> list[str]:
        if self.refuse:
            raise Rejected(self.refuse)
        changed = not self.applied or self.applied[-1] != plan.quotas
        self.applied.append(plan.quotas)
        return [f"quotas {plan.quotas}"] if changed else []


@pytest.fixture
def keeper(fleet, sessions):
    """slurm-a and k8s-a of examples/fleet.yaml (the fleet fixture); k8s-a keeps tenants' quotas."""
    pool = fleet
    with sessions() as session:
        infos = {c.name: c for c in list_clusters(session)}
    kept = KeepsQuotas(pool.get(infos["k8s-a"]).adapter)
    pool.override("k8s-a", kept)
    return pool, kept


def set_quota(sessions, clock, tenant: str, quota: float | None) -> None:
    with sessions() as session, session.begin():
        tenants.set_tenant(session, tenant, weight=None, gpu_quota=quota, clear_quota=quota is None, now=clock())


def test_every_cycle_hands_the_tenants_quotas_to_the_clusters_that_keep_them(engine, sessions, clock, keeper):
    pool, kept = keeper
    set_quota(sessions, clock, "vision", 2.0)
    set_quota(sessions, clock, "nlp", None)  # a tenant without a quota is not named
    cycle = Scheduler(engine, pool, clock=clock)
    assert cycle.run_cycle().errors == []
    assert kept.applied == [{"vision": 2.0}]
    set_quota(sessions, clock, "nlp", 0.5)
    cycle.run_cycle()
    assert kept.applied[-1] == {"vision": 2.0, "nlp": 0.5}


def test_a_cluster_that_refuses_the_quotas_is_reported_and_the_cycle_goes_on(engine, sessions, clock, keeper):
    pool, kept = keeper
    set_quota(sessions, clock, "ml", 8.0)
    kept.refuse = "resourcequotas is forbidden"
    job_id = submit(sessions, clock, tenant="ml", kind="training", gpus=1)
    report = Scheduler(engine, pool, clock=clock).run_cycle()
    assert report.errors == ["tenant quotas on k8s-a: resourcequotas is forbidden"]
    assert job(sessions, job_id).state == "submitted"  # placed all the same


def test_the_route_shows_what_a_cluster_renders_to_admins_only(app, sdk, keeper):
    _pool, kept = keeper
    app.state.adapters.override("k8s-a", kept)
    admin = sdk(user="root", tenant="ops", role="admin")
    admin.set_tenant("vision", gpu_quota=1.5)
    assert admin.tenant_quotas("k8s-a") == {"cluster": "k8s-a", "rendered": "# vision: 1.5\n"}
    with pytest.raises(InvalidRequest, match="cluster slurm-a is a sim cluster: per-tenant quotas on the cluster"):
        admin.tenant_quotas("slurm-a")
    with pytest.raises(NotFound, match="no cluster nowhere"):
        admin.tenant_quotas("nowhere")
    with pytest.raises(NotAllowed):
        sdk(user="alice", tenant="vision").tenant_quotas("k8s-a")
