"""The reconciled GPU inventory from the outside: agent tokens and reports, the inventory
and drift commands, gres.conf, drift that keeps the scheduler off broken slices, and
``gpush mig plan``.

Reports are what ``gpush agent`` posts: :func:`broker.nodeagent.agent.collect` over the NVML
recordings of tests/data/nvml (``mig01.json`` as Slurm's gres.conf describes it,
``mig01-repartitioned.json`` after GPU 1 was re-cut to 2g.10gb slices behind Slurm's
back, ``mig01-mixed.json`` with GPU 0 cut 2g.10gb+1g.5gb+1g.5gb+3g.20gb).
"""

from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select

from broker.core.adapter import BackendJob, BackendState, CapacityUnit, Health, Placement, Sharing, StatusPage
from broker.core.clusters import AdapterPool, add_cluster
from broker.core.gpus import gpu_model, mig_layout_problem
from broker.core.models import NodeReport as NodeReportRow
from broker.core.schemas import JobSpec
from broker.nodeagent.agent import collect
from broker.nodeagent.nvml import RecordedLibrary
from broker.scheduling.cycle import Scheduler

NVML = Path(__file__).resolve().parents[1] / "data" / "nvml"
A100_40 = gpu_model("A100-SXM4-40GB")
CLUSTER = "slurm-m"
MIG_POLICY = f"""
rules:
  - name: isolated-training-on-mig
    why: hardware isolation is a MIG slice
    match: {{kind: training, isolation: hardware}}
    route: {{cluster: {CLUSTER}, sharing: slurm/mig}}
"""


def report(recording: str, at: datetime, node: str = "mig01") -> dict[str, Any]:
    """What ``gpush agent --node NODE`` posts on a machine answering as ``recording``."""
    body = collect(RecordedLibrary(NVML / recording), node, process_name=None, mps_control=None, now=lambda: at)
    return body.model_dump(mode="json")


def stored_reports(sessions) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(NodeReportRow))


@pytest.fixture
def admin(http):
    return http(user="root", tenant="ops", role="admin")


@pytest.fixture
def agent(admin, http):
    """An agent token made as an admin makes one (role agent), and a client holding it."""
    body = {"user": "mig01", "tenant": "agents", "role": "agent", "nodes": ["mig01"]}
    created = admin.post("/v1/admin/tokens", json=body)
    assert created.status_code == 201, created.text
    assert created.json()["role"] == "agent"
    return http(token=created.json()["token"])


def error_of(response) -> str:
    return response.json()["error"]["message"]


# -- 1. who may report, and what a report must be ----------------------------------------


def test_agent_token_reports_and_says_who_it_is(agent, clock):
    posted = agent.post("/v1/agent/reports", json=report("mig01.json", clock()))

    assert posted.status_code == 202, posted.text
    assert posted.json()["node"] == "mig01"
    assert agent.get("/v1/whoami").json() == {"user": "mig01", "tenant": "agents", "role": "agent"}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/jobs", {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}),
        ("GET", "/v1/jobs", None),
        ("GET", "/v1/inventory", None),
        ("GET", "/v1/mig/plan", None),
    ],
)
def test_agent_token_is_refused_everywhere_else(agent, method, path, body):
    response = agent.request(method, path, json=body)

    assert response.status_code == 403
    message = error_of(response)
    assert "agent token" in message and "mig01" in message and "user or admin token" in message


def test_agent_token_cannot_submit_anything(agent, admin):
    agent.post("/v1/jobs", json={"kind": "training", "gpus": 1, "command": ["x"]})

    assert admin.get("/v1/jobs").json()["jobs"] == []


def test_user_token_is_refused_on_reports_with_how_to_make_an_agent_token(http, sessions, clock):
    user = http(user="alice", tenant="ml")

    response = user.post("/v1/agent/reports", json=report("mig01.json", clock()))

    assert response.status_code == 403
    message = error_of(response)
    assert "alice" in message and "role user" in message
    assert "gpush admin token create --role agent" in message
    assert stored_reports(sessions) == 0


