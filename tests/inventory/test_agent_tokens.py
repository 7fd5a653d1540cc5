"""Agent tokens are bound to the nodes they may report for: a leaked agent token (they
live on every GPU node) cannot rewrite the inventory of the rest of the fleet."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from broker.core.models import ApiToken
from tests.inventory.test_inventory_api import NVML, report, stored_reports


@pytest.fixture
def admin(http):
    return http(user="root", tenant="ops", role="admin")


def agent_token(admin, nodes, user="gpu-agents"):
    body = {"user": user, "tenant": "agents", "role": "agent"}
    if nodes is not None:
        body["nodes"] = nodes
    return admin.post("/v1/admin/tokens", json=body)


def test_an_agent_token_reports_for_its_nodes_only(admin, http, sessions, clock):
    created = agent_token(admin, ["mig01", "gpu-*"])
    assert created.status_code == 201, created.text
    assert created.json()["nodes"] == ["mig01", "gpu-*"]
    agent = http(token=created.json()["token"])

    assert agent.post("/v1/agent/reports", json=report("mig01.json", clock())).status_code == 202
    assert agent.post("/v1/agent/reports", json=report("mig01.json", clock(), node="gpu-17")).status_code == 202
    refused = agent.post("/v1/agent/reports", json=report("mig01.json", clock(), node="mig02"))

    assert refused.status_code == 403
    message = refused.json()["error"]["message"]
    assert "mig02" in message and "mig01, gpu-*" in message and "--nodes" in message
    assert stored_reports(sessions) == 2


def test_an_agent_token_for_every_node_says_so(admin, http, clock):
    created = agent_token(admin, ["*"])
    assert created.status_code == 201, created.text
    agent = http(token=created.json()["token"])
    assert agent.post("/v1/agent/reports", json=report("mig01.json", clock(), node="anything-9")).status_code == 202


def test_a_new_agent_token_must_name_its_nodes(admin, sessions):
    refused = agent_token(admin, None)

    assert refused.status_code == 422
    message = refused.json()["error"]["message"]
    assert "nodes" in message and "'*'" in message
    assert [t["role"] for t in admin.get("/v1/admin/tokens").json()] == ["admin"]


@pytest.mark.parametrize("nodes", [[], [""], ["gpu 01"], ["gpu-01,gpu-02"], ["x" * 254]])
def test_node_names_must_be_names_or_globs(admin, nodes):
    assert agent_token(admin, nodes).status_code == 422


def test_only_agent_tokens_are_bound_to_nodes(admin):
    refused = admin.post("/v1/admin/tokens", json={"user": "alice", "tenant": "ml", "nodes": ["gpu-*"]})
    assert refused.status_code == 422
    assert "agent" in refused.json()["error"]["message"]


def test_an_agent_token_from_before_the_binding_reports_for_any_node(admin, http, sessions, clock):
    created = agent_token(admin, ["mig01"])
    with sessions() as session, session.begin():  # as revision 0005 leaves older tokens
        session.execute(update(ApiToken).values(nodes=None))
    agent = http(token=created.json()["token"])
    assert agent.post("/v1/agent/reports", json=report("mig01.json", clock(), node="gpu-01")).status_code == 202
    listed = [t for t in admin.get("/v1/admin/tokens").json() if t["role"] == "agent"]
    assert listed[0]["nodes"] is None


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUSH_DATABASE_URL", f"sqlite:///{tmp_path / 'cli.db'}")


def test_cli_agent_token_needs_nodes_and_reports_for_them(gpush, embedded):
    base = ("admin", "token", "create", "--user", "gpu-agents", "--tenant", "agents", "--role", "agent")
    refused = gpush(*base)
    assert refused.code == 2, (refused.out, refused.err)
    assert "--nodes" in refused.err and "'*'" in refused.err

    created = gpush(*base, "--nodes", "mig01, gpu-*", "--json")
    assert created.code == 0, created.err
    assert created.json["nodes"] == ["mig01", "gpu-*"]
    token = created.json["token"]
    ok = gpush("--token", token, "agent", "--once", "--node", "gpu-3", "--recording", NVML / "mig01.json")
    assert ok.code == 0, ok.err
    refused = gpush("--token", token, "agent", "--once", "--node", "mig02", "--recording", NVML / "mig01.json")
    assert refused.code == 4, (refused.out, refused.err)
    assert "mig01, gpu-*" in refused.err

    listed = gpush("admin", "token", "list")
    assert "mig01, gpu-*" in listed.out


@pytest.mark.parametrize(
    "change",
    [
        {"report_version": 2**64},
        {"node": ""},
        {"node": "gpu-01\n"},
        {"agent_version": "x" * 10_000},
        {"gpus": [{"index": n} for n in range(65)]},
        {"gpus": [{"index": 0, "memory_mb": 2**63}]},
        {"gpus": [{"index": 0, "processes": [{"pid": -1}]}]},
    ],
)
def test_a_report_beyond_what_a_node_can_have_is_refused_not_a_server_error(admin, http, clock, change):
    """Any agent token may post a report: its numbers and lists are bounded (an unbounded
    integer once failed the report's storage with a 500)."""
    agent = http(token=agent_token(admin, ["*"]).json()["token"])
    answer = agent.post("/v1/agent/reports", json={**report("mig01.json", clock()), **change})
    assert answer.status_code == 422, answer.text
