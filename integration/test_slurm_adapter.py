"""gpush driving the real Slurm test cluster: MIG slices as typed GRES, MPS, whole GPUs.

The broker runs here in-process (PostgreSQL queue, the real scheduling cycle, the real
wall clock) with one cluster, ``slurm-a``, registered with the Slurm adapter against
the cluster of integration/slurm/ (mig01: 7 x 1g.5gb + 2 x 3g.20gb, mps01: one A100
under MPS, gpu01: two whole A100s). Jobs really run under slurmd; their output files
are read back.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import select

from adapters.slurm import SlurmAdapter
from adapters.slurm.records import parse_gres
from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.auth import Principal
from broker.core.clusters import AdapterPool, add_cluster, list_clusters
from broker.core.models import Job, JobEvent
from broker.core.schemas import JobSpec, Role
from broker.intake import queue
from broker.placement.tenants import tenant_usage
from broker.routing import policy as policy_engine
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from broker.scheduling.cycle import Scheduler
from integration.brokers import QueueAccess
from integration.slurm.cluster import ACTIVE_STATES, SlurmTestCluster, _read_env_file

ADMIN = Principal(user="root", tenant="ops", role=Role.ADMIN)
TOKEN_ENV = "GPUSH_TEST_SLURM_JWT"
POLICY = """
rules:
  - name: isolated-on-mig
    why: hardware isolation on the smallest MIG slice that holds the job
    match: {isolation: hardware}
    route: {cluster: slurm-a, sharing: slurm/mig}
  - name: light-on-mps
    why: process-level sharing on the MPS GPU
    match: {isolation: process}
    route: {cluster: slurm-a, sharing: slurm/mps}
  - name: whole
    why: everything else on whole GPUs
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""


class Clock:
    def __call__(self):
        from datetime import UTC, datetime

        return datetime.now(UTC)


@pytest.fixture
def slurm(slurm_cluster: SlurmTestCluster):
    """The session's cluster, up (a test that stopped slurmctld and failed may have left it
    down) and with no job left running by an earlier test, before and after."""
    if not slurm_cluster.is_up():
        restart_slurm(slurm_cluster)
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


def slurm_config(cluster: SlurmTestCluster, backend: str, workdir: Path) -> dict:
    # A log directory of its own (the default is workdir itself): the broker must make it.
    common = {
        "jobcomp_file": str(cluster.jobcomp),
        "workdir": str(workdir),
        "cache_seconds": 0,
        "log_dir": "gpush-logs",
    }
    if backend == "rest":
        os.environ[TOKEN_ENV] = cluster.token()
        return {**common, "rest_url": cluster.rest_url, "token_env": TOKEN_ENV, "user": "root"}
    # A cluster of a newer Slurm in a chroot (test_slurm_versions.py): its commands run there.
    prefix = {"command_prefix": shlex.join(cluster.command_prefix)} if cluster.command_prefix else {}
    return {**common, "slurm_conf": str(cluster.conf), **prefix}