def test_admin_token_may_report(admin, clock):
    assert admin.post("/v1/agent/reports", json=report("mig01.json", clock())).status_code == 202


def test_reports_need_a_token(http, clock):
    response = http(token=None).post("/v1/agent/reports", json=report("mig01.json", clock()))

    assert response.status_code == 401 and "token" in error_of(response)


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda r: r.pop("node"), "node", "required"),
        (lambda r: r.update(hostname="mig01"), "hostname", "unknown field"),
        (lambda r: r["gpus"][0].update(temperature_c=41), "gpus.0.temperature_c", "unknown field"),
        (lambda r: r["gpus"][1].update(index="one"), "gpus.1.index", "integer"),
        (lambda r: r.update(collected_at="yesterday"), "collected_at", "datetime"),
        (lambda r: r["gpus"][0]["mig_instances"][0].pop("profile"), "gpus.0.mig_instances.0.profile", "required"),
        # its topology (issue 35)
        (lambda r: r["topology"].update(nvlink=[[0, 1], [1]]), "topology", "more than one group"),
        (lambda r: r["topology"].update(socket=[[0, 99]]), "topology.socket.0.1", "less than 64"),
        (lambda r: r["topology"].update(pcie=[[0]] * 65), "topology.pcie", "at most 64"),
        (lambda r: r["topology"].update(source="gres.conf"), "topology.source", "'nvml'"),
        (lambda r: r["gpus"][0].update(cpu_affinity="0-3;reboot"), "gpus.0.cpu_affinity", "pattern"),
        (lambda r: r["gpus"][0].update(cpu_affinity="0," * 600), "gpus.0.cpu_affinity", "at most 1024"),
        (lambda r: r["gpus"][0].update(numa_node=-1), "gpus.0.numa_node", "greater than or equal to 0"),
        (lambda r: r["gpus"][0]["nvlinks"][0].update(links=0), "gpus.0.nvlinks.0.links", "greater than or equal"),
        (lambda r: r["gpus"][0]["nvlinks"][0].update(kind="cable"), "gpus.0.nvlinks.0.kind", "'gpu'"),
        (lambda r: r["gpus"][0].update(nvlinks=r["gpus"][0]["nvlinks"] * 40), "gpus.0.nvlinks", "at most 36"),
    ],
)
def test_a_malformed_report_is_refused_with_the_field_and_nothing_is_stored(
    agent, sessions, clock, change, field, words
):
    body = report("mig01.json", clock())
    change(body)

    response = agent.post("/v1/agent/reports", json=body)

    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert field in [d["field"] for d in error["details"]]
    assert field in error["message"] and words in error["message"]
    assert "Job fields" not in error["message"]  # a report is not a job
    assert stored_reports(sessions) == 0


def test_an_unknown_report_field_is_named_against_the_reports_fields(agent, clock):
    body = report("mig01.json", clock())
    body["nodes"] = body.pop("node")

    response = agent.post("/v1/agent/reports", json=body)

    assert response.status_code == 422
    message = error_of(response)
    assert "nodes = 'mig01': unknown field; did you mean 'node'?" in message
    assert "node: Field required" in message


def test_a_report_that_is_not_json_is_refused(agent, sessions):
    response = agent.post("/v1/agent/reports", content=b"node: mig01", headers={"Content-Type": "application/json"})

    assert response.status_code == 422
    assert stored_reports(sessions) == 0


# -- 2. the newest report per node is kept -------------------------------------------------


def gres_of(client, node: str = "mig01") -> str:
    response = client.get(f"/v1/nodes/{node}/gres-conf")
    assert response.status_code == 200, response.text
    return response.json()["gres"]


def test_a_newer_report_replaces_the_older(agent, admin, clock):
    first = clock()
    agent.post("/v1/agent/reports", json=report("mig01.json", first))
    assert gres_of(admin) == "gpu:1g.5gb:7,gpu:3g.20gb:2"

    clock.advance(60)
    posted = agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", clock()))

    assert posted.status_code == 202
    assert gres_of(admin) == "gpu:1g.5gb:7,gpu:2g.10gb:3"
    (node,) = admin.get("/v1/inventory").json()["unscheduled"]
    assert datetime.fromisoformat(node["reported_at"]) == clock()


