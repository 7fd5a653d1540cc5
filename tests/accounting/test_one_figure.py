"""One figure for what a job holds (broker.accounting.equivalents), read alike by every
view: on the demo's fleet (examples/fleet.yaml, simulated, the default policy) with a
demo-like workload of three tenants, the CLI's list, status, tenant list, cluster list
and inventory, the API the dashboard reads (jobs, tenants, inventory, occupancy) and
the GPU-hours give the same GPU-equivalents, job by job, tenant by tenant and node by
node, before and after an elastic job is scaled."""

from __future__ import annotations

from collections import defaultdict
from datetime import timedelta
from pathlib import Path

import pytest

from broker.accounting.usage import job_usage
from broker.core.auth import Principal
from broker.core.clock import utcnow
from broker.core.schemas import Role

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "examples" / "fleet.yaml"
POLICY = ROOT / "policies" / "default.yaml"
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
# Every job runs a day of virtual time, so none ends between two views.
DAY = "sim-duration=86400"

# Whole GPUs on one node and on two (a gang of 2 nodes x 2 GPUs: 4),
# a 3g.20gb slice (3/7), a 2-replica time-sliced T4 job (2 x 1/4), a 2 GB
# MPS share of an A100 40 GB (5%), three time-sliced shards, a 1g.5gb slice (1/7).
EXPECTED = {
    "llama-pretrain": 2.0,
    "gang-pretrain": 4.0,
    "bert-finetune": 3 / 7,
    "chat-serve": 0.5,
    "small-serve": 0.05,
    "shard-0": 0.25,
    "shard-1": 0.25,
    "shard-2": 0.25,
    "tiny-mig": 1 / 7,
}


@pytest.fixture
def demo(gpush, database_url):
    """``gpush`` on the test's database, with the fleet, the policy and the workload placed
    and running: root (tenant default) trains, alice (nlp) serves, bob (vision) batches."""

    def run(*args, token=None):
        prefix = ("--database-url", database_url) + (("--token", token) if token else ())
        result = gpush(*prefix, *args)
        assert result.code == 0, result.err
        return result

    for name in ("slurm-a", "k8s-a"):
        run("cluster", "add", name, "--kind", "sim", "--fleet", FLEET)
    run("policy", "apply", POLICY, "-m", "demo")
    alice = run("admin", "token", "create", "--user", "alice", "--tenant", "nlp").out.strip()
    bob = run("admin", "token", "create", "--user", "bob", "--tenant", "vision").out.strip()
    ids = {}

    def submit(name, *args, token=None):
        ids[name] = int(run("submit", "--name", name, "-l", DAY, *args, token=token).out)

    submit("llama-pretrain", "--kind", "training", "--isolation", "exclusive", "--gpus", "2", "--", "torchrun")
    submit("gang-pretrain", "--kind", "training", "-N", "2", "--gpus", "2", "--", "torchrun")
    submit("bert-finetune", "--kind", "training", "--isolation", "hardware", "--gpu-memory-gb", "10", "--", "t")
    submit("too-big", "--kind", "training", "--gpus", "16", "--", "huge")
    elastic = ("--min-replicas", "2", "--max-replicas", "8")
    submit("chat-serve", "--kind", "inference", "--isolation", "none", "--gpu-memory-gb", "3", *elastic, "--", "s")
    submit(
        "small-serve", "--kind", "inference", "--isolation", "process", "--gpu-memory-gb", "2", "--", "s", token=alice
    )
    for shard in range(3):
        submit(f"shard-{shard}", "--kind", "batch", "--isolation", "none", "--gpu-memory-gb", "3", "--", "e", token=bob)
    submit("tiny-mig", "--kind", "training", "--isolation", "hardware", "--gpu-memory-gb", "4", "--", "t", token=bob)
    run("scheduler", "run", "--cycles", "2")
    return run, ids, {"alice": alice, "bob": bob}


def views(run, http, sessions, since=None) -> dict[str, dict]:
    """Each view's figures: per job, per tenant, per cluster, per node (GPU-hours as a
    rate, from ``since``)."""
    out: dict[str, dict] = {}
    listed = run("list", "-A", "--json").json["jobs"]
    out["list"] = {j["name"]: j["gpu_equivalents"] for j in listed if j["state"] == "running"}
    out["status"] = {
        j["name"]: run("status", str(j["id"]), "--json").json["gpu_equivalents"]
        for j in listed
        if j["state"] == "running"
    }
    admin = http(user="root", tenant="ops", role="admin")
    api_jobs = admin.get("/v1/jobs", params={"all": "true", "limit": 100}).json()["jobs"]
    out["dashboard queue"] = {j["name"]: j["gpu_equivalents"] for j in api_jobs if j["state"] == "running"}
    with sessions() as session, session.begin():
        now = utcnow() + timedelta(hours=1)
        usage = job_usage(session, ADMIN, since=since, until=now)
    names = {j["id"]: j["name"] for j in listed}
    out["usage rate"] = {names[u.job_id]: u.gpu_seconds / u.run_seconds for u in usage if u.run_seconds}

    tenants = {t["name"]: t["gpu_used"] for t in run("tenant", "list", "--json").json}
    out["tenant list"] = {"total": sum(tenants.values()), **tenants}
    out["dashboard tenants"] = {t["name"]: t["gpu_used"] for t in admin.get("/v1/tenants").json()}
    clusters = run("cluster", "list", "--json").json
    out["cluster list"] = {
        c["name"]: sum(s["gpu_total"] - s["gpu_free"] for s in c["capacity"].values()) for c in clusters
    }
    inventory = run("inventory", "--json").json
    out["inventory clusters"] = {c["name"]: c["totals"]["allocated"] for c in inventory["clusters"]}
    out["inventory nodes"] = {
        n["name"]: n["allocated_gpu_equivalents"] for c in inventory["clusters"] for n in c["nodes"]
    }
    by_node: dict[str, float] = defaultdict(float)
    by_cluster: dict[str, float] = defaultdict(float)
    for held in admin.get("/v1/inventory/occupancy").json():
        by_cluster[held["cluster"]] += held["gpu_equivalents"]
        by_node[held["node"]] += held["gpu_equivalents"]
    out["occupancy clusters"], out["occupancy nodes"] = dict(by_cluster), dict(by_node)
    return out