class Broker(QueueAccess):
    """One broker process: its adapter pool and scheduler (a restart makes new ones)."""

    def __init__(self, engine, sessions, clock, slurm: SlurmTestCluster | None = None):
        self.engine, self.sessions, self.clock, self.slurm = engine, sessions, clock, slurm
        self.restart()

    def restart(self) -> None:
        self.pool = AdapterPool(self.clock)
        self.scheduler = Scheduler(self.engine, self.pool, clock=self.clock)

    def adapter(self) -> SlurmAdapter:
        """The Slurm adapter itself, not the pool's measuring wrapper (settings, client)."""
        with self.sessions() as session:
            (info,) = list_clusters(session)
        return self.pool.get(info).adapter

    def states(self, ids) -> dict[int, str]:
        with self.sessions() as session:
            rows = session.execute(select(Job.id, Job.state).where(Job.id.in_(list(ids)))).all()
        return dict(rows)

    def events(self, job_id: int) -> list[str]:
        with self.sessions() as session:
            rows = session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars()
            return [e.to_state for e in rows]

    def event_rows(self, job_id: int) -> list[JobEvent]:
        with self.sessions() as session:
            return list(
                session.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)).scalars()
            )

    def held_gpus(self) -> float:
        """GPU-equivalents the fair-share ledger counts as held, all tenants."""
        with self.sessions() as session:
            return sum(t.gpu_used for t in tenant_usage(session))

    def summary(self) -> list[tuple]:
        """gpush's view of every job, and Slurm's of those it has (for failure messages)."""
        with self.sessions() as session:
            rows = session.execute(select(Job.id, Job.state, Job.state_reason, Job.backend_id).order_by(Job.id)).all()
        out = [tuple(r) for r in rows]
        if self.slurm is not None:
            ids = {r[3] for r in rows if r[3]}
            out += [
                ("slurm", j["job_id"], j["name"], j["job_state"], j.get("state_reason"), j.get("nodes"))
                for j in self.slurm.jobs()
                if str(j["job_id"]) in ids
            ]
            out.append(("nodes", {n: (v.get("state"), v.get("gres_used")) for n, v in self.slurm.nodes().items()}))
        return out

    def cycle_until(self, done, timeout: float = 30.0, pause: float = 0.3):
        """Run scheduling cycles until ``done()`` is true; fails with the states after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            report = self.scheduler.run_cycle()
            if done():
                return report
            if time.monotonic() > deadline:
                raise AssertionError(f"not done after {timeout:g} s; jobs: {self.summary()}; last cycle: {report}")
            time.sleep(pause)


@pytest.fixture(params=["cli", "rest"])
def backend(request) -> str:
    return request.param


@pytest.fixture
def broker(engine, sessions, slurm: SlurmTestCluster, tmp_path, request) -> Broker:
    backend = request.node.callspec.params.get("backend", "rest") if hasattr(request.node, "callspec") else "rest"
    clock = Clock()
    tmp_path.chmod(0o755)
    with sessions() as session, session.begin():
        add_cluster(
            session,
            name="slurm-a",
            kind="slurm",
            config=slurm_config(slurm, backend, tmp_path),
            actor="root",
            now=clock(),
        )
    b = Broker(engine, sessions, clock, slurm)
    with sessions() as session, session.begin():
        views = cluster_views(session, b.pool)
        policystore.apply(
            session, POLICY, comment="slurm test", author="root", now=clock(), views=views, base_version=None
        )
    b.workdir = tmp_path
    return b


def output(b: Broker, job_id: int) -> str:
    path = b.workdir / "gpush-logs" / f"{b.adapter().settings.tag}-{job_id}.out"  # the log_dir set above
    assert path.exists(), f"no output file of job {job_id}: {sorted(b.workdir.rglob('*.out'))}"
    return path.read_text()


def recoveries(b: Broker, job_id: int) -> list[str]:
    """The reasons of the job's moves from ``submitting`` to ``submitted``: what the cycle
    after a restart wrote when it found the job on its cluster (broker.scheduling.cycle)."""
    return [e.reason for e in b.event_rows(job_id) if (e.from_state, e.to_state) == ("submitting", "submitted")]


def tagged_in_slurm(slurm: SlurmTestCluster, b: Broker) -> Counter:
    """How many Slurm jobs carry each gpush id (to prove nothing ran twice)."""
    tag = b.adapter().settings.tag
    return Counter(
        int(j["name"].rsplit("-", 1)[1]) for j in slurm.jobs() if str(j.get("name", "")).startswith(f"{tag}-")
    )


# -- every sharing mode, on both backends -----------------------------------------------


def test_each_sharing_mode_runs_to_completion(broker: Broker, backend):
    env_probe = [
        "sh",
        "-c",
        'echo "devices=$CUDA_VISIBLE_DEVICES mps=$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE '
        'fraction=$GPUSH_GPU_MEMORY_FRACTION gpus=$SLURM_JOB_GPUS"; sleep 3',
    ]
    ids = {
        "mig": broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=env_probe),
        "mps": broker.submit(kind="inference", isolation="process", gpu_memory_gb=10, command=env_probe),
        "whole": broker.submit(kind="training", gpus=2, command=env_probe),
    }
    broker.cycle_until(lambda: set(broker.states(ids.values()).values()) == {"succeeded"})
    placements = {name: broker.job(i).placement for name, i in ids.items()}
    assert placements["mig"]["sharing"] == "slurm/mig" and placements["mig"]["mig_profile"] == "1g.5gb"
    assert placements["mps"]["sharing"] == "slurm/mps" and placements["mps"]["units"] == 25
    assert placements["whole"]["sharing"] == "slurm/exclusive" and placements["whole"]["units"] == 2
    for job_id in ids.values():
        events = broker.events(job_id)
        # 3 s of running against a cycle every 0.3 s: the broker reads each one running.
        assert events[-3:] == ["submitted", "running", "succeeded"], (job_id, events)
    assert "mps=25" in output(broker, ids["mps"]) and "fraction=0.25" in output(broker, ids["mps"])
    assert "devices=0,1" in output(broker, ids["whole"]) and "fraction=1" in output(broker, ids["whole"])
    assert "devices=0" in output(broker, ids["mig"])
    assert broker.job(ids["mig"]).backend_id.isdigit()


def test_a_command_reaches_the_program_unchanged(broker: Broker, backend, monkeypatch):
    monkeypatch.setenv("GPUSH_BROKER_SECRET", "the broker's own environment")
    nasty = ["it's", '"double"', "$(touch /tmp/gpush-pwned)", "`id`", "a;b", "x\ny", "-n", "", "ünï"]
    job_id = broker.submit(
        kind="training",
        gpus=1,
        command=["printf", "[%s]", *nasty],
        env={"NASTY": "$(id) 'q' \"d\"\n;z"},
    )
    leak = broker.submit(kind="training", gpus=1, command=["sh", "-c", 'echo "${GPUSH_BROKER_SECRET-unset} $NASTY"'])
    broker.cycle_until(lambda: set(broker.states([job_id, leak]).values()) == {"succeeded"})
    assert output(broker, job_id) == "".join(f"[{arg}]" for arg in nasty)
    assert not Path("/tmp/gpush-pwned").exists()
    assert output(broker, leak) == "unset \n"  # the broker's variables never reach a job


def test_a_jobs_output_is_read_back_as_it_prints_and_after_it_ended(broker: Broker, backend):
    """`gpush logs` on Slurm: stdout and stderr in files of their own under the cluster's
    log_dir (the broker made the directory; Slurm would have failed the job without it),
    read on from an offset while the job prints (gpush logs -f), by their last lines, and
    again by a broker that restarted."""
    marker = broker.workdir / "go"
    command = [
        "sh",
        "-c",
        f'echo "out 1"; echo "err 1" >&2; while [ ! -e "{marker}" ]; do sleep 0.1; done; '
        'printf "out 2 ünï\\n"; echo "err 2" >&2',
    ]
    job_id = broker.submit(kind="training", gpus=1, command=command)
    broker.cycle_until(lambda: broker.job(job_id).state in ("submitted", "running"))
    adapter, backend_id = broker.adapter(), broker.job(job_id).backend_id
    path = broker.workdir / "gpush-logs" / f"{adapter.settings.tag}-{job_id}.out"

    deadline = time.monotonic() + 30
    while (first := _logs_once_started(adapter, job_id, backend_id)) is None or first.text != "out 1\n":
        assert time.monotonic() < deadline, f"no output read back: {first}"
        time.sleep(0.2)
    assert (first.readable, first.location) == (True, f"node gpu01: {path}")
    marker.touch()
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")

    rest = adapter.logs(job_id, backend_id, offset=first.next_offset)
    assert rest.text == "out 2 ünï\n" and first.text + rest.text == path.read_text()
    assert adapter.logs(job_id, backend_id, offset=rest.next_offset).text == ""
    assert adapter.logs(job_id, backend_id, stream="stderr").text == "err 1\nerr 2\n"
    tail = adapter.logs(job_id, backend_id, tail=1)
    assert (tail.text, tail.next_offset) == ("out 2 ünï\n", rest.next_offset)
    broker.restart()  # a new broker process finds the files again from the gpush id
    assert broker.adapter().logs(job_id, backend_id).text == "out 1\nout 2 ünï\n"

    # A job Slurm refused at submission never ran: no output, and it says so.
    three = Placement(cluster="slurm-a", sharing=Sharing.SLURM_EXCLUSIVE, units=3, gpu_equivalents=3.0)
    with pytest.raises(Rejected):
        adapter.submit(900101, JobSpec.model_validate({"kind": "training", "command": ["true"]}), three)
    with pytest.raises(Rejected, match="job 900101 never started on slurm-a: no output"):
        adapter.logs(900101, "")


def _logs_once_started(adapter: SlurmAdapter, job_id: int, backend_id: str):
    try:
        return adapter.logs(job_id, backend_id)
    except Rejected:  # not started yet
        return None


# -- hostile jobs and impostors (issue 32): nothing but the job's own output comes back -----

SECRET = "only the broker may read this\n"


def broker_only_file(directory: Path, name: str = "secret") -> Path:
    """A file only the broker's user (root) may read: 0600 in a 0700 directory of its own."""
    private = directory / "broker-only"
    private.mkdir(mode=0o700, exist_ok=True)
    secret = private / name
    secret.write_text(SECRET)
    secret.chmod(0o600)
    return secret