def test_an_older_report_arriving_late_is_ignored(agent, admin, clock):
    collected_early = clock()
    clock.advance(30)
    newer = clock()
    agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", newer))

    late = agent.post("/v1/agent/reports", json=report("mig01.json", collected_early))

    assert late.status_code == 202
    # The answer names the report the broker keeps, so the agent can tell.
    assert datetime.fromisoformat(late.json()["collected_at"]) == newer
    assert gres_of(admin) == "gpu:1g.5gb:7,gpu:2g.10gb:3"


def changed_at(sessions, node: str = "mig01") -> datetime:
    with sessions() as session:
        return session.get(NodeReportRow, node).changed_at


def test_a_report_that_repeats_the_gpus_does_not_count_as_a_change(agent, sessions, clock):
    """The scheduler reconciles when ``changed_at`` moves: agents repeating the same GPUs
    every half minute (new time, new process memory) must not move it; a new layout does."""
    agent.post("/v1/agent/reports", json=report("mig01.json", clock()))
    first = changed_at(sessions)

    clock.advance(30)
    again = report("mig01.json", clock())
    for gpu in again["gpus"]:
        for process in gpu["processes"]:
            process["used_memory_mb"] = (process["used_memory_mb"] or 0) + 512
    agent.post("/v1/agent/reports", json=again)
    assert changed_at(sessions) == first

    clock.advance(30)
    agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", clock()))
    assert changed_at(sessions) == clock()


# -- 3. the command line, embedded -----------------------------------------------------------


