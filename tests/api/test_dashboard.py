"""The dashboard's routes (broker.api.dashboard) and the endpoints added for it: the page
for a browser and the JSON index for anything else, its assets with their security
headers, the job counts by state, who holds the capacity, and a policy's diff before it
is applied. The page itself is tested in a real browser (integration/test_web.py)."""

from __future__ import annotations

import re
from pathlib import Path

from broker.api.dashboard import ASSETS, CSP
from broker.core.models import Job

JOB = {"kind": "training", "gpus": 1, "command": ["python", "train.py"]}


def test_a_browser_gets_the_page_and_anything_else_the_json_index(http):
    client = http(token=None)
    page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.headers["content-security-policy"] == CSP
    assert page.headers["x-frame-options"] == "DENY"
    assert '<script type="module" src="/ui/app.js">' in page.text
    assert page.headers["vary"] == "Accept"
    index = client.get("/")
    assert index.json()["docs"] == "/docs" and index.headers["vary"] == "Accept"
    assert client.head("/", headers={"Accept": "text/html"}).status_code == 200


def test_the_assets_are_served_from_the_package_with_an_etag_and_nothing_else_is(http):
    client = http(token=None)
    assert set(ASSETS) >= {"index.html", "app.js", "style.css", "favicon.svg"}
    script = client.get("/ui/app.js")
    assert script.headers["content-type"].startswith("text/javascript")
    assert client.get("/ui/app.js", headers={"If-None-Match": script.headers["etag"]}).status_code == 304
    assert client.get("/ui/nothing.js").status_code == 404
    assert client.get("/ui/..%2Fapp.py").status_code == 404
    for data, _type, _etag in ASSETS.values():  # nothing from a CDN: an air-gapped site gets the same page
        assert not re.search(rb"https?://(?!www\.w3\.org/2000/svg)", data)


def test_job_counts_by_state_follow_the_filters_and_the_callers_tenant(http):
    alice = http(user="alice", tenant="ml")
    bob = http(user="bob", tenant="cv")
    for _ in range(3):
        alice.post("/v1/jobs", json=JOB)
    bob.post("/v1/jobs", json={**JOB, "kind": "inference", "isolation": "none", "gpu_memory_gb": 4})
    assert alice.get("/v1/jobs:count").json() == {"by_state": {"queued": 3}, "total": 3}
    assert alice.get("/v1/jobs:count", params={"tenant": "cv"}).json() == {"by_state": {}, "total": 0}
    admin = http(user="root", tenant="ops", role="admin")
    assert admin.get("/v1/jobs:count").json()["total"] == 4
    assert admin.get("/v1/jobs:count", params={"kind": "inference"}).json()["total"] == 1
    assert admin.get("/v1/jobs:count", params={"kind": "nonsense"}).status_code == 422


def test_the_queue_filters_by_cluster(http, sessions):
    alice = http(user="alice", tenant="ml")
    ids = [alice.post("/v1/jobs", json=JOB).json()["id"] for _ in range(2)]
    with sessions() as session, session.begin():
        session.get(Job, ids[0]).cluster = "slurm-a"
    listed = alice.get("/v1/jobs", params={"cluster": "slurm-a"}).json()["jobs"]
    assert [j["id"] for j in listed] == [ids[0]]
    assert alice.get("/v1/jobs:count", params={"cluster": "slurm-a"}).json()["total"] == 1


def test_occupancy_names_ones_own_jobs_and_hides_other_tenants(http, sessions):
    alice = http(user="alice", tenant="ml")
    bob = http(user="bob", tenant="cv")
    mine = alice.post("/v1/jobs", json={**JOB, "name": "mine"}).json()["id"]
    theirs = bob.post("/v1/jobs", json={**JOB, "name": "secret"}).json()["id"]
    waiting = alice.post("/v1/jobs", json=JOB).json()["id"]
    placement = {
        "cluster": "slurm-a",
        "sharing": "slurm/mig",
        "node": "mig-01",
        "mig_profile": "3g.20gb",
        "units": 1,
        "replicas": 1,
        "gpu_equivalents": 3 / 7,
        "gpus": [1],
    }
    with sessions() as session, session.begin():
        for job_id in (mine, theirs):
            job = session.get(Job, job_id)
            job.state, job.cluster, job.placement = "running", "slurm-a", placement
    held = alice.get("/v1/inventory/occupancy").json()
    assert [h["job"] for h in held] == [mine, None]  # the waiting job holds nothing
    assert held[0]["tenant"] == "ml" and held[0]["name"] == "mine" and held[0]["gpus"] == [1]
    assert held[1]["tenant"] == "(another tenant)" and held[1]["user"] is None and held[1]["name"] is None
    assert "secret" not in alice.get("/v1/inventory/occupancy").text
    admin = http(user="root", tenant="ops", role="admin")
    assert [h["tenant"] for h in admin.get("/v1/inventory/occupancy").json()] == ["ml", "cv"]
    assert admin.get("/v1/inventory/occupancy", params={"cluster": "k8s-a"}).json() == []
    assert waiting


def test_validate_shows_what_applying_would_change(http):
    admin = http(user="root", tenant="ops", role="admin")
    text = "rules:\n  - name: all\n    match: {}\n    route: {cluster: slurm-a, sharing: slurm/exclusive}\n"
    first = admin.post("/v1/policy:validate", json={"text": text}).json()
    assert first["diff"].startswith("--- no policy\n+++ new policy")
    fleet = str(Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml")
    registered = admin.post("/v1/clusters", json={"name": "slurm-a", "kind": "sim", "config": {"fleet": fleet}})
    assert registered.status_code == 201, registered.text
    assert admin.post("/v1/policy", json={"text": text, "comment": "one"}).status_code == 201
    same = admin.post("/v1/policy:validate", json={"text": text}).json()
    assert same["diff"] == ""
    changed = admin.post("/v1/policy:validate", json={"text": text.replace("all", "every")}).json()
    assert "-  - name: all\n+  - name: every" in changed["diff"]
    assert "version 1 (active)" in changed["diff"]
