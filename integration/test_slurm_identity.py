"""Jobs run as their owners on a Slurm cluster set up as a real site's (issue 16).

The cluster is the ``slurm_site`` one (integration/slurm_fixtures.py): slurmdbd on the
machine's MariaDB with AccountingStorageEnforce=associations,limits,qos, real Unix users
alice and bob, and one Slurm account per tenant (vision is alice's, nlp is bob's). The
broker runs here in-process as root with ``run_as=owner``: on the command-line backend
it runs sbatch through runuser, on the REST backend it mints a JWT for the user with the
cluster's key. Who a job runs as comes only from the token that submitted it.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.core.adapter import Rejected
from broker.core.auth import Principal
from broker.core.clusters import add_cluster
from broker.core.errors import NotAllowed
from broker.core.schemas import JobSpec, Role
from broker.intake import queue
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from integration.slurm.cluster import SlurmTestCluster
from integration.test_slurm_adapter import POLICY, SECRET, Broker, Clock, broker_only_file, sbatch_as

TOKEN_ENV = "GPUSH_TEST_SLURM_SITE_JWT"
TENANT_ACCOUNTS = "vision=vision,nlp=nlp"


def principal(user: str, tenant: str) -> Principal:
    return Principal(user=user, tenant=tenant, role=Role.USER)


class SiteBroker(Broker):
    """A broker whose jobs are submitted with users' own tokens."""

    def submit_as(self, who: Principal, **fields) -> int:
        spec = JobSpec.model_validate({"kind": "training", "gpus": 1, **fields})
        with self.sessions() as session, session.begin():
            (result,) = queue.submit_jobs(session, [spec], who, now=self.clock())
        return result.job["id"]

    def output(self, job_id: int, user: str) -> Path:
        return self.workdir / "logs" / user / f"{self.adapter().settings.tag}-{job_id}.out"

    def slurm_id(self, job_id: int) -> int:
        return int(self.job(job_id).backend_id)


@pytest.fixture
def site(slurm_site: SlurmTestCluster) -> Iterator[SlurmTestCluster]:
    slurm_site.cancel_all()
    yield slurm_site
    slurm_site.cancel_all()