@pytest.fixture
def embedded(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    monkeypatch.setenv("GPUSH_DATABASE_URL", url)
    return url


def test_cli_agent_then_inventory_drift_and_gres_conf(gpush, embedded):
    reported = gpush("agent", "--once", "--node", "mig01", "--recording", NVML / "mig01.json")
    assert reported.code == 0, reported.err

    listed = gpush("inventory", "--json")
    assert listed.code == 0, listed.err
    view = listed.json
    assert view["clusters"] == []
    (node,) = view["unscheduled"]
    assert (node["name"], node["cluster"], node["agent"]) == ("mig01", None, "ok")
    assert [(g["index"], g["model"], g["mig_mode"]) for g in node["gpus"]] == [
        (0, "A100-SXM4-40GB", True),
        (1, "A100-SXM4-40GB", True),
    ]
    assert [[m["profile"] for m in g["mig_instances"]] for g in node["gpus"]] == [["1g.5gb"] * 7, ["3g.20gb"] * 2]
    assert all(m["uuid"].startswith("MIG-") for g in node["gpus"] for m in g["mig_instances"])

    drift = gpush("inventory", "drift", "--json")
    assert drift.code == 0, drift.err
    (finding,) = drift.json
    assert (finding["kind"], finding["severity"], finding["node"]) == ("unscheduled_gpus", "warning", "mig01")
    assert "gpush slurm gres-conf mig01" in finding["fix"]

    assert gpush("inventory", "drift", "--fail-on", "warning").code == 1
    assert gpush("inventory", "drift", "--fail-on", "critical").code == 0
    assert gpush("inventory", "drift", "--severity", "critical", "--json").json == []

    gres = gpush("slurm", "gres-conf", "mig01")
    assert gres.code == 0, gres.err
    assert "Gres=gpu:1g.5gb:7,gpu:3g.20gb:2" in gres.out.splitlines()
    assert gres.out.count("NodeName=mig01 Name=gpu Type=1g.5gb MultipleFiles=/dev/nvidia0,") == 7
    assert gres.out.count("NodeName=mig01 Name=gpu Type=3g.20gb MultipleFiles=/dev/nvidia1,") == 2

    nvml = gpush("slurm", "gres-conf", "mig01", "--style", "nvml")
    assert nvml.code == 0, nvml.err
    assert "NodeName=mig01 AutoDetect=nvml" in nvml.out.splitlines()
    assert "Gres=gpu:1g.5gb:7,gpu:3g.20gb:2" in nvml.out.splitlines()

    missing = gpush("slurm", "gres-conf", "nosuch")
    assert missing.code == 3
    assert missing.out == ""
    assert "nosuch" in missing.err and "gpush agent" in missing.err


def test_cli_drift_text_says_there_is_none(gpush, embedded):
    quiet = gpush("inventory", "drift")
    assert quiet.code == 0 and "no drift" in quiet.err
    assert gpush("inventory", "drift", "--fail-on", "warning").code == 0


def test_cli_agent_token_reports_and_is_refused_elsewhere(gpush, embedded):
    agent_token = ("--user", "mig01", "--tenant", "agents", "--role", "agent", "--nodes", "mig01")
    created = gpush("admin", "token", "create", *agent_token, "--json")
    assert created.code == 0, created.err
    token = created.json["token"]

    assert gpush("--token", token, "whoami", "--json").json["role"] == "agent"
    reported = gpush("--token", token, "agent", "--once", "--node", "mig01", "--recording", NVML / "mig01.json")
    assert reported.code == 0, reported.err
    refused = gpush("--token", token, "list")
    assert refused.code == 4 and "agent token" in refused.err
    refused = gpush("--token", token, "submit", "--kind", "training", "--", "python", "x.py")
    assert refused.code == 4 and "agent token" in refused.err
    # The report arrived: the local admin sees the node.
    assert [n["name"] for n in gpush("inventory", "--json").json["unscheduled"]] == ["mig01"]


def test_cli_agent_with_a_user_token_stops_with_how_to_get_an_agent_token(gpush, embedded):
    created = gpush("admin", "token", "create", "--user", "alice", "--tenant", "ml", "--json")
    token = created.json["token"]

    refused = gpush("--token", token, "agent", "--once", "--node", "mig01", "--recording", NVML / "mig01.json")

    assert refused.code == 4, (refused.out, refused.err)
    assert "gpush admin token create --role agent" in refused.err
    assert gpush("inventory", "--json").json["unscheduled"] == []


# -- 4. drift that breaks slices keeps the scheduler off them --------------------------------


class MigNodeSlurm:
    """A Slurm cluster of one node, mig01, as the Slurm adapter reports it from
    ``Gres=gpu:1g.5gb:7,gpu:3g.20gb:2``: GRES counts per node, no device indexes.
    Jobs it is given start at once and run until the test ends."""

    name = CLUSTER

    def __init__(self) -> None:
        self.jobs: dict[int, Placement] = {}
        self._lock = threading.Lock()

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner=None) -> str:
        with self._lock:
            self.jobs.setdefault(job_id, placement)
        return f"slurm-{job_id}"

    def cancel(self, job_id: int) -> None:
        with self._lock:
            self.jobs.pop(job_id, None)

    def find(self, job_id: int) -> BackendJob | None:
        if job_id not in self.jobs:
            return None
        return BackendJob(job_id, f"slurm-{job_id}", BackendState.RUNNING, node="mig01")

    def statuses(self, cursor: str | None = None) -> StatusPage:
        seen = int(cursor or 0)
        with self._lock:
            ids = sorted(self.jobs)
        new = [BackendJob(i, f"slurm-{i}", BackendState.RUNNING, node="mig01") for i in ids if i > seen]
        return StatusPage(new, str(max(ids, default=seen)))

    def inventory(self) -> list[CapacityUnit]:
        with self._lock:
            used: dict[str, int] = {}
            for p in self.jobs.values():
                used[p.mig_profile] = used.get(p.mig_profile, 0) + p.units * p.replicas
        return [self._unit(profile, count, used.get(profile, 0)) for profile, count in (("1g.5gb", 7), ("3g.20gb", 2))]

    def _unit(self, profile: str, count: int, allocated: int) -> CapacityUnit:
        return CapacityUnit(
            cluster=CLUSTER,
            node="mig01",
            sharing=Sharing.SLURM_MIG,
            gpu_model=A100_40.name,
            unit_memory_gb=A100_40.profile(profile).memory_gb,
            capacity=count,
            allocated=min(allocated, count),
            gpu_equivalent=A100_40.gpu_equivalent(profile),
            mig_profile=profile,
            gpu_memory_gb=A100_40.memory_gb,
            in_mig_mode=True,
            labels={"state": "idle", "partitions": "gpu", "gres": f"gpu:{profile}:{count}"},
        )

    def health(self) -> Health:
        return Health(True, "one node, mig01", "test")


