"""GPU-hours from the job events (broker.accounting.usage): each sharing mode's
GPU-equivalents, runs split by requeues and scaling, windows, tenants' totals as the sum
of their jobs, the API's scope, the CLI's table and CSV, and the Prometheus counter."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import generate_latest

from broker.accounting.metrics import GpuSeconds
from broker.accounting.usage import UsageLedger, job_usage, per_replica, summarize
from broker.core.auth import Principal
from broker.core.models import Job, JobEvent
from broker.core.schemas import JobSpec, Role
from broker.core.states import set_state
from broker.intake import queue

T0 = datetime(2026, 1, 5, 9, 0, tzinfo=UTC)
ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
MIG = {
    "cluster": "slurm-a",
    "sharing": "slurm/mig",
    "units": 1,
    "gpu_equivalents": 3 / 7,
    "mig_profile": "3g.20gb",
    "gpu_model": "A100-SXM4-40GB",
    "replicas": 1,
    "node": "mig-01",
}
MPS = {"cluster": "slurm-a", "sharing": "slurm/mps", "units": 25, "gpu_equivalents": 0.25, "replicas": 1}
SLICED = {
    "cluster": "k8s-a",
    "sharing": "k8s/timeslice",
    "units": 1,
    "gpu_equivalents": 0.5,
    "gpu_model": "T4",
    "gpu_memory_gb": 4.0,
    "replicas": 2,
}
WHOLE = {"cluster": "slurm-a", "sharing": "slurm/exclusive", "units": 4, "gpu_equivalents": 4.0, "replicas": 1}


def test_each_sharing_mode_counts_what_it_takes_of_a_gpu():
    assert per_replica(MIG) == pytest.approx(3 / 7)
    assert per_replica(MPS) == 0.25
    # A time-slice replica holds its replica of the GPU (a T4 split 4 ways: 1/4), whatever
    # memory it asks for: the figure the ledger, tenants and the inventory count.
    assert per_replica(SLICED) == 0.25
    assert per_replica({**SLICED, "gpu_memory_gb": 3.0}) == 0.25
    assert per_replica({**SLICED, "gpu_memory_gb": None}) == 0.25
    assert per_replica(WHOLE) == 4


def submit(sessions, tenant="ml", user="alice", kind="training") -> int:
    spec = JobSpec.model_validate({"kind": kind, "gpus": 1, "command": ["x"], "tenant": tenant, "user": user})
    with sessions() as session, session.begin():
        (result,) = queue.submit_jobs(session, [spec], ADMIN, now=T0)
    return result.job["id"]


def run(sessions, job_id: int, placement: dict, *steps: tuple[float, str]) -> None:
    """Place the job, then move it through ``steps`` (minutes after T0, state)."""
    with sessions() as session, session.begin():
        job = session.get(Job, job_id)
        job.placement, job.cluster = placement, placement["cluster"]
        state = "queued"
        for to in ("routed", "submitting", "submitted"):
            set_state(session, job_id, state, to, reason=None, now=T0)
            state = to
        for minutes, to in steps:
            if to == "scaled":
                continue
            set_state(session, job_id, state, to, reason=None, now=T0 + timedelta(minutes=minutes))
            state = to


def scale(sessions, job_id: int, minutes: float, old: int, new: int) -> None:
    with sessions() as session, session.begin():
        session.add(
            JobEvent(
                job_id=job_id,
                at=T0 + timedelta(minutes=minutes),
                type="scaled",
                from_state="running",
                to_state="running",
                reason=f"scaled from {old} to {new} replicas by ray",
            )
        )
        job = session.get(Job, job_id)
        # As gpush scale writes it: the replicas and what they hold together.
        held = job.placement["gpu_equivalents"] / old * new
        job.placement, job.gpu_equivalents = {**job.placement, "replicas": new, "gpu_equivalents": held}, held


@pytest.fixture
def history(sessions):
    jobs = {
        name: submit(sessions, tenant=t, user=u)
        for name, t, u in (
            ("mig", "ml", "alice"),
            ("mps", "ml", "bob"),
            ("sliced", "cv", "carol"),
            ("whole", "cv", "carol"),
        )
    }
    run(sessions, jobs["mig"], MIG, (0, "running"), (60, "succeeded"))  # 3/7 GPU for 1 h
    run(sessions, jobs["mps"], MPS, (0, "running"), (30, "requeued"), (30, "queued"))  # 0.25 for 30 min
    with sessions() as session, session.begin():  # ... then again, 30 min more
        for frm, to in (("queued", "routed"), ("routed", "submitting"), ("submitting", "submitted")):
            set_state(session, jobs["mps"], frm, to, reason=None, now=T0 + timedelta(minutes=40))
        set_state(session, jobs["mps"], "submitted", "running", reason=None, now=T0 + timedelta(minutes=60))
        set_state(session, jobs["mps"], "running", "succeeded", reason=None, now=T0 + timedelta(minutes=90))
    run(sessions, jobs["sliced"], {**SLICED, "replicas": 2}, (0, "running"))  # still running
    scale(sessions, jobs["sliced"], 60, 2, 4)  # 2 replicas for 1 h, then 4
    run(sessions, jobs["whole"], WHOLE, (30, "running"), (150, "failed"))  # 4 GPUs for 2 h
    return jobs


def test_usage_follows_runs_requeues_scaling_and_windows(sessions, history):
    until = T0 + timedelta(hours=2)
    with sessions() as session:
        usage = {u.job_id: u for u in job_usage(session, ADMIN, since=None, until=until)}
    hours = {name: usage[job_id].gpu_seconds / 3600 for name, job_id in history.items()}
    assert hours["mig"] == pytest.approx(3 / 7)
    assert hours["mps"] == pytest.approx(0.25 * 1.0)  # two runs of 30 min
    assert hours["sliced"] == pytest.approx(0.25 * 2 * 1 + 0.25 * 4 * 1)  # running: counted up to `until`
    assert hours["whole"] == pytest.approx(4 * 1.5)  # from 0:30 to the window's end at 2:00
    with sessions() as session:  # the second hour only
        window = {u.job_id: u for u in job_usage(session, ADMIN, since=T0 + timedelta(hours=1), until=until)}
    assert history["mig"] not in window  # ended as the window began
    assert window[history["whole"]].gpu_seconds / 3600 == pytest.approx(4)


def test_a_tenants_total_is_the_sum_of_its_jobs_and_a_user_sees_their_tenant(sessions, history):
    until = T0 + timedelta(hours=3)
    with sessions() as session:
        jobs = job_usage(session, ADMIN, since=None, until=until)
        mine = job_usage(session, Principal(user="alice", tenant="ml", role=Role.USER), since=None, until=until)
    rows = {r["tenant"]: r for r in summarize(jobs, ["tenant"])}
    for tenant in ("ml", "cv"):
        assert rows[tenant]["gpu_hours"] == pytest.approx(sum(j.gpu_seconds for j in jobs if j.tenant == tenant) / 3600)
    assert {j.tenant for j in mine} == {"ml"}
    by_sharing = {r["sharing"]: r["gpu_hours"] for r in summarize(jobs, ["sharing"])}
    assert set(by_sharing) == {"slurm/mig", "slurm/mps", "k8s/timeslice", "slurm/exclusive"}


def test_the_prometheus_counter_matches_the_report_and_never_goes_down(sessions, engine, history):
    until = T0 + timedelta(hours=3)
    ledger = UsageLedger()
    with sessions() as session:
        totals = ledger.update(session, until)
        jobs = job_usage(session, ADMIN, since=None, until=until)
    for (tenant, cluster, sharing), seconds in totals.items():
        expected = sum(j.gpu_seconds for j in jobs if (j.tenant, j.cluster, j.sharing) == (tenant, cluster, sharing))
        assert seconds == pytest.approx(expected)
    with sessions() as session:  # an earlier "now" (a late event) takes nothing back
        assert ledger.update(session, until - timedelta(hours=1)) == totals
    text = generate_latest(_registry(GpuSeconds(engine))).decode()
    assert 'gpush_gpu_equivalent_seconds_total{cluster="slurm-a",sharing="slurm/mig",tenant="ml"}' in text


def _registry(collector):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(collector)
    return registry


def test_the_api_and_the_cli(http, gpush, database_url, history):
    admin = http(user="root", tenant="ops", role="admin")
    until = (T0 + timedelta(hours=2)).isoformat()
    answer = admin.get("/v1/usage", params={"until": until, "by": "tenant,sharing"}).json()
    assert answer["by"] == ["tenant", "sharing"]
    assert answer["total"]["gpu_hours"] == pytest.approx(sum(r["gpu_hours"] for r in answer["rows"]))
    assert admin.get("/v1/usage", params={"by": "node"}).status_code == 422
    assert admin.get("/v1/usage", params={"since": until, "until": until}).status_code == 422
    alice = http(user="alice", tenant="ml")
    assert {r["tenant"] for r in alice.get("/v1/usage", params={"until": until}).json()["rows"]} == {"ml"}
    db = ["--database-url", database_url]
    table = gpush(*db, "usage", "--until", "2026-01-05T11:00", "--by", "tenant,user")
    assert table.code == 0 and "GPU-HOURS" in table.out and "carol" in table.out and "total" in table.out
    assert max(len(line) for line in table.out.splitlines()) <= 80
    csv = gpush(*db, "usage", "--until", "2026-01-05T11:00", "--csv")
    assert csv.out.splitlines()[0] == "tenant,gpu_hours,jobs,run_hours"
    bad = gpush(*db, "usage", "--since", "last tuesday")
    assert bad.code == 2 and "7d, 24h, 90m" in bad.err


def test_a_running_job_reports_checkpoints_which_usage_ignores(http, sessions, history, gpush, database_url):
    alice = http(user="alice", tenant="ml")
    bob = http(user="bob", tenant="cv")
    sliced = history["sliced"]  # cv's, running
    answer = bob.post(f"/v1/jobs/{sliced}/checkpoint", json={"note": "step 1200 in s3://ckpt/run7"})
    assert answer.status_code == 201 and answer.json()["type"] == "checkpoint"
    assert answer.json()["reason"] == "checkpoint: step 1200 in s3://ckpt/run7"
    assert bob.post(f"/v1/jobs/{sliced}/checkpoint").status_code == 201  # no body: no note
    assert alice.post(f"/v1/jobs/{sliced}/checkpoint").status_code == 404  # another tenant's job
    assert bob.post(f"/v1/jobs/{history['whole']}/checkpoint").status_code == 409  # it has ended
    assert bob.post(f"/v1/jobs/{sliced}/checkpoint", json={"note": "x" * 201}).status_code == 422
    said = gpush("--database-url", database_url, "checkpoint", sliced, "--note", "epoch 3")
    assert said.code == 0 and f"job {sliced}: checkpoint recorded" in said.out
    with sessions() as session:
        from broker.intake.queue import last_events

        assert set(last_events(session, [sliced, history["whole"]], "checkpoint")) == {sliced}
        usage = {u.job_id: u for u in job_usage(session, ADMIN, since=None, until=T0 + timedelta(hours=2))}
    assert usage[sliced].gpu_seconds / 3600 == pytest.approx(0.25 * 2 + 0.25 * 4)  # as before the checkpoints


def test_the_ledger_catches_up_a_page_at_a_time(sessions, history):
    until = T0 + timedelta(hours=3)
    with sessions() as session:
        whole = UsageLedger().update(session, until)
        ledger = UsageLedger()
        first = ledger.update(session, until, page=2, max_pages=1)  # two events read
        assert sum(first.values()) < sum(whole.values())
        for _ in range(20):
            last = ledger.update(session, until, page=2, max_pages=1)
    assert last == pytest.approx(whole)