@pytest.fixture
def workdir() -> Iterator[Path]:
    # Not under pytest's basetemp (0700): the users' jobs must reach their log directories.
    path = Path(tempfile.mkdtemp(prefix="gpush-site-work-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def site_config(cluster: SlurmTestCluster, backend: str, workdir: Path, **extra) -> dict:
    common = {
        "run_as": "owner",
        "tenant_accounts": TENANT_ACCOUNTS,
        "jobcomp_file": str(cluster.jobcomp),
        "workdir": str(workdir),
        "log_dir": "logs/%u",
        "cache_seconds": 0,
        **extra,
    }
    if backend == "rest":
        # The service token (root's) reads and cancels; each job is submitted with a token
        # minted for its user from the key slurmctld checks tokens with.
        os.environ[TOKEN_ENV] = cluster.token()
        return {
            **common,
            "rest_url": cluster.rest_url,
            "token_env": TOKEN_ENV,
            "user": "root",
            "jwt_key_file": str(cluster.conf.parent / "jwt_hs256.key"),
        }
    prefix = {"command_prefix": shlex.join(cluster.command_prefix)} if cluster.command_prefix else {}
    return {**common, "slurm_conf": str(cluster.conf), "switch_user": "runuser", **prefix}


@pytest.fixture(params=["cli", "rest"])
def backend(request) -> str:
    return request.param


def make_broker(engine, sessions, cluster: SlurmTestCluster, config: dict, workdir: Path) -> SiteBroker:
    clock = Clock()
    with sessions() as session, session.begin():
        add_cluster(session, name="slurm-a", kind="slurm", config=config, actor="root", now=clock())
    b = SiteBroker(engine, sessions, clock, cluster)
    with sessions() as session, session.begin():
        views = cluster_views(session, b.pool)
        policystore.apply(session, POLICY, comment="site", author="root", now=clock(), views=views, base_version=None)
    b.workdir = workdir
    return b


@pytest.fixture
def broker(engine, sessions, site: SlurmTestCluster, workdir: Path, backend: str) -> SiteBroker:
    return make_broker(engine, sessions, site, site_config(site, backend, workdir), workdir)


def wait_for_sacct(cluster: SlurmTestCluster, slurm_id: int, timeout: float = 20.0) -> dict[str, str]:
    """Slurm's accounting record of a finished job (slurmdbd takes it a moment after the end)."""
    deadline = time.monotonic() + timeout
    while True:
        rows = cluster.sacct(slurm_id)
        if rows and rows[0]["State"] == "COMPLETED":
            return rows[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"sacct has no completed record of job {slurm_id} after {timeout:g} s: {rows}")
        time.sleep(0.3)


def test_each_job_runs_as_its_owner_under_its_tenants_account(broker: SiteBroker, site: SlurmTestCluster):
    probe = ["sh", "-c", 'echo "$(id -un) $SLURM_JOB_ACCOUNT"']
    jobs = {
        "alice": broker.submit_as(principal("alice", "vision"), command=probe),
        "bob": broker.submit_as(principal("bob", "nlp"), command=probe),
    }
    broker.cycle_until(lambda: set(broker.states(jobs.values()).values()) == {"succeeded"})

    for user, job_id in jobs.items():
        account = "vision" if user == "alice" else "nlp"
        out = broker.output(job_id, user)
        assert out.read_text() == f"{user} {account}\n"
        assert pwd.getpwuid(out.stat().st_uid).pw_name == user  # the file is theirs, not the broker's
        assert pwd.getpwuid(out.parent.stat().st_uid).pw_name == user  # and so is their log directory
        record = wait_for_sacct(site, broker.slurm_id(job_id))
        assert (record["User"], record["Account"]) == (user, account)
        assert "gres/gpu=1" in record["AllocTRES"]


def test_gpush_usage_matches_slurms_own_accounting(engine, sessions, site: SlurmTestCluster, workdir: Path):
    """GPU-hours from gpush's job events against slurmdbd's records of the same jobs
    (sacct: ElapsedRaw x the GPUs of AllocTRES). gpush sees a start and an end when a
    status sync reads them (every cycle, 0.3 s here), so each job may differ by up to a
    second at either end: the tolerance is 2 s of each job's GPUs. A MIG slice is where the
    two differ by design: Slurm counts a 3g.20gb slice as one GPU, gpush as 3/7 of one."""
    from broker.accounting.usage import job_usage

    broker = make_broker(engine, sessions, site, site_config(site, "cli", workdir), workdir)
    sleep = ["sh", "-c", "sleep 4"]
    jobs = {
        broker.submit_as(principal("alice", "vision"), command=sleep, gpus=1): 1,
        broker.submit_as(principal("bob", "nlp"), command=sleep, gpus=2): 2,
        broker.submit_as(principal("alice", "vision"), command=["sh", "-c", "sleep 3"], gpus=1): 1,
    }
    broker.cycle_until(lambda: set(broker.states(jobs).values()) == {"succeeded"}, timeout=60)
    admin = Principal(user="root", tenant="ops", role=Role.ADMIN)
    with sessions() as session:
        usage = {u.job_id: u for u in job_usage(session, admin, since=None, until=broker.clock())}
    for job_id, gpus in jobs.items():
        record = wait_for_sacct(site, broker.slurm_id(job_id))
        assert f"gres/gpu={gpus}" in record["AllocTRES"]
        slurm_seconds = int(record["ElapsedRaw"]) * gpus
        print(f"job {job_id}: gpush {usage[job_id].gpu_seconds:.2f} GPU-seconds, slurmdbd {slurm_seconds}")
        assert abs(usage[job_id].gpu_seconds - slurm_seconds) <= 2 * gpus, (job_id, usage[job_id], record)
    by_tenant = {t: sum(u.gpu_seconds for u in usage.values() if u.tenant == t) for t in ("vision", "nlp")}
    slurm_by_account = {"vision": 0, "nlp": 0}
    for job_id, gpus in jobs.items():
        record = wait_for_sacct(site, broker.slurm_id(job_id))
        slurm_by_account[record["Account"]] += int(record["ElapsedRaw"]) * gpus
    for tenant in by_tenant:
        assert abs(by_tenant[tenant] - slurm_by_account[tenant]) <= 2 * 3, (by_tenant, slurm_by_account)


def test_a_users_token_cannot_make_a_job_run_as_someone_else(broker: SiteBroker):
    alice = principal("alice", "vision")
    with pytest.raises(NotAllowed, match="only an admin submits as user 'bob'"):
        broker.submit_as(alice, user="bob", command=["id", "-un"])
    with pytest.raises(NotAllowed):
        broker.submit_as(alice, tenant="nlp", command=["id", "-un"])

    # What a job spec can say about users is its environment: it changes nothing.
    job_id = broker.submit_as(
        alice,
        command=["sh", "-c", 'echo "$(id -un) $SLURM_JOB_USER"'],
        env={"USER": "bob", "LOGNAME": "bob", "SUDO_USER": "bob"},
    )
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    assert broker.output(job_id, "alice").read_text() == "alice alice\n"
    assert not (broker.workdir / "logs" / "bob").exists()


def test_an_admin_submitting_for_a_user_runs_the_job_as_that_user(broker: SiteBroker):
    # Admins may submit on a user's behalf (queue.submit_jobs): the job is then the
    # user's, in Slurm as in gpush, never the admin's.
    job_id = broker.submit(tenant="nlp", user="bob", kind="training", gpus=1, command=["id", "-un"])
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    assert broker.output(job_id, "bob").read_text() == "bob\n"


@pytest.mark.parametrize("same_name_users", [True, False])
def test_an_unmapped_user_is_refused_and_nothing_runs(
    engine, sessions, site: SlurmTestCluster, workdir: Path, backend: str, same_name_users: bool
):
    config = site_config(site, backend, workdir, same_name_users=same_name_users, unix_users="alice=alice")
    broker = make_broker(engine, sessions, site, config, workdir)
    # mallory has a gpush token but no Unix user on the cluster (and, without
    # same_name_users, no mapping either).
    job_id = broker.submit_as(principal("mallory", "vision"), command=["id", "-un"])
    broker.cycle_until(lambda: broker.job(job_id).state == "failed")

    reason = broker.job(job_id).state_reason
    assert "mallory" in reason, reason
    if not same_name_users:
        assert "unix_users" in reason, reason  # says which setting maps the user
    assert not [j for j in site.jobs() if j.get("user_name") == "mallory"]


def test_an_account_gpu_limit_is_a_waiting_reason_in_the_users_words(broker: SiteBroker, site: SlurmTestCluster):
    site.sacctmgr("modify", "account", "nlp", "set", "GrpTRES=gres/gpu=1")
    try:
        bob = principal("bob", "nlp")
        hold = ["sh", "-c", f"while [ ! -e {broker.workdir}/go ]; do sleep 0.1; done"]
        first = broker.submit_as(bob, command=hold)
        broker.cycle_until(lambda: broker.job(first).state == "running")
        second = broker.submit_as(bob, command=["true"])
        broker.cycle_until(lambda: "limit" in (broker.job(second).state_reason or ""))

        reason = broker.job(second).state_reason
        assert broker.job(second).state == "submitted"
        assert "account nlp's limit on GPUs in use at once" in reason, reason
        assert "AssocGrpGRES" in reason  # Slurm's own word, for the admin
        (broker.workdir / "go").touch()
        broker.cycle_until(lambda: set(broker.states([first, second]).values()) == {"succeeded"})
    finally:
        site.sacctmgr("modify", "account", "nlp", "set", "GrpTRES=gres/gpu=-1")


def test_a_user_cancels_their_own_running_job(broker: SiteBroker, site: SlurmTestCluster):
    alice = principal("alice", "vision")
    job_id = broker.submit_as(alice, command=["sleep", "60"])
    broker.cycle_until(lambda: broker.job(job_id).state == "running")
    assert site.job(broker.slurm_id(job_id))["user_name"] == "alice"

    with broker.sessions() as session, session.begin():
        queue.cancel_job(session, job_id, alice, now=broker.clock())
    broker.cycle_until(lambda: broker.job(job_id).state == "cancelled", timeout=20)
    assert "CANCELLED" in str(site.job(broker.slurm_id(job_id))["job_state"])


def test_proxy_mode_runs_the_job_as_its_owner(engine, sessions, site: SlurmTestCluster, workdir: Path):
    """REST without the site's JWT key: root's token with X-SLURM-USER-NAME naming the user
    (slurmrestd's proxy mode for SlurmUser and root). The README says which versions allow
    it; every version run here does."""
    config = site_config(site, "rest", workdir)
    del config["jwt_key_file"]
    broker = make_broker(engine, sessions, site, config, workdir)
    job_id = broker.submit_as(principal("alice", "vision"), command=["id", "-un"])
    broker.cycle_until(lambda: broker.job(job_id).state in ("succeeded", "failed"))
    assert broker.job(job_id).state == "succeeded", broker.job(job_id).state_reason
    assert broker.output(job_id, "alice").read_text() == "alice\n"
    assert site.job(broker.slurm_id(job_id))["user_name"] == "alice"


# -- hostile jobs and impostors (issue 32): a user's job never gets the broker to read for it --


def test_a_users_job_that_links_its_output_to_a_broker_only_file_gets_a_refusal(broker: SiteBroker):
    secret = broker_only_file(broker.workdir)
    out_dir = broker.workdir / "logs" / "alice"
    link = f'echo mine; rm -f "{out_dir}/$SLURM_JOB_NAME.out"; ln -s "{secret}" "{out_dir}/$SLURM_JOB_NAME.out"'
    job_id = broker.submit_as(principal("alice", "vision"), command=["sh", "-c", link])
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    assert broker.output(job_id, "alice").is_symlink()
    assert site_user_cannot_read("alice", secret)  # she could not have read it herself

    adapter, backend_id = broker.adapter(), broker.job(job_id).backend_id
    for read in ({}, {"tail": 10}, {"offset": 2}):
        with pytest.raises(Rejected, match=f"{broker.output(job_id, 'alice')} is a symbolic link") as refused:
            adapter.logs(job_id, backend_id, **read)
        assert SECRET.strip() not in str(refused.value)


def test_a_users_job_that_links_its_log_directory_to_the_brokers_gets_a_refusal(
    engine, sessions, site: SlurmTestCluster, workdir: Path, backend: str
):
    """log_dir in the users' own homes: alice may replace her log directory with a link to
    a directory only the broker may read, holding a file of her job's output name."""
    home = workdir / "home" / "alice"
    home.mkdir(parents=True)
    os.chown(home, pwd.getpwnam("alice").pw_uid, -1)
    config = site_config(site, backend, workdir, log_dir="home/%u/gpush-logs")
    broker = make_broker(engine, sessions, site, config, workdir)
    private = broker_only_file(workdir).parent
    swap = f'mv "{home}/gpush-logs" "{home}/gpush-logs.real" && ln -s "{private}" "{home}/gpush-logs"'
    job_id = broker.submit_as(principal("alice", "vision"), command=["sh", "-c", f"echo mine; {swap}"])
    name = f"{broker.adapter().settings.tag}-{job_id}"
    for stream in ("out", "err"):
        broker_only_file(workdir, f"{name}.{stream}")  # what the broker would read through her link
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    assert (home / "gpush-logs").is_symlink() and (home / "gpush-logs.real" / f"{name}.out").exists()

    adapter, backend_id = broker.adapter(), broker.job(job_id).backend_id
    for read in ({}, {"tail": 10}, {"stream": "stderr"}):
        with pytest.raises(Rejected, match=f"{home}/gpush-logs is a symbolic link") as refused:
            adapter.logs(job_id, backend_id, **read)
        assert SECRET.strip() not in str(refused.value)


def test_another_users_job_named_like_a_users_job_is_not_taken_for_it(broker: SiteBroker, site: SlurmTestCluster):
    """bob names a job of his own gpush-<alice's job>, with the broker's secret as output."""
    secret = broker_only_file(broker.workdir)
    hold = ["sh", "-c", f'echo mine; while [ ! -e "{broker.workdir}/go" ]; do sleep 0.1; done']
    job_id = broker.submit_as(principal("alice", "vision"), command=hold)
    broker.cycle_until(lambda: broker.job(job_id).state == "running")
    own = broker.job(job_id).backend_id
    name = f"{broker.adapter().settings.tag}-{job_id}"
    tag = [f"--job-name={name}", f"--comment={name.replace('-', ':job-')}", f"--output={secret}", f"--error={secret}"]
    held = sbatch_as(site, "bob", *tag, "--hold", "--wrap=sleep 60")
    ran = sbatch_as(site, "bob", *tag, "--wrap=true")
    site.wait_for(ran, {"FAILED", "COMPLETED"}, timeout=20)

    adapter = broker.adapter()
    assert adapter.find(job_id).backend_id == own
    out = adapter.logs(job_id, own)
    assert out.text == "mine\n"
    (broker.workdir / "go").touch()
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded")
    assert broker.job(job_id).backend_id == own
    assert "PENDING" in str(site.job(held)["job_state"])  # bob's: never the broker's to touch


def site_user_cannot_read(user: str, path: Path) -> bool:
    done = subprocess.run(["runuser", "-u", user, "--", "cat", str(path)], capture_output=True, text=True)
    return done.returncode != 0 and SECRET.strip() not in done.stdout