@pytest.fixture
def mig_cluster(app, sessions, clock, admin):
    """slurm-m (kind slurm, mig01 only) registered, its adapter the in-test one in the API
    and in the scheduler, and a policy sending hardware-isolated training to its slurm/mig."""
    adapter = MigNodeSlurm()
    app.state.adapters.override(CLUSTER, adapter)
    with sessions() as session, session.begin():
        # Registered directly: the API's registration would ask the real Slurm whether it answers.
        add_cluster(session, name=CLUSTER, kind="slurm", config={}, actor="root", now=clock())
    applied = admin.post("/v1/policy", json={"text": MIG_POLICY, "comment": "MIG training to slurm-m"})
    assert applied.status_code == 201, applied.text
    return SimpleNamespace(adapter=adapter, pool=AdapterPool(clock, overrides={CLUSTER: adapter}))


def submit_mig(client, gpu_memory_gb: float) -> int:
    spec = {"kind": "training", "isolation": "hardware", "gpu_memory_gb": gpu_memory_gb, "command": ["python", "t.py"]}
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_a_slice_the_gpus_no_longer_have_is_a_critical_finding_with_the_gres_fix(mig_cluster, agent, admin, clock):
    agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", clock()))

    findings = admin.get("/v1/inventory/drift").json()

    critical = [f for f in findings if f["severity"] == "critical"]
    (broken,) = critical
    assert (broken["kind"], broken["cluster"], broken["node"]) == ("mig_profile_without_instance", CLUSTER, "mig01")
    assert "3g.20gb" in broken["what"] and "gpush slurm gres-conf mig01" in broken["fix"]
    assert broken["breaks"] == [{"sharing": "slurm/mig", "mig_profile": "3g.20gb", "gpu": None}]
    # The 2g.10gb slices NVML sees and Slurm does not offer: capacity wasted, not broken.
    unused = next(f for f in findings if f["kind"] == "mig_count_below_nvml")
    assert unused["severity"] == "warning" and "2g.10gb" in unused["what"]

    # The inventory shows the 3g.20gb GRES as broken and backed by no GPU; the 1g.5gb
    # slices stay usable, on GPU 0; GPU 1 shows the instances NVML sees.
    (view,) = admin.get("/v1/inventory", params={"cluster": CLUSTER}).json()["clusters"]
    (node,) = view["nodes"]
    units = {u["mig_profile"]: u for u in node["units"]}
    assert (units["3g.20gb"]["unplaced"], units["3g.20gb"]["free"], units["3g.20gb"]["gpus"]) == (2, 0, [])
    assert "no 3g.20gb MIG instance" in units["3g.20gb"]["broken"]
    assert (units["1g.5gb"]["broken"], units["1g.5gb"]["free"], units["1g.5gb"]["gpus"]) == (None, 7, [0])
    assert [m["profile"] for m in node["gpus"][1]["mig_instances"]] == ["2g.10gb"] * 3
    # What fixes it: the gres.conf for what NVML sees.
    assert gres_of(admin) == "gpu:1g.5gb:7,gpu:2g.10gb:3"


