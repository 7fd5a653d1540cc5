"""Hostile names at the HTTP edge (issue 32): a NUL, a control character or a name
longer than its database column, in a query filter, a path or a body, of every route
that takes a name. Each is a 4xx naming the field, never a 500 (PostgreSQL refuses NUL
in text and truncation of a varchar) and never a 503 that a client would retry for
ever; nothing of a refused request is stored.

``CASES`` is the one list: integration/test_postgres_hostile.py runs these tests on
PostgreSQL by importing them, so the two databases cannot be tested on different cases.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from broker.api.limits import MAX_LABEL_FILTERS
from broker.core.models import ApiToken, Cluster, PolicyVersion, Tenant

NUL = "\x00"
LONG = "t" * 5000
TRAIN = {"kind": "training", "command": ["true"]}
POLICY = "rules: []\n"
FLEET = (Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml").read_text()


@dataclass(frozen=True)
class Hostile:
    """One request with a hostile name, and the field its refusal must name."""

    method: str
    path: str
    field: str
    params: Any = None
    json: Any = None
    statuses: tuple[int, ...] = (422,)


def _query(path: str, name: str, value: Any) -> Hostile:
    return Hostile("GET", path, name, params={name: value})


CASES: dict[str, Hostile] = {
    # -- query filters ----------------------------------------------------------------
    **{
        f"jobs-{name}-{what}": _query(path, name, value)
        for path in ("/v1/jobs", "/v1/jobs:count")
        for name in ("user", "tenant", "cluster")
        for what, value in (("nul", NUL), ("long", LONG), ("control", "a\x1bb"))
        if not (path == "/v1/jobs:count" and what == "control")
    },
    "jobs-label-key-nul": Hostile("GET", "/v1/jobs", "label", params={"label": f"{NUL}=v"}),
    "jobs-label-value-nul": Hostile("GET", "/v1/jobs", "label", params={"label": f"k={NUL}"}),
    "jobs-label-key-bad": Hostile("GET", "/v1/jobs", "label", params={"label": "a b=v"}),
    "jobs-label-value-long": Hostile("GET", "/v1/jobs", "label", params={"label": "k=" + "v" * 64}),
    "jobs-label-no-equals": Hostile("GET", "/v1/jobs", "label", params={"label": "k"}),
    "jobs-label-900": Hostile("GET", "/v1/jobs", "label", params={"label": [f"k{i}=v" for i in range(900)]}),
    "count-label-nul": Hostile("GET", "/v1/jobs:count", "label", params={"label": f"{NUL}=v"}),
    "count-label-900": Hostile("GET", "/v1/jobs:count", "label", params={"label": [f"k{i}=v" for i in range(900)]}),
    **{
        f"{path.strip('/').replace('/', '-')}-cluster-{what}": _query(path, "cluster", value)
        for path in ("/v1/inventory", "/v1/inventory/drift", "/v1/inventory/occupancy", "/v1/mig/plan")
        for what, value in (("nul", NUL), ("long", LONG))
    },
    "events-node-nul": _query("/v1/events", "node", NUL),
    "events-node-long": _query("/v1/events", "node", LONG),
    "usage-tenant-nul": _query("/v1/usage", "tenant", NUL),
    "usage-by-nul": _query("/v1/usage", "by", NUL),
    "jobs-cursor-nul": _query("/v1/jobs", "cursor", NUL),
    "gres-style-nul": Hostile("GET", "/v1/nodes/gpu-1/gres-conf", "style", params={"style": NUL}),
    # -- names in paths ---------------------------------------------------------------
    "tenant-put-nul": Hostile("PUT", "/v1/tenants/%00", "name", json={"weight": 2}),
    "tenant-put-long": Hostile("PUT", f"/v1/tenants/{LONG}", "name", json={"weight": 2}),
    "tenant-put-control": Hostile("PUT", "/v1/tenants/a%1Bb", "name", json={"weight": 2}),
    "cluster-delete-nul": Hostile("DELETE", "/v1/clusters/%00", "name"),
    "cluster-delete-long": Hostile("DELETE", f"/v1/clusters/{LONG}", "name"),
    "cluster-quotas-nul": Hostile("GET", "/v1/clusters/%00/tenant-quotas", "name"),
    "cluster-timeslice-nul": Hostile("POST", "/v1/clusters/%00/timeslice", "name", json={"replicas": 2}),
    "node-gres-nul": Hostile("GET", "/v1/nodes/%00/gres-conf", "node"),
    "node-gres-long": Hostile("GET", f"/v1/nodes/{LONG}/gres-conf", "node"),
    # -- names and free text in bodies -----------------------------------------------
    "mig-apply-cluster-nul": Hostile("POST", "/v1/mig/changes", "cluster", json={"cluster": f"a{NUL}"}),
    "mig-apply-node-nul": Hostile("POST", "/v1/mig/changes", "node", json={"node": f"n{NUL}"}),
    "token-description-nul": Hostile(
        "POST", "/v1/admin/tokens", "description", json={"user": "bob", "tenant": "ml", "description": f"a{NUL}b"}
    ),
    "token-description-long": Hostile(
        "POST", "/v1/admin/tokens", "description", json={"user": "bob", "tenant": "ml", "description": LONG}
    ),
    "timeslice-node-label-nul": Hostile(
        "POST", "/v1/clusters/k8s/timeslice", "node_label", json={"replicas": 2, "node_label": f"a={NUL}"}
    ),
    "checkpoint-note-nul": Hostile("POST", "/v1/jobs/1/checkpoint", "note", json={"note": f"saved{NUL}"}),
    "policy-comment-nul": Hostile("POST", "/v1/policy", "comment", json={"text": POLICY, "comment": f"why{NUL}"}),
    "policy-source-nul": Hostile("POST", "/v1/policy:validate", "source", json={"text": POLICY, "source": NUL}),
    "policy-text-nul": Hostile("POST", "/v1/policy:validate", "text", json={"text": f"routes: []{NUL}"}),
    "rollback-comment-nul": Hostile("POST", "/v1/policy:rollback", "comment", json={"version": 1, "comment": NUL}),
    "token-user-nul": Hostile("POST", "/v1/admin/tokens", "user", json={"user": f"b{NUL}", "tenant": "ml"}),
    "token-tenant-long": Hostile("POST", "/v1/admin/tokens", "tenant", json={"user": "bob", "tenant": LONG}),
    "token-nodes-nul": Hostile(
        "POST", "/v1/admin/tokens", "nodes", json={"user": "n1", "tenant": "agents", "role": "agent", "nodes": [NUL]}
    ),
    "job-tenant-nul": Hostile("POST", "/v1/jobs", "tenant", json={**TRAIN, "tenant": f"ml{NUL}"}),
    "job-user-long": Hostile("POST", "/v1/jobs", "user", json={**TRAIN, "user": LONG}),
    "job-cluster-nul": Hostile("POST", "/v1/jobs", "cluster", json={**TRAIN, "cluster": f"a{NUL}"}),
    "job-label-nul": Hostile("POST", "/v1/jobs", "labels", json={**TRAIN, "labels": {"k": NUL}}),
    "batch-tenant-nul": Hostile("POST", "/v1/jobs:batch", "tenant", json={"jobs": [{**TRAIN, "tenant": NUL}]}),
    "explain-user-nul": Hostile("POST", "/v1/policy:explain", "user", json={"spec": {**TRAIN, "user": NUL}}),
    "agent-node-nul": Hostile("POST", "/v1/agent/reports", "node", json={"node": f"n{NUL}", "gpus": []}),
    "cluster-create-name-nul": Hostile("POST", "/v1/clusters", "name", json={"name": f"a{NUL}", "kind": "sim"}),
    "sim-fleet-path-nul": Hostile(
        "POST",
        "/v1/clusters",
        "fleet",
        json={"name": "sim-a", "kind": "sim", "config": {"fleet": f"/tmp/f{NUL}", "cluster": "slurm-a"}},
    ),
    "sim-state-file-nul": Hostile(
        "POST",
        "/v1/clusters",
        "state_file",
        json={
            "name": "sim-a",
            "kind": "sim",
            "config": {"fleet_yaml": FLEET, "cluster": "slurm-a", "state_file": f"/tmp/s{NUL}"},
        },
    ),
}


@pytest.fixture
def admin(http):
    return http(role="admin")


def _stored(sessions) -> dict[str, int]:
    with sessions() as session:
        return {
            model.__name__: session.scalar(select(func.count()).select_from(model))
            for model in (ApiToken, Cluster, PolicyVersion, Tenant)
        }


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_a_hostile_name_is_refused_by_field_and_nothing_is_stored(admin, sessions, case: Hostile):
    before = _stored(sessions)
    response = admin.request(case.method, case.path, params=case.params, json=case.json)
    assert response.status_code in case.statuses, f"{response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    named = [d["field"] for d in error["details"]]
    assert any(case.field in f.split(".") for f in named) or case.field in error["message"], error
    assert _stored(sessions) == before


def test_no_tenant_named_nul_or_longer_than_its_column_exists_after_the_refusals(admin, sessions):
    for name in ("%00", LONG):
        assert admin.put(f"/v1/tenants/{name}", json={"weight": 2}).status_code == 422
    with sessions() as session:
        names = list(session.scalars(select(Tenant.name)))
    assert not [n for n in names if NUL in n or len(n) > 64]


def test_label_filters_up_to_the_limit_are_served(admin):
    admin.post("/v1/jobs", json={"kind": "training", "command": ["true"], "labels": {"k0": "v"}}).raise_for_status()
    labels = [f"k{i}=v" for i in range(MAX_LABEL_FILTERS)]
    assert admin.get("/v1/jobs", params={"label": labels}).json()["jobs"] == []
    assert [j["spec"]["labels"] for j in admin.get("/v1/jobs", params={"label": "k0=v"}).json()["jobs"]] == [
        {"k0": "v"}
    ]


def test_too_many_label_filters_say_the_limit(admin):
    labels = [f"k{i}=v" for i in range(MAX_LABEL_FILTERS + 1)]
    response = admin.get("/v1/jobs", params={"label": labels})
    assert response.status_code == 422
    assert "Retry-After" not in response.headers
    assert f"at most {MAX_LABEL_FILTERS}" in response.json()["error"]["message"]


def test_well_formed_names_still_find_nothing_or_their_rows(admin):
    # The refusals above must not reach names that are merely unknown: 404, or an empty list.
    assert admin.get("/v1/jobs", params={"user": "nobody", "cluster": "gone", "tenant": "ml"}).json()["jobs"] == []
    assert admin.delete("/v1/clusters/gone").status_code == 404
    assert admin.get("/v1/nodes/gpu-1/gres-conf").status_code == 404
    assert admin.put("/v1/tenants/team-a", json={"weight": 2}).json()["name"] == "team-a"