def gpush_logs(b: Broker, job_id: int, **read) -> dict:
    """``GET /v1/jobs/{id}/logs`` as the API answers it (broker.scheduling.output)."""
    from broker.scheduling.output import read_output

    with b.sessions() as session:
        (info,) = list_clusters(session)
        return read_output(session, job_id, ADMIN, adapter_for=lambda name: b.pool.get(info), **read)


def test_a_job_that_links_its_output_to_a_broker_only_file_gets_a_refusal(broker: Broker, backend):
    from broker.core.errors import Conflict

    secret = broker_only_file(broker.workdir)
    log_dir = broker.workdir / "gpush-logs"
    # What the job does: print, then put a link to the broker's file where its output was.
    link = f'echo "mine"; rm -f "{log_dir}/$SLURM_JOB_NAME.out"; ln -s "{secret}" "{log_dir}/$SLURM_JOB_NAME.out"'
    job_id = broker.submit(kind="training", gpus=1, command=["sh", "-c", link])
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    adapter, backend_id = broker.adapter(), broker.job(job_id).backend_id
    out_file = log_dir / f"{adapter.settings.tag}-{job_id}.out"
    assert out_file.is_symlink()

    for read in ({}, {"tail": 10}, {"offset": 3}):
        with pytest.raises(Rejected, match=f"{out_file} is a symbolic link") as refused:
            adapter.logs(job_id, backend_id, **read)
        assert SECRET.strip() not in str(refused.value)
        with pytest.raises(Conflict, match="is a symbolic link"):  # 409 from the API, never the content
            gpush_logs(broker, job_id, **read)
    # Its stderr, an ordinary file of its own, still reads.
    assert adapter.logs(job_id, backend_id, stream="stderr").readable


def sbatch_as(slurm: SlurmTestCluster, user: str, *args: str) -> int:
    """sbatch straight to Slurm as Unix user ``user`` (created if the machine lacks it), not
    through gpush; the job id."""
    from integration.slurm_fixtures import ensure_unix_user

    ensure_unix_user(user)
    done = slurm.run("runuser", "-u", user, "--", "sbatch", "--parsable", "--chdir=/tmp", *args)
    return int(done.stdout.strip().split(";")[0])


def test_an_impostor_job_of_another_user_is_not_adopted_and_its_output_not_read(broker: Broker, slurm, backend):
    """alice names two jobs of her own ``gpush-<id>`` after gpush's job, with the broker's
    secret as their output: one held, one that ran (its output could not be opened, but
    Slurm keeps the path and a node). The broker, restarted between sbatch and its
    database write, finds its job by the tag, and must find its own: not alice's, which
    a `gpush logs` would then read as the broker, nor cancel hers with its rights."""
    secret = broker_only_file(broker.workdir)
    job_id = broker.submit(kind="training", gpus=1, command=["sleep", "60"])

    cycle_killed_after_sbatch(broker)
    name = f"{broker.adapter().settings.tag}-{job_id}"
    (own,) = [j for j in slurm.jobs() if j["name"] == name]
    tag = [f"--job-name={name}", f"--comment={name.replace('-', ':job-')}", f"--output={secret}", f"--error={secret}"]
    held = sbatch_as(slurm, "alice", *tag, "--hold", "--wrap=sleep 60")
    ran = sbatch_as(slurm, "alice", *tag, "--wrap=true")
    slurm.wait_for(ran, {"FAILED", "COMPLETED"}, timeout=20)

    broker.restart()  # a new broker process: new adapters, nothing in memory
    broker.cycle_until(lambda: broker.job(job_id).state != "submitting")
    for read in ({}, {"tail": 5}, {"stream": "stderr"}):  # gpush logs: never what alice pointed at
        try:
            answer = gpush_logs(broker, job_id, **read)
        except Exception as exc:  # noqa: BLE001 (a refusal is fine; the secret is not)
            answer = {"text": "", "location": str(exc)}
        assert SECRET.strip() not in answer["text"] and str(secret) not in answer["location"], answer
    # The restart's recovery adopted the broker's own job, not one of alice's (whether a sync
    # has since read it running is Slurm's timing, not what this test is about).
    assert recoveries(broker, job_id) == [f"found on slurm-a as {own['job_id']} after a broker restart"]
    assert broker.job(job_id).backend_id == str(own["job_id"])
    assert broker.adapter().find(job_id).backend_id == str(own["job_id"])
    page = {b.job_id: b.backend_id for b in broker.adapter().statuses().jobs}
    assert page.get(job_id, str(own["job_id"])) == str(own["job_id"])
    # A broker that recorded a Slurm job squeue no longer lists (MinJobAge, 5 minutes on
    # this cluster: it names one Slurm never had) reads no impostor's file either.
    gone = broker.adapter().logs(job_id, "999999")
    assert SECRET.strip() not in gone.text and str(secret) not in gone.location

    broker.adapter().cancel(job_id)
    slurm.wait_for(own["job_id"], "CANCELLED")
    assert "PENDING" in str(slurm.job(held)["job_state"])  # alice's own job: not the broker's to cancel


