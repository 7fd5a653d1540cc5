"""The REST API as clients see it: status codes, bodies, idempotency, tenants, pages."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from broker.core.auth import hash_token
from broker.core.models import ApiToken, Job, JobEvent
from broker.core.states import JobState, set_state

TRAIN = {"kind": "training", "gpus": 2, "command": ["python", "train.py"]}
INFER = {"kind": "inference", "gpu_memory_gb": 8, "elastic": {"min_replicas": 1, "max_replicas": 4}, "image": "serve:1"}


def count_jobs(sessions) -> int:
    with sessions() as session:
        return session.scalar(select(func.count()).select_from(Job))


def move(sessions, clock, job_id: int, *path: JobState) -> None:
    """Drive a job along ``path`` as the scheduler and adapters will."""
    with sessions() as session, session.begin():
        for frm, to in zip(path, path[1:]):
            set_state(session, job_id, frm, to, reason=f"test: {to.value}", now=clock())


# -- health and auth --------------------------------------------------------------


def test_health_endpoints_need_no_token(http):
    client = http(token=None)
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").status_code == 200
    assert client.get("/openapi.json").json()["paths"]["/v1/jobs:batch"]


@pytest.mark.parametrize("header", [None, "Bearer nope", "Basic abc", "Bearer "])
def test_every_other_endpoint_needs_a_valid_token(http, header):
    client = http(token=None)
    headers = {"Authorization": header} if header else {}
    for method, path in [
        ("GET", "/v1/jobs"),
        ("POST", "/v1/jobs"),
        ("GET", "/v1/jobs/1"),
        ("GET", "/v1/jobs/1/events"),
        ("POST", "/v1/jobs/1/cancel"),
        ("GET", "/v1/whoami"),
        ("GET", "/v1/admin/tokens"),
    ]:
        response = client.request(method, path, headers=headers, json=TRAIN if method == "POST" else None)
        assert response.status_code == 401, (method, path)
        assert response.headers["WWW-Authenticate"] == "Bearer"
        assert "token" in response.json()["error"]["message"]


def test_revoked_token_stops_working(http, make_token):
    admin = http(role="admin")
    token = make_token(user="carol", tenant="ml")
    carol = http(token=token)
    assert carol.get("/v1/whoami").json() == {"user": "carol", "tenant": "ml", "role": "user"}
    (row,) = [t for t in admin.get("/v1/admin/tokens").json() if t["user"] == "carol"]
    assert "token" not in row and token.startswith(row["prefix"])
    assert admin.post(f"/v1/admin/tokens/{row['id']}/revoke").json()["revoked_at"]
    assert carol.get("/v1/whoami").status_code == 401


def test_tokens_are_stored_hashed(http, sessions):
    created = http(role="admin").post("/v1/admin/tokens", json={"user": "dan", "tenant": "ml"}).json()
    with sessions() as session:
        stored = session.execute(select(ApiToken.token_hash)).scalars().all()
    assert created["token"] not in stored
    assert hash_token(created["token"]) in stored


def test_only_admins_manage_tokens(http):
    user = http(user="alice", tenant="ml")
    response = user.post("/v1/admin/tokens", json={"user": "eve", "tenant": "ml", "role": "admin"})
    assert response.status_code == 403
    assert "admin" in response.json()["error"]["message"]
    assert user.get("/v1/admin/tokens").status_code == 403


# -- submit -----------------------------------------------------------------------


def test_submit_queues_the_job_with_its_owner_and_an_event(http):
    client = http(user="alice", tenant="ml")
    response = client.post("/v1/jobs", json={**TRAIN, "name": "resnet", "time_limit": "2h", "memory": "32GiB"})
    assert response.status_code == 201
    job = response.json()
    assert (job["state"], job["tenant"], job["user"], job["kind"], job["isolation"]) == (
        "queued",
        "ml",
        "alice",
        "training",
        "exclusive",
    )
    assert job["spec"]["time_limit"] == "02:00:00" and job["spec"]["memory"] == "32G"
    assert client.get(f"/v1/jobs/{job['id']}").json() == job
    (event,) = client.get(f"/v1/jobs/{job['id']}/events").json()
    assert (event["from_state"], event["to_state"], event["actor"]) == (None, "queued", "alice")


def test_invalid_job_is_422_with_field_path_and_nothing_is_written(http, sessions):
    client = http()
    response = client.post("/v1/jobs", json={"kind": "training", "gpus": -1, "isolation": "mig", "command": ["x"]})
    assert response.status_code == 422
    error = response.json()["error"]
    fields = {d["field"]: d for d in error["details"]}
    assert fields["gpus"]["value"] == -1 and "greater than or equal to 1" in fields["gpus"]["message"]
    assert fields["isolation"]["value"] == "mig" and "'exclusive'" in fields["isolation"]["message"]
    assert "gpus = -1" in error["message"]
    assert count_jobs(sessions) == 0


def test_non_json_body_is_refused(http):
    response = http().post("/v1/jobs", content=b"kind: training", headers={"Content-Type": "application/json"})
    assert response.status_code == 422


def test_idempotent_replay_returns_the_stored_job_and_a_changed_spec_is_409(http, sessions):
    client = http()
    body = {**TRAIN, "idempotency_key": "run-7"}
    first = client.post("/v1/jobs", json=body)
    again = client.post("/v1/jobs", json=body)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    # Equivalent spellings are the same request.
    assert client.post("/v1/jobs", json={**body, "gpus": 2, "cpus": 1}).status_code == 200
    changed = client.post("/v1/jobs", json={**body, "gpus": 4})
    assert changed.status_code == 409
    assert "run-7" in changed.json()["error"]["message"]
    assert count_jobs(sessions) == 1


def test_idempotency_key_header(http):
    client = http()
    a = client.post("/v1/jobs", json=TRAIN, headers={"Idempotency-Key": "hdr-1"})
    b = client.post("/v1/jobs", json=TRAIN, headers={"Idempotency-Key": "hdr-1"})
    assert (a.status_code, b.status_code, a.json()["id"]) == (201, 200, b.json()["id"])
    assert a.json()["spec"]["idempotency_key"] == "hdr-1"
    clash = client.post("/v1/jobs", json={**TRAIN, "idempotency_key": "x"}, headers={"Idempotency-Key": "y"})
    assert clash.status_code == 422


def test_idempotency_keys_are_per_tenant(http):
    ml, vision = http(tenant="ml"), http(user="bob", tenant="vision")
    a = ml.post("/v1/jobs", json={**TRAIN, "idempotency_key": "k"}).json()
    b = vision.post("/v1/jobs", json={**TRAIN, "gpus": 1, "idempotency_key": "k"})
    assert b.status_code == 201 and b.json()["id"] != a["id"]


def test_users_submit_only_for_themselves_admins_for_anyone(http):
    user = http(user="alice", tenant="ml")
    assert user.post("/v1/jobs", json={**TRAIN, "tenant": "vision"}).status_code == 403
    assert user.post("/v1/jobs", json={**TRAIN, "user": "bob"}).status_code == 403
    admin = http(user="root", tenant="ops", role="admin")
    job = admin.post("/v1/jobs", json={**TRAIN, "tenant": "vision", "user": "bob"}).json()
    assert (job["tenant"], job["user"]) == ("vision", "bob")


# -- batch ------------------------------------------------------------------------


def test_batch_queues_all_jobs_in_order(http, sessions):
    client = http()
    jobs = [{**TRAIN, "name": f"j{i}"} for i in range(5)] + [INFER]
    response = client.post("/v1/jobs:batch", json={"jobs": jobs})
    assert response.status_code == 201
    body = response.json()
    assert body["created"] == 6
    ids = [j["id"] for j in body["jobs"]]
    assert ids == sorted(ids)
    assert [client.get(f"/v1/jobs/{i}").json()["name"] for i in ids[:5]] == [f"j{i}" for i in range(5)]
    assert count_jobs(sessions) == 6


def test_batch_is_all_or_nothing_on_an_invalid_job(http, sessions):
    jobs = [TRAIN, TRAIN, {**TRAIN, "gpus": 0}, TRAIN]
    response = http().post("/v1/jobs:batch", json={"jobs": jobs})
    assert response.status_code == 422
    (detail,) = response.json()["error"]["details"]
    assert detail["field"] == "jobs.2.gpus"
    assert count_jobs(sessions) == 0


def test_batch_is_all_or_nothing_on_a_conflicting_key(http, sessions):
    client = http()
    client.post("/v1/jobs", json={**TRAIN, "idempotency_key": "taken"})
    response = client.post("/v1/jobs:batch", json={"jobs": [TRAIN, {**TRAIN, "gpus": 8, "idempotency_key": "taken"}]})
    assert response.status_code == 409
    assert count_jobs(sessions) == 1


def test_batch_replay_and_duplicates_within_a_batch(http, sessions):
    client = http()
    jobs = [{**TRAIN, "idempotency_key": "a"}, {**TRAIN, "idempotency_key": "b"}, {**TRAIN, "idempotency_key": "a"}]
    first = client.post("/v1/jobs:batch", json={"jobs": jobs}).json()
    assert first["created"] == 2
    assert first["jobs"][0]["id"] == first["jobs"][2]["id"] and first["jobs"][2]["created"] is False
    replay = client.post("/v1/jobs:batch", json={"jobs": jobs})
    assert replay.status_code == 200 and replay.json()["created"] == 0
    assert [j["id"] for j in replay.json()["jobs"]] == [j["id"] for j in first["jobs"]]
    clash = client.post(
        "/v1/jobs:batch",
        json={"jobs": [{**TRAIN, "idempotency_key": "c"}, {**TRAIN, "gpus": 3, "idempotency_key": "c"}]},
    )
    assert clash.status_code == 422 and "different specs" in clash.json()["error"]["message"]
    assert count_jobs(sessions) == 2


def test_empty_batch_is_refused(http):
    assert http().post("/v1/jobs:batch", json={"jobs": []}).status_code == 422


# -- read -------------------------------------------------------------------------


def test_tenants_see_only_their_jobs_and_others_are_not_found(http):
    alice, bob = http(user="alice", tenant="ml"), http(user="bob", tenant="vision")
    admin = http(user="root", tenant="ops", role="admin")
    mine = alice.post("/v1/jobs", json=TRAIN).json()["id"]
    theirs = bob.post("/v1/jobs", json=TRAIN).json()["id"]
    assert [j["id"] for j in alice.get("/v1/jobs").json()["jobs"]] == [mine]
    assert alice.get("/v1/jobs", params={"tenant": "vision"}).json()["jobs"] == []
    for method, path in [
        ("GET", f"/v1/jobs/{theirs}"),
        ("GET", f"/v1/jobs/{theirs}/events"),
        ("POST", f"/v1/jobs/{theirs}/cancel"),
    ]:
        response = alice.request(method, path)
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found"
    assert bob.get(f"/v1/jobs/{theirs}").json()["state"] == "queued"
    assert {j["id"] for j in admin.get("/v1/jobs").json()["jobs"]} == {mine, theirs}
    assert [j["id"] for j in admin.get("/v1/jobs", params={"tenant": "vision"}).json()["jobs"]] == [theirs]


def test_missing_job_is_404(http):
    response = http().get("/v1/jobs/99999")
    assert response.status_code == 404 and "99999" in response.json()["error"]["message"]


def test_list_filters_and_pages_newest_first(http, sessions, clock):
    client = http(user="alice", tenant="ml", role="admin")
    ids = []
    for i in range(7):
        body = INFER if i % 3 == 0 else TRAIN
        ids.append(client.post("/v1/jobs", json={**body, "user": "bob" if i == 6 else "alice"}).json()["id"])
        clock.advance(1)
    move(sessions, clock, ids[1], JobState.QUEUED, JobState.HELD)
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 3, **({"cursor": cursor} if cursor else {})}).json()
        assert len(page["jobs"]) <= 3
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if not cursor:
            break
    assert seen == ids[::-1]
    assert [j["id"] for j in client.get("/v1/jobs", params={"kind": "inference"}).json()["jobs"]] == [
        ids[6],
        ids[3],
        ids[0],
    ]
    assert [j["id"] for j in client.get("/v1/jobs", params={"state": "held"}).json()["jobs"]] == [ids[1]]
    both = client.get("/v1/jobs", params=[("state", "held"), ("state", "queued")]).json()["jobs"]
    assert len(both) == 7
    assert len(client.get("/v1/jobs", params={"state": "held,queued"}).json()["jobs"]) == 7
    assert [j["id"] for j in client.get("/v1/jobs", params={"user": "bob"}).json()["jobs"]] == [ids[6]]


@pytest.mark.parametrize(
    "params,field",
    [
        ({"state": "sleeping"}, "state"),
        ({"cursor": "garbage!"}, "cursor"),
        ({"limit": 0}, "limit"),
        ({"limit": 5000}, "limit"),
        ({"kind": "x"}, "kind"),
    ],
)
def test_bad_list_parameters_are_422(http, params, field):
    response = http().get("/v1/jobs", params=params)
    assert response.status_code == 422
    assert response.json()["error"]["details"][0]["field"].endswith(field)


# -- cancel -----------------------------------------------------------------------


def test_cancel_of_a_queued_job_ends_it_at_once(http):
    client = http(user="alice")
    job_id = client.post("/v1/jobs", json=TRAIN).json()["id"]
    result = client.post(f"/v1/jobs/{job_id}/cancel").json()
    assert result["outcome"] == "cancelled" and result["job"]["state"] == "cancelled"
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert [(e["from_state"], e["to_state"], e["actor"]) for e in events] == [
        (None, "queued", "alice"),
        ("queued", "cancelled", "alice"),
    ]
    again = client.post(f"/v1/jobs/{job_id}/cancel").json()
    assert again["outcome"] == "already_finished" and len(client.get(f"/v1/jobs/{job_id}/events").json()) == 2


@pytest.mark.parametrize(
    "path",
    [
        (JobState.QUEUED, JobState.ROUTED, JobState.SUBMITTING),
        (JobState.QUEUED, JobState.ROUTED, JobState.SUBMITTING, JobState.SUBMITTED),
        (JobState.QUEUED, JobState.ROUTED, JobState.SUBMITTING, JobState.SUBMITTED, JobState.RUNNING),
    ],
)
def test_cancel_of_a_job_on_a_cluster_records_the_intent(http, sessions, clock, path):
    client = http()
    job_id = client.post("/v1/jobs", json=TRAIN).json()["id"]
    move(sessions, clock, job_id, *path)
    clock.advance(5)
    result = client.post(f"/v1/jobs/{job_id}/cancel").json()
    assert result["outcome"] == "cancel_requested"
    assert result["job"]["state"] == path[-1].value
    assert result["job"]["cancel_requested_at"] is not None
    last = client.get(f"/v1/jobs/{job_id}/events").json()[-1]
    assert (last["type"], last["to_state"]) == ("cancel_requested", path[-1].value)
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["outcome"] == "already_requested"


@pytest.mark.parametrize(
    "path",
    [
        (JobState.QUEUED, JobState.HELD),
        (JobState.QUEUED, JobState.ROUTED),
    ],
)
def test_cancel_of_held_or_routed_jobs_ends_them(http, sessions, clock, path):
    client = http()
    job_id = client.post("/v1/jobs", json=TRAIN).json()["id"]
    move(sessions, clock, job_id, *path)
    assert client.post(f"/v1/jobs/{job_id}/cancel").json()["job"]["state"] == "cancelled"


def test_events_count_matches_what_happened(http, sessions, clock):
    client = http()
    job_id = client.post("/v1/jobs", json=TRAIN).json()["id"]
    move(
        sessions,
        clock,
        job_id,
        JobState.QUEUED,
        JobState.ROUTED,
        JobState.SUBMITTING,
        JobState.SUBMITTED,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    )
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert [e["to_state"] for e in events] == ["queued", "routed", "submitting", "submitted", "running", "succeeded"]
    with sessions() as session:
        # The submission is the job's row; each later change is one stored event.
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 5


# -- the SDK ----------------------------------------------------------------------


def test_sdk_round_trip_and_typed_errors(sdk):
    from broker.core.errors import Conflict, InvalidRequest, NotAllowed, NotFound

    client = sdk(user="alice", tenant="ml")
    job = client.submit(TRAIN, idempotency_key="sdk-1")
    assert client.submit(TRAIN, idempotency_key="sdk-1").id == job.id
    with pytest.raises(Conflict):
        client.submit({**TRAIN, "gpus": 1}, idempotency_key="sdk-1")
    with pytest.raises(InvalidRequest) as err:
        client.submit({**TRAIN, "cpus": 0})
    assert err.value.details[0]["field"] == "cpus"
    with pytest.raises(NotFound):
        client.get(123456)
    with pytest.raises(NotAllowed):
        client.list_tokens()
    assert [j.id for j in client.iter_jobs(limit=1)] == [job.id]
    assert client.cancel(job.id)["outcome"] == "cancelled"
    # Without a key the SDK makes one, so its own retries cannot double a job.
    auto = client.submit(TRAIN)
    assert auto.spec["idempotency_key"].startswith("auto-")