def test_the_scheduler_keeps_jobs_off_a_broken_slice_until_a_consistent_report(
    mig_cluster, engine, agent, admin, http, clock
):
    agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", clock()))
    user = http(user="alice", tenant="ml")
    big = submit_mig(user, 20)  # a 3g.20gb slice
    small = submit_mig(user, 5)  # a 1g.5gb slice
    scheduler = Scheduler(engine, mig_cluster.pool, clock=clock)

    cycle = scheduler.run_cycle()

    assert cycle.errors == []
    placed = user.get(f"/v1/jobs/{small}").json()
    assert placed["state"] == "submitted"
    assert (placed["placement"]["cluster"], placed["placement"]["mig_profile"]) == (CLUSTER, "1g.5gb")
    waiting = user.get(f"/v1/jobs/{big}").json()
    assert waiting["state"] == "queued", waiting
    reason = waiting["state_reason"]
    assert "3g.20gb" in reason and "broken" in reason and "mig01" in reason and "gpush inventory drift" in reason
    assert big not in mig_cluster.adapter.jobs  # Slurm never saw it

    # Another cycle without news: still kept off the broken slice.
    clock.advance(5)
    scheduler.run_cycle()
    assert user.get(f"/v1/jobs/{big}").json()["state"] == "queued"

    # The GPUs are cut as Slurm says again (or gres.conf was fixed): the next report clears it.
    clock.advance(5)
    assert agent.post("/v1/agent/reports", json=report("mig01.json", clock())).status_code == 202
    scheduler.run_cycle()

    fixed = user.get(f"/v1/jobs/{big}").json()
    assert fixed["state"] == "submitted", fixed
    assert (fixed["placement"]["cluster"], fixed["placement"]["mig_profile"]) == (CLUSTER, "3g.20gb")
    assert [f for f in admin.get("/v1/inventory/drift").json() if f["severity"] == "critical"] == []


# -- 6. /metrics -------------------------------------------------------------------------------


def drift_gauge(text: str, kind: str, severity: str, cluster: str) -> float | None:
    """The value of gpush_drift_findings{cluster, kind, severity} in a /metrics page."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gpush_drift_findings" and sample.labels == {
                "cluster": cluster,
                "kind": kind,
                "severity": severity,
            }:
                return sample.value
    return None


def test_metrics_count_the_drift_findings_by_kind_and_severity(mig_cluster, agent, admin, http, clock):
    agent.post("/v1/agent/reports", json=report("mig01-repartitioned.json", clock()))
    admin.get("/v1/inventory/drift")

    text = http(token=None).get("/metrics").text

    assert drift_gauge(text, "mig_profile_without_instance", "critical", CLUSTER) == 1
    assert drift_gauge(text, "mig_count_below_nvml", "warning", CLUSTER) == 1

    # Fixed: the kind stays exported, at 0.
    clock.advance(10)
    agent.post("/v1/agent/reports", json=report("mig01.json", clock()))
    admin.get("/v1/inventory/drift")
    text = http(token=None).get("/metrics").text
    assert drift_gauge(text, "mig_profile_without_instance", "critical", CLUSTER) == 0


# -- 5. gpush mig plan -------------------------------------------------------------------------

MIXED_FLEET = """
clusters:
  slurm-m:
    flavor: slurm
    nodes:
      - name: mig01
        cpus: 64
        memory: 512G
        gpus:
          - {model: A100-SXM4-40GB, mig: [2g.10gb, 1g.5gb, 1g.5gb, 3g.20gb]}
          - {model: A100-SXM4-40GB, mig: [3g.20gb, 3g.20gb]}