# -- what waits, and why ---------------------------------------------------------------------


def test_seven_slices_run_at_once_and_the_next_job_waits_with_the_reason(broker: Broker, slurm):
    sleep = ["sleep", "30"]
    ids = [broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=sleep) for _ in range(10)]
    broker.cycle_until(lambda: Counter(broker.states(ids).values())["running"] == 9, timeout=20)
    profiles = Counter(broker.job(i).placement["mig_profile"] for i in ids[:9])
    assert profiles == {"1g.5gb": 7, "3g.20gb": 2}  # the smallest slice first, then larger ones
    waiting = broker.job(ids[9])
    assert waiting.state == "queued"
    assert waiting.state_reason.startswith("waiting for a 1g.5gb slice") and "0 of 7 free" in waiting.state_reason
    # Seen from Slurm: mig01 has every slice busy, and the 10th job never reached it.
    assert ids[9] not in tagged_in_slurm(slurm, broker)


def test_slurm_says_why_an_eighth_slice_job_waits(broker: Broker, slurm):
    """Straight through the adapter (bypassing the broker's own fit): Slurm's pending
    reason comes back in the user's terms."""
    adapter = broker.adapter()
    spec = JobSpec.model_validate(
        {"kind": "training", "isolation": "hardware", "gpu_memory_gb": 4, "command": ["sleep", "30"]}
    )
    slice_ = Placement(
        cluster="slurm-a", sharing=Sharing.SLURM_MIG, units=1, gpu_equivalents=1 / 7, mig_profile="1g.5gb"
    )
    for job_id in range(900001, 900009):
        adapter.submit(job_id, spec, slice_)
    deadline = time.monotonic() + 40  # a loaded 2-CPU machine: slurmctld's passes come late
    page: dict = {}
    while True:
        # A page holds the jobs whose state or reason moved since the last one: keep the latest
        # of each (a job reported pending before the others started is not reported again).
        page.update({b.job_id: b for b in adapter.statuses(None).jobs if b.job_id >= 900001})
        states = Counter(b.state.value for b in page.values())
        if states["running"] == 7 and states["pending"] == 1:
            break
        if time.monotonic() > deadline:
            squeue = slurm.run("squeue", "--all", "-o", "%i %j %T %r %b", check=False).stdout
            raise AssertionError(f"gpush saw {dict(states)}; Slurm's queue:\n{squeue}\n{slurm.log_tail()}")
        time.sleep(0.3)
    (pending,) = [b for b in page.values() if b.state.value == "pending"]
    # Slurm says Resources, or Priority when its pass found the job behind another one.
    assert pending.reason in (
        "waiting in slurm-a for a 1g.5gb slice: all 7 busy",
        "waiting in slurm-a for a 1g.5gb slice, behind higher-priority jobs: all 7 busy",
    )


def test_mps_jobs_share_one_gpu_at_once(broker: Broker, slurm):
    ids = [
        broker.submit(kind="inference", isolation="process", gpu_memory_gb=10, command=["sleep", "30"])
        for _ in range(5)
    ]
    broker.cycle_until(lambda: Counter(broker.states(ids).values())["running"] == 4, timeout=40)
    tag = broker.adapter().settings.tag
    names = {f"{tag}-{i}" for i in ids}
    running = [j for j in slurm.jobs() if j["name"] in names and "RUNNING" in str(j["job_state"])]
    assert {j["nodes"] for j in running} == {"mps01"} and len(running) == 4
    fifth = broker.job(ids[4])
    assert fifth.state == "queued" and fifth.state_reason.startswith("waiting for an MPS share of 25% on slurm-a")


def test_a_slice_no_node_offers_is_held_before_slurm_sees_it(broker: Broker, slurm):
    job_id = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=30, command=["true"])
    broker.scheduler.run_cycle()
    held = broker.job(job_id)
    assert held.state == "held"
    assert "no MIG slice on slurm-a has 30 GB (largest: 3g.20gb)" in held.state_reason
    assert job_id not in tagged_in_slurm(slurm, broker)


def test_a_policy_naming_a_gpu_the_cluster_lacks_is_refused(broker: Broker):
    bad = POLICY.replace(
        "{cluster: slurm-a, sharing: slurm/exclusive}", "{cluster: slurm-a, sharing: slurm/exclusive, gpu_model: H100}"
    )
    with broker.sessions() as session:
        views = cluster_views(session, broker.pool)
        report = policy_engine.validate(policy_engine.load_policy(bad), views)
    assert any("has no H100" in str(problem) for problem in report.errors), report


