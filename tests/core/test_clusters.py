"""The cluster registry: a bad config is refused before it is stored, and a stored
cluster whose adapter cannot be built is unhealthy, saying why, without stopping the
others (the scheduling cycle, GET /v1/clusters)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from broker.core.adapter import Unreachable
from broker.core.clusters import AdapterPool, ClusterInfo, add_cluster, list_clusters
from broker.core.errors import InvalidRequest
from broker.core.models import Cluster, Job
from broker.core.schemas import JobSpec
from broker.intake import queue
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from tests.scheduling.test_cycle import ADMIN

ROOT = Path(__file__).resolve().parents[2]
FLEET = (ROOT / "examples" / "fleet.yaml").read_text()
DEFAULT_POLICY = (ROOT / "policies" / "default.yaml").read_text()

# Configs no adapter can be built from, and a word the error must name.
BAD = [
    ({"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": "fast"}, "speed"),
    ({"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": 0}, "speed"),
    ({"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": -2}, "speed"),
    ({"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": True}, "speed"),
    ({"fleet": "/nonexistent/fleet.yaml"}, "fleet"),
    ({"fleet_yaml": FLEET, "cluster": "slurm-a", "colour": "blue"}, "colour"),
]


def insert_row(sessions, clock, name: str, config: dict, kind: str = "sim") -> None:
    """A cluster row stored as an older broker (or a hand edit) may have left it."""
    with sessions() as session, session.begin():
        session.add(
            Cluster(
                name=name,
                kind=kind,
                config=config,
                enabled=True,
                created_by="root",
                created_at=clock(),
                updated_at=clock(),
            )
        )


@pytest.mark.parametrize(("config", "word"), BAD)
def test_a_bad_config_is_refused_and_not_stored(sessions, clock, config, word):
    with sessions() as session, session.begin():
        with pytest.raises(InvalidRequest, match=word):
            add_cluster(session, name="sim-x", kind="sim", config=config, actor="root", now=clock())
    with sessions() as session:
        assert session.get(Cluster, "sim-x") is None


def test_a_good_speed_is_accepted(sessions, clock):
    with sessions() as session, session.begin():
        add_cluster(
            session,
            name="sim-x",
            kind="sim",
            config={"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": "2.5"},
            actor="r",
            now=clock(),
        )
    with sessions() as session:
        (info,) = list_clusters(session)
    assert (info.name, info.config["speed"]) == ("sim-x", "2.5")
    # The speed is applied: the cluster's virtual time runs 2.5 times the wall clock's.
    virtual = AdapterPool(clock)._clock_for(info)
    start = virtual()
    clock.advance(10)
    assert (virtual() - start).total_seconds() == 25


def test_the_api_refuses_a_bad_config_and_stores_nothing(http):
    admin = http(role="admin")
    response = admin.post(
        "/v1/clusters",
        json={"name": "sim-x", "kind": "sim", "config": {"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": "fast"}},
    )
    # 422 with code "invalid": how the API answers every request it refuses as invalid.
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid"
    assert "speed" in response.json()["error"]["message"]
    listed = admin.get("/v1/clusters")
    assert listed.status_code == 200
    assert listed.json() == []


@pytest.mark.parametrize(("config", "word"), [*BAD, ({"fleet_yaml": FLEET, "cluster": "slurm-a"}, "kind")])
def test_an_adapter_that_cannot_be_built_is_an_adapter_error(clock, config, word):
    kind = "nomad" if word == "kind" else "sim"
    info = ClusterInfo("bad", kind, config, True, "root", clock())
    pool = AdapterPool(clock)
    with pytest.raises(Unreachable, match=word) as raised:
        pool.get(info)
    assert "bad" in str(raised.value)
    # Asked again (the next cycle), it says the same, without a traceback of its own.
    with pytest.raises(Unreachable, match=word):
        pool.get(info)


def test_list_clusters_answers_with_the_broken_one_unhealthy(http, sessions, clock):
    admin = http(role="admin")
    assert (
        admin.post("/v1/clusters", json={"name": "slurm-a", "kind": "sim", "config": {"fleet_yaml": FLEET}}).status_code
        == 201
    )
    insert_row(sessions, clock, "broken", {"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": "fast"})
    response = http(user="alice").get("/v1/clusters")
    assert response.status_code == 200, response.text
    by_name = {c["name"]: c for c in response.json()}
    assert by_name["slurm-a"]["health"]["ok"] is True
    assert by_name["slurm-a"]["gpu_total"] > 0
    assert by_name["broken"]["health"]["ok"] is False
    assert "speed" in by_name["broken"]["health"]["detail"]
    assert by_name["broken"]["gpu_total"] == 0


def test_the_cycle_places_on_the_other_clusters_and_reports_the_broken_one(engine, sessions, clock):
    pool = AdapterPool(clock)
    with sessions() as session, session.begin():
        for name in ("slurm-a", "k8s-a"):
            add_cluster(session, name=name, kind="sim", config={"fleet_yaml": FLEET}, actor="root", now=clock())
    insert_row(sessions, clock, "broken", {"fleet_yaml": FLEET, "cluster": "slurm-a", "speed": "fast"})
    with sessions() as session, session.begin():
        policystore.apply(
            session,
            DEFAULT_POLICY,
            comment="t",
            author="root",
            now=clock(),
            views=cluster_views(session, pool),
            base_version=None,
        )
        spec = JobSpec.model_validate(
            {"command": ["x"], "tenant": "ml", "user": "alice", "kind": "training", "gpus": 1}
        )
        (result,) = queue.submit_jobs(session, [spec], ADMIN, now=clock())
    report = Scheduler(engine, pool, clock=clock).run_cycle()
    assert report.placed == 1
    assert any("broken" in e and "speed" in e for e in report.errors), report.errors
    with sessions() as session:
        placed = session.execute(select(Job.cluster).where(Job.id == result.job["id"])).scalar_one()
    assert placed == "slurm-a"  # training on whole GPUs (policies/default.yaml), the broken one aside