def agree(figures: dict[str, dict], expected: dict[str, float]) -> None:
    for view in ("list", "status", "dashboard queue", "usage rate"):
        assert figures[view] == pytest.approx(expected), view
    by_tenant = {"default": 0.0, "nlp": 0.0, "vision": 0.0}
    tenant_of = {"chat-serve": "default", "small-serve": "nlp", "tiny-mig": "vision"}
    for name, held in expected.items():
        by_tenant[tenant_of.get(name, "vision" if name.startswith("shard") else "default")] += held
    assert figures["tenant list"] == pytest.approx({"total": sum(expected.values()), **by_tenant})
    assert figures["dashboard tenants"] == pytest.approx(by_tenant)
    # The clusters' allocated capacity is what the jobs hold: rounded as shown (4 places).
    for view in ("cluster list", "inventory clusters"):
        assert figures[view] == pytest.approx(figures["occupancy clusters"], abs=1e-4), view
    assert sum(figures["cluster list"].values()) == pytest.approx(sum(expected.values()), abs=1e-4)
    nodes = {n: v for n, v in figures["inventory nodes"].items() if v}
    assert nodes == pytest.approx({n: v for n, v in figures["occupancy nodes"].items() if n}, abs=1e-4)


def test_every_view_counts_what_a_job_holds_alike(demo, http, sessions):
    run, ids, _tokens = demo
    agree(views(run, http, sessions), EXPECTED)

    # Scaled to 4 replicas, the elastic job holds 4 quarter GPUs, in every view at once.
    run("scale", str(ids["chat-serve"]), "4")
    scaled = utcnow()
    run("scheduler", "run", "--cycles", "1")
    agree(views(run, http, sessions, since=scaled), {**EXPECTED, "chat-serve": 1.0})


def test_a_gang_holds_its_per_node_figure_on_each_of_its_nodes(demo, http):
    run, ids, _tokens = demo
    gang = run("status", str(ids["gang-pretrain"]), "--json").json
    assert gang["state"] == "running" and len(gang["placement"]["nodes"]) == 2
    admin = http(user="root", tenant="ops", role="admin")
    held = {
        e["node"]: e["gpu_equivalents"] for e in admin.get("/v1/inventory/occupancy").json() if e["job"] == gang["id"]
    }
    assert held == dict.fromkeys(gang["placement"]["nodes"], 2.0)
    listed = run("list", "-A").out
    assert "2x2 A100" in listed
    first, second = gang["placement"]["nodes"]
    shown = " ".join(run("status", str(ids["gang-pretrain"])).out.split())
    assert f"node 0 {first}: rank 0 (rendezvous) node 1 {second}: rank 1" in shown
    # The dashboard reads the same words and nodes from the API.
    api = next(j for j in admin.get("/v1/jobs", params={"limit": 100}).json()["jobs"] if j["id"] == gang["id"])
    assert api["gpu_request"] == "2x2 A100"
    assert [(n["node"], n["first_rank"], n["rendezvous"]) for n in api["gang"]["nodes"]] == [
        (first, 0, True),
        (second, 1, False),
    ]


def test_a_user_sees_the_same_shares_as_an_admin_with_other_tenants_unnamed(demo, http):
    run, _ids, tokens = demo
    admin = {t["name"]: t for t in http(user="root", tenant="ops", role="admin").get("/v1/tenants").json()}
    assert set(admin) == {"default", "nlp", "vision"}
    held = sum(t["gpu_used"] for t in admin.values())
    assert admin["nlp"]["gpu_share"] == pytest.approx(0.05 / held)
    assert admin["nlp"]["fair_share"] == pytest.approx(1 / 3)

    for seen in (
        http(token=tokens["alice"]).get("/v1/tenants").json(),
        run("tenant", "list", "--json", token=tokens["alice"]).json,
    ):
        mine, others = seen
        assert mine == {**admin["nlp"], "others": 0}
        assert others["name"] == "(other tenants)" and others["others"] == 2
        assert others["gpu_used"] == pytest.approx(admin["default"]["gpu_used"] + admin["vision"]["gpu_used"])
        assert others["weight"] == 2 and others["fair_share"] == pytest.approx(2 / 3)
        assert others["gpu_share"] + mine["gpu_share"] == pytest.approx(1)
        assert others["jobs_running"] == admin["default"]["jobs_running"] + admin["vision"]["jobs_running"]
        assert "default" not in str(seen) and "vision" not in str(seen)

    table = run("tenant", "list", token=tokens["alice"]).out
    assert "nlp" in table and "(other tenants)" in table and "vision" not in table
    nlp = next(line.split() for line in table.splitlines() if line.startswith("nlp"))
    assert nlp[1:3] == ["1", "33%"] and nlp[4:6] == ["0.05", f"{0.05 / held:.0%}"]