# -- cancel ------------------------------------------------------------------------------------


def test_cancel_works_in_every_state(broker: Broker, slurm):
    long = ["sleep", "60"]
    cancel = {}
    cancel["queued"] = broker.submit(kind="training", gpus=1, command=long)
    cancel["held"] = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=30, command=long)
    cancel["running"] = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=long)
    broker.cycle_until(lambda: broker.job(cancel["running"]).state == "running")
    assert broker.job(cancel["held"]).state == "held"
    # A job Slurm has but does not run: its partition is down (the broker cannot see that).
    slurm.run("scontrol", "update", "PartitionName=gpu", "State=DOWN")
    try:
        cancel["pending in Slurm"] = broker.submit(kind="inference", isolation="process", gpu_memory_gb=2, command=long)
        broker.cycle_until(lambda: "partition gpu" in (broker.job(cancel["pending in Slurm"]).state_reason or ""))
        assert broker.job(cancel["pending in Slurm"]).state == "submitted"
        for job_id in cancel.values():
            with broker.sessions() as session, session.begin():
                queue.cancel_job(session, job_id, ADMIN, now=broker.clock())
        broker.cycle_until(lambda: set(broker.states(cancel.values()).values()) == {"cancelled"}, timeout=20)
    finally:
        slurm.run("scontrol", "update", "PartitionName=gpu", "State=UP")
    names = {f"{broker.adapter().settings.tag}-{cancel[k]}" for k in ("running", "pending in Slurm")}
    in_slurm = [j for j in slurm.jobs() if j["name"] in names]
    assert len(in_slurm) == 2 and all("CANCELLED" in str(j["job_state"]) for j in in_slurm), in_slurm


# -- crashes and restarts ------------------------------------------------------------------------


def cycle_killed_after_sbatch(b: Broker) -> None:
    """One scheduling cycle in a real ``gpush scheduler run`` process, killed by SIGKILL
    once Slurm has answered sbatch and before the answer is written (``GPUSH_FAULT``,
    broker/core/faults.py): the job stays ``submitting`` while Slurm has it."""
    env = os.environ | {
        "GPUSH_DATABASE_URL": b.engine.url.render_as_string(hide_password=False),
        "GPUSH_FAULT": "submitted-before-record",
        "GPUSH_LOCAL_SERVER": "0",
    }
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from broker.cli.main import main; main(sys.argv[1:])"]
        + ["scheduler", "run", "--cycles", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL, f"not killed at the fault point (exit {done.returncode}): {done.stderr}"


def test_a_broker_killed_between_sbatch_and_the_write_finds_the_job_by_its_tag(broker: Broker, slurm):
    job_id = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["sleep", "5"])

    cycle_killed_after_sbatch(broker)
    assert broker.job(job_id).state == "submitting"
    assert tagged_in_slurm(slurm, broker)[job_id] == 1

    broker.restart()  # a new broker process: new adapters, nothing in memory
    broker.cycle_until(lambda: broker.job(job_id).state in ("submitted", "running"))
    assert tagged_in_slurm(slurm, broker)[job_id] == 1
    (own,) = [j for j in slurm.jobs() if j["name"] == f"{broker.adapter().settings.tag}-{job_id}"]
    assert recoveries(broker, job_id) == [f"found on slurm-a as {own['job_id']} after a broker restart"]
    assert broker.job(job_id).backend_id == str(own["job_id"])


def test_status_sync_after_a_restart_catches_jobs_that_ended_meanwhile(broker: Broker, slurm):
    ids = [
        broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["sleep", "2"]) for _ in range(3)
    ]
    broker.cycle_until(lambda: set(broker.states(ids).values()) <= {"submitted", "running"})
    # The broker is down while the jobs finish.
    for job_id in ids:
        slurm.wait_for(int(broker.job(job_id).backend_id), "COMPLETED", timeout=20)
    broker.restart()
    broker.cycle_until(lambda: set(broker.states(ids).values()) == {"succeeded"}, timeout=10)


def restart_slurm(slurm: SlurmTestCluster) -> None:
    """start.sh on the cluster's STATE, keeping its jobs (as a restarted slurmctld does)."""
    subprocess.run(
        [str(Path(__file__).parent / "slurm" / "start.sh"), str(slurm.state)],
        check=True,
        capture_output=True,
        timeout=120,
        # The ports it was started on (env.sh keeps them), not the defaults.
        env={**slurm.env(), **{k: v for k, v in _read_env_file(slurm.state / "env.sh").items() if k.endswith("_PORT")}},
    )


def _slurmctld_pid(slurm: SlurmTestCluster) -> int:
    pid_file = next(slurm.state.rglob("slurmctld.pid"))
    return int(pid_file.read_text().strip())


def test_slurmctld_down_in_a_burst_loses_and_doubles_nothing(broker: Broker, slurm, how=signal.SIGTERM):
    """slurmctld stops (and saves its jobs) in the middle of a burst; while it is down
    the cluster is unhealthy and new jobs wait in gpush; once it is back every job runs
    exactly once."""
    ids = [
        broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["sleep", "1"]) for _ in range(12)
    ]
    broker.scheduler.run_cycle()
    os.kill(_slurmctld_pid(slurm), how)
    try:
        more = [
            broker.submit(kind="inference", isolation="process", gpu_memory_gb=2, command=["true"]) for _ in range(8)
        ]
        time.sleep(0.5)
        report = broker.scheduler.run_cycle()
        assert report.errors, "a cycle with slurmctld down should say so"
        assert broker.adapter().health().ok is False
        waiting = broker.job(more[0])
        assert waiting.state == "queued" and "waiting for slurm-a, which does not answer" in waiting.state_reason
    finally:
        restart_slurm(slurm)
    everything = ids + more
    broker.cycle_until(lambda: set(broker.states(everything).values()) == {"succeeded"}, timeout=60)
    counts = tagged_in_slurm(slurm, broker)
    assert all(counts[i] == 1 for i in everything), counts