"""


def test_cli_mig_plan_places_more_of_the_queue_with_valid_layouts(gpush, embedded, tmp_path):
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(MIXED_FLEET)
    policy = tmp_path / "policy.yaml"
    policy.write_text(MIG_POLICY)
    added = gpush("cluster", "add", CLUSTER, "--kind", "sim", "--fleet", fleet)
    assert added.code == 0, added.err
    applied = gpush("policy", "apply", policy, "-m", "MIG training to slurm-m")
    assert applied.code == 0, applied.err
    for _ in range(9):
        submitted = gpush("submit", "--kind", "training", "--isolation", "hardware", "--gpu-memory-gb", 5, "--", "x")
        assert submitted.code == 0, submitted.err
    reported = gpush("agent", "--once", "--node", "mig01", "--recording", NVML / "mig01-mixed.json")
    assert reported.code == 0, reported.err

    result = gpush("mig", "plan", "--cluster", CLUSTER, "--json")

    assert result.code == 0, result.err
    plan = result.json
    assert plan["nodes"] == ["mig01"] and plan["missing_agents"] == []
    assert plan["waiting_slices"] == 9
    assert plan["planned"]["jobs"] > plan["today"]["jobs"]
    gpus = {g["index"]: g for g in plan["gpus"]}
    assert gpus[0]["today"] == ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"]
    for g in plan["gpus"]:
        assert g["node"] == "mig01" and g["model"] == "A100-SXM4-40GB"
        assert mig_layout_problem(A100_40, g["planned"]) is None, g
    assert (plan["today"]["jobs"], plan["planned"]["jobs"]) == (6, 9)
    assert plan["unplaced"] == []
    assert gpus[0]["action"] == "repartition" and gpus[0]["planned"] == ["1g.5gb"] * 7
    assert gpus[1]["action"] == "keep" and gpus[1]["planned"] == ["3g.20gb", "3g.20gb"]
    assert plan["drain_first"] == ["mig01"]

    # The mig-parted config mig01 applies (nvidia-mig-parted apply -c gpush-mig01): one
    # entry per GPU, its counts those of the planned layout.
    parted = yaml.safe_load(plan["mig_parted"])
    assert parted["version"] == "v1"
    entries = parted["mig-configs"]["gpush-mig01"]
    by_device = {device: entry for entry in entries for device in entry["devices"]}
    assert sorted(by_device) == [0, 1]
    for g in plan["gpus"]:
        entry = by_device[g["index"]]
        assert entry["mig-enabled"] is True
        assert entry["mig-devices"] == Counter(g["planned"]), (g, plan["mig_parted"])


def test_cli_mig_plan_without_agents_says_to_run_one(gpush, embedded):
    result = gpush("mig", "plan")

    assert result.code == 3
    assert "gpush agent" in result.err


def test_cli_inventory_of_one_cluster_lists_its_nodes_alone(gpush, embedded):
    fleet = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"
    for name in ("slurm-a", "k8s-a"):
        added = gpush("cluster", "add", name, "--kind", "sim", "--fleet", fleet)
        assert added.code == 0, added.err
    # The agent of mig-01, a node of slurm-a (not of k8s-a), has reported.
    reported = gpush("agent", "--once", "--node", "mig-01", "--recording", NVML / "mig01.json")
    assert reported.code == 0, reported.err

    view = gpush("inventory", "--cluster", "k8s-a", "--json").json
    assert [c["name"] for c in view["clusters"]] == ["k8s-a"]
    assert view["unscheduled"] == []
    assert {f["cluster"] for f in view["findings"]} <= {"k8s-a"}

    text = gpush("inventory", "--cluster", "k8s-a")
    assert text.code == 0, text.err
    nodes = text.out.split("\n\n", 1)[1].splitlines()[1:]
    assert nodes and all(row.split()[0] == "k8s-a" for row in nodes), text.out
    assert "mig-01" not in text.out and "(none)" not in text.out

    names = gpush("inventory", "--cluster", "slurm-a", "-o", "name").out.split()
    assert names == ["slurm-a/mig-01", "slurm-a/mps-01", "slurm-a/gpu-01", "slurm-a/gpu-02"]


def test_a_new_slurm_registration_gets_a_tag_of_eight_hex_digits_and_keeps_it(sessions, clock):
    """Two brokers sharing a Slurm cluster must not draw the same tag (each would take the
    other's jobs for its own): eight hex digits, not four, and a re-registration keeps it."""
    import re

    from broker.core.clusters import list_clusters

    with sessions() as session, session.begin():
        add_cluster(session, name="slurm-t", kind="slurm", config={}, actor="root", now=clock())
    with sessions() as session:
        (info,) = [c for c in list_clusters(session) if c.name == "slurm-t"]
    assert re.fullmatch(r"gpush[0-9a-f]{8}", info.config["tag"]), info.config["tag"]
    with sessions() as session, session.begin():
        add_cluster(session, name="slurm-t", kind="slurm", config={}, actor="root", now=clock(), replace=True)
    with sessions() as session:
        (again,) = [c for c in list_clusters(session) if c.name == "slurm-t"]
    assert again.config["tag"] == info.config["tag"]