def _restart_slurmctld(slurm: SlurmTestCluster, timeout: float = 30.0, *, nodes: bool = True) -> None:
    """slurmctld alone, as systemd restarts a crashed one: slurmd, the running job steps
    and slurmrestd stay as they are. Returns once every node has registered again, or
    (``nodes=False``) as soon as slurmctld answers, as a broker goes on: the nodes register
    a few seconds later."""
    subprocess.run(["slurmctld", "-f", str(slurm.conf)], env=slurm.env(), check=True, timeout=30)
    deadline = time.monotonic() + timeout
    while not (slurm.is_up() if nodes else "UP" in slurm.run("scontrol", "ping", check=False).stdout):
        if time.monotonic() > deadline:
            raise AssertionError(f"slurmctld did not come back in {timeout:g}s\n{slurm.log_tail(10)}")
        time.sleep(0.2)


def _end_slurmctld(slurm: SlurmTestCluster, how: int) -> None:
    """Signal slurmctld and wait until it is gone; nothing to do when it is gone already."""
    pid = _slurmctld_pid(slurm)
    comm = Path(f"/proc/{pid}/comm")
    if not comm.exists() or comm.read_text().strip() != "slurmctld":  # its pid file outlives it
        return
    os.kill(pid, how)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]:
        if time.monotonic() > deadline:
            raise AssertionError(f"slurmctld ({pid}) still alive 10 s after signal {how}")
        time.sleep(0.05)


def _kill_slurmctld(slurm: SlurmTestCluster) -> None:
    _end_slurmctld(slurm, signal.SIGKILL)


def _saved_state(slurm: SlurmTestCluster, copy: Path) -> None:
    """Copy slurmctld's state as it stands now, for a later crash to go back to.

    slurmctld saves its state a few seconds after each change, so a copy of its directory
    taken while it runs holds some earlier moment, and copying it races the save (a file
    renamed under the copy). A stale copy brought back a preceding test's jobs: pending
    ones ran again, and running ones, long ended, were listed as running and held their
    slices for good (see adapters.slurm.restarts). Stopped with SIGTERM, slurmctld saves
    everything first; it is started again at once, alone."""
    _end_slurmctld(slurm, signal.SIGTERM)
    shutil.copytree(slurm.state / "ctld", copy)
    _restart_slurmctld(slurm)


def _go_back_to(slurm: SlurmTestCluster, copy: Path) -> None:
    """The crash: slurmctld killed (if it still runs), its state on disk now the ``copy`` of an earlier moment."""
    _kill_slurmctld(slurm)
    shutil.rmtree(slurm.state / "ctld")
    shutil.copytree(copy, slurm.state / "ctld")


def test_slurmctld_killed_mid_burst_loses_and_doubles_nothing(broker: Broker, slurm, tmp_path):
    """slurmctld is killed with SIGKILL in the middle of a burst, before it saved the
    burst: its state on disk is the one from before the burst, as when it dies between
    two saves (every few seconds; Slurm's FAQ "How could some jobs submitted immediately
    before the slurmctld daemon crashed be lost?"). Restarted alone, as systemd would, it
    has forgotten the jobs and would give their job ids out again, which the nodes refuse
    as duplicates (draining themselves). gpush, cycling on at once as a broker does, puts
    the lost jobs back in its queue with the reason and skips the reused ids with held
    placeholders; held until the nodes have registered, they make Slurm abort the lost
    runs the nodes report ("Registered PENDING"). Every job runs to completion exactly
    once (each writes a line when its work completes), and nothing holds a GPU at the
    end, in Slurm's books or gpush's.

    The work is `sleep 20 && echo`: this cluster tracks processes without cgroups
    (proctrack/linuxproc), and ending an orphan there can kill the sleep and miss the
    shell around it, which would then go on (seen on 22.05 without gpush: 1 run in 20).
    With proctrack/cgroup the whole run ends.
    """
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)
    finish = ["sh", "-c", f'sleep 20 && echo done >> "{runs}/$GPUSH_JOB_ID"']
    saved = tmp_path / "ctld-before-the-burst"
    _saved_state(slurm, saved)

    # Quick jobs end while slurmctld is down: no record of them survives anywhere, so
    # they run again (at least once, as Slurm's own requeue would), and the nodes that
    # ran them keep their ids as launched.
    quick = ["sh", "-c", f'touch "{runs}/$GPUSH_JOB_ID.started"; sleep 2; echo done >> "{runs}/$GPUSH_JOB_ID"']

    burst = [broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=finish) for _ in range(9)]
    broker.cycle_until(lambda: "running" in broker.states(burst).values(), timeout=20, pause=0.2)
    late = [broker.submit(kind="inference", isolation="process", gpu_memory_gb=10, command=quick) for _ in range(3)]
    late += [broker.submit(kind="training", gpus=1, command=quick) for _ in range(2)]
    broker.cycle_until(lambda: all((runs / f"{i}.started").exists() for i in late), timeout=20, pause=0.1)
    seen = broker.states(burst + late)
    _kill_slurmctld(slurm)
    deadline = time.monotonic() + 20  # the quick jobs end; their ends reach no controller
    while not all((runs / str(i)).exists() for i in late) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)
    _go_back_to(slurm, saved)
    _restart_slurmctld(slurm, nodes=False)

    everything = burst + late
    broker.cycle_until(lambda: set(broker.states(everything).values()) == {"succeeded"}, timeout=150, pause=0.5)

    completed = {int(p.name): len(p.read_text().splitlines()) for p in runs.iterdir() if p.name.isdigit()}
    assert {i: completed.get(i) for i in burst} == dict.fromkeys(burst, 1), (seen, broker.summary())
    assert {i: completed.get(i) for i in late} == dict.fromkeys(late, 2), (seen, broker.summary())
    reasons = {i: " ".join(e.reason or "" for e in broker.event_rows(i)) for i in everything}
    lost_running = [i for i in everything if "lost the job while it ran" in reasons[i]]
    lost_waiting = [i for i in everything if "lost the job before it was seen running" in reasons[i]]
    assert lost_running, (seen, reasons)  # the burst was running when slurmctld died
    assert set(lost_running) | set(lost_waiting) == {i for i, s in seen.items() if s in ("submitted", "running")}
    # No node refused a reused id: none drained, no job of gpush held by Slurm.
    assert not any(n.unavailable for n in broker.adapter().client.nodes()), broker.summary()
    assert "Duplicate jobid" not in (slurm.log_dir / "slurmctld.log").read_text()
    # Nothing holds a GPU: Slurm's GRES and gpush's ledger are both back to zero, and the
    # placeholders were cancelled once the nodes had registered.
    broker.cycle_until(lambda: not slurm.run("squeue", "-h", "-t", ACTIVE_STATES, "-o", "%i %j").stdout.strip())
    assert all(not any(g.count for g in n.gres_used if g.name == "gpu") for n in broker.adapter().client.nodes())
    assert broker.held_gpus() == 0


def test_runs_that_ended_before_slurmctld_restarted_give_their_gpus_back(broker: Broker, slurm, tmp_path):
    """slurmctld restarts from a state saved while two jobs ran, after both had ended:
    gpush's and someone else's. It lists both as running again and holds their slices
    for good: the nodes register at once, sooner than Slurm 22.05 lets a job its node no
    longer has go (BatchStartTimeout + MessageTimeout after it was last heard of). gpush
    knows its own run ended and cancels it, which gives the slice back; the other one it
    finds ended in the job completion log and reports, for an administrator to cancel."""
    ours = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["sleep", "4"])
    theirs = slurm.submit(
        "-p", "mig", "--gres=gpu:1g.5gb:1", "-J", "someone-else", "--output=/dev/null", "--wrap", "sleep 4"
    )
    broker.cycle_until(lambda: broker.job(ours).state == "running", timeout=20, pause=0.2)
    ours_in_slurm = int(broker.job(ours).backend_id)
    slurm.wait_for(theirs, "RUNNING")
    saved = tmp_path / "ctld-while-both-ran"
    _saved_state(slurm, saved)
    broker.cycle_until(lambda: broker.job(ours).state == "succeeded", timeout=20, pause=0.2)
    slurm.wait_for(theirs, "COMPLETED", timeout=20)
    _go_back_to(slurm, saved)
    _restart_slurmctld(slurm)
    # Slurm's own view: both run again, on slices it will not give to anyone else.
    listed = {j["job_id"]: j for j in slurm.jobs()}
    assert {str(listed[i]["job_state"]) for i in (ours_in_slurm, theirs)} <= {"RUNNING", "['RUNNING']"}, listed

    def slices_held() -> int:
        mig01 = slurm.nodes()["mig01"]
        return sum(g.count for g in parse_gres(mig01.get("gres_used")) if g.type == "1g.5gb")

    broker.cycle_until(lambda: "CANCELLED" in str(slurm.job(ours_in_slurm)["job_state"]) and slices_held() == 1)

    assert broker.job(ours).state == "succeeded" and broker.events(ours).count("running") == 1
    assert "RUNNING" in str(slurm.job(theirs)["job_state"])  # gpush leaves others' jobs alone
    detail = broker.adapter().health().detail
    assert f"(Slurm job {theirs}, per the job completion log or accounting)" in detail, detail
    assert f"scancel {theirs}" in detail


# A program that checkpoints when told of a preemption: USR1 makes it write where it got
# to and exit; run again, it resumes from what it wrote (the victim program).
VICTIM = r"""
marker="$1"
if [ -e "$marker" ]; then echo "resumed from $(cat "$marker")"; exit 0; fi
i=0
trap 'echo "step $i" > "$marker"; echo "checkpointed at step $i"; exit 0' USR1
echo started
while true; do i=$((i+1)); sleep 0.2; done
"""


def _output_so_far(b: Broker, job_id: int) -> str:
    path = b.workdir / "gpush-logs" / f"{b.adapter().settings.tag}-{job_id}.out"
    return path.read_text() if path.exists() else ""


def test_a_preempted_job_gets_its_signal_saves_its_state_and_resumes(broker: Broker, backend):
    marker = broker.workdir / "victim.marker"
    command = ["bash", "-c", VICTIM, "victim", str(marker)]
    job_id = broker.submit(kind="training", gpus=1, command=command)
    broker.cycle_until(lambda: broker.job(job_id).state == "running")
    broker.cycle_until(lambda: "started" in _output_so_far(broker, job_id))  # the trap is set
    broker.adapter().preempt(job_id, "SIGUSR1", grace_seconds=30)
    broker.cycle_until(lambda: broker.job(job_id).state in ("succeeded", "failed", "cancelled"))
    assert broker.job(job_id).state == "succeeded", broker.summary()  # it saved its state and exited
    assert marker.read_text().startswith("step ")
    assert "checkpointed at step" in output(broker, job_id)
    again = broker.submit(kind="training", gpus=1, command=command)
    broker.cycle_until(lambda: broker.job(again).state == "succeeded")
    assert output(broker, again).strip() == f"resumed from {marker.read_text().strip()}"
    # A job that has ended, or never was, is no error; a signal the broker does not send is refused.
    broker.adapter().preempt(job_id, "SIGUSR1", grace_seconds=30)
    with pytest.raises(Rejected, match="SIGKILL"):
        broker.adapter().preempt(again, "SIGKILL", grace_seconds=0)


PREEMPTING = POLICY + "preemption: {min_priority_gap: 5, grace: 20s}\n"


def _apply(b: Broker, text: str) -> None:
    with b.sessions() as session, session.begin():
        policystore.apply(
            session,
            text,
            comment="preemption",
            author="root",
            now=b.clock(),
            views=cluster_views(session, b.pool),
            base_version=policystore.active_version(session),
        )


def test_a_protected_job_preempts_a_checkpointing_job_that_resumes_where_it_stopped(broker: Broker, backend):
    """The scheduler's own preemption on real Slurm: the victim gets SIGUSR1 from its
    checkpoint section, saves and exits, is requeued with the reason, and its next run
    resumes from its marker; the protected job starts within a cycle of the victim's end."""
    _apply(broker, PREEMPTING)
    marker = broker.workdir / "victim.marker"
    command = ["bash", "-c", VICTIM, "victim", str(marker)]
    checkpoint = {"signal": "USR1", "grace": 20}
    victim = broker.submit(kind="training", gpus=2, command=command, preemptible=True, checkpoint=checkpoint)
    broker.cycle_until(lambda: "started" in _output_so_far(broker, victim))  # running, its trap set
    time.sleep(1)  # some steps done
    asked = time.monotonic()
    urgent = broker.submit(tenant="prod", kind="training", gpus=2, command=["sleep", "2"], priority=10)
    broker.cycle_until(lambda: broker.job(urgent).state in ("running", "succeeded"), timeout=40)
    waited = time.monotonic() - asked
    assert waited < 20, f"{waited:.1f} s: more than the grace"  # it saved at once, well inside its grace
    rows = broker.event_rows(victim)
    told = [e.reason for e in rows if e.type == "preemption"]
    assert told == [
        f"preempted by job {urgent} (priority 10, tenant prod): to be told with SIGUSR1",
        "told with SIGUSR1; 20 s to save its state",
    ], broker.summary()
    (requeued,) = [e.reason for e in rows if e.to_state == "requeued"]
    assert requeued == f"preempted by job {urgent} (priority 10, tenant prod); ended after saving its state (exit 0)"
    assert any(
        e.type == "preemption" and e.reason.startswith(f"preempts job {victim}") for e in broker.event_rows(urgent)
    )
    saved = marker.read_text().strip()
    assert saved.startswith("step ") and int(saved.split()[1]) > 0
    # The urgent job ends; the victim runs again and resumes where it stopped.
    broker.cycle_until(lambda: broker.job(victim).state == "succeeded", timeout=60)
    assert output(broker, victim).strip() == f"resumed from {saved}"
    runs = [e for e in broker.event_rows(victim) if e.type == "transition" and e.to_state == "submitted"]
    assert len(runs) == 2 and broker.job(urgent).state == "succeeded"  # two runs in Slurm


def test_a_job_that_is_not_preemptible_is_never_touched(broker: Broker, backend):
    _apply(broker, PREEMPTING)
    kept = broker.submit(kind="training", gpus=2, command=["sleep", "60"], preemptible=False)
    broker.cycle_until(lambda: broker.job(kept).state == "running")
    urgent = broker.submit(tenant="prod", kind="training", gpus=2, command=["true"], priority=100)
    for _ in range(4):
        assert broker.scheduler.run_cycle().preempted == 0
        time.sleep(0.3)
    assert broker.job(kept).state == "running" and "preemption" not in {e.type for e in broker.event_rows(kept)}
    assert broker.job(urgent).state_reason.startswith("waiting for 2 whole GPUs"), broker.summary()


# -- fencing a node (a MIG layout change drains it first) --------------------------------


def test_a_fenced_node_takes_no_new_job_until_gpush_resumes_it(broker: Broker, slurm, backend):
    adapter = broker.adapter()
    if backend == "rest":  # 22.05's slurmrestd (v0.0.38) has no node update; 23.02's has
        with pytest.raises(Rejected, match="cannot drain a node; Slurm 23.02 adds it"):
            adapter.fence("mig01", "MIG change 1")
        return
    sleep = ["sleep", "60"]
    first = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=sleep)
    broker.cycle_until(lambda: broker.states([first])[first] == "running", timeout=20)
    adapter.fence("mig01", "MIG change 1")
    try:
        assert adapter.fenced() == {"mig01": "MIG change 1"}
        shown = slurm.run("scontrol", "show", "node", "mig01").stdout
        assert "DRAIN" in shown and "Reason=gpush: MIG change 1" in shown
        second = broker.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=sleep)
        for _ in range(3):
            broker.scheduler.run_cycle()
            time.sleep(0.3)
        assert broker.states([first, second]) == {first: "running", second: "queued"}  # the running one goes on
    finally:
        adapter.unfence("mig01")
    assert adapter.fenced() == {}
    broker.cycle_until(lambda: broker.states([second])[second] == "running", timeout=30)
    # A node someone else drained is theirs to resume: gpush leaves it drained.
    slurm.run("scontrol", "update", "NodeName=mps01", "State=DRAIN", "Reason=maintenance")
    try:
        adapter.unfence("mps01")
        assert "DRAIN" in slurm.run("scontrol", "show", "node", "mps01").stdout
        assert adapter.fenced() == {}
    finally:
        slurm.run("scontrol", "update", "NodeName=mps01", "State=RESUME")
    with pytest.raises(Rejected, match="no node nosuch"):
        adapter.fence("nosuch", "MIG change 2")
