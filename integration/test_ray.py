"""Ray's autoscaler gets its GPU workers from gpush, with real Ray and the real Slurm test cluster.

A gpush server (API and scheduler, PostgreSQL) drives the Slurm test cluster; a real Ray
head on this machine runs its autoscaler with the gpush node provider
(integration/ray/cluster.yaml). A driver that needs GPUs makes the autoscaler launch
workers: each is a gpush job routed to a MIG slice on mig01, where slurmd runs its
``ray start --block`` so it really joins the head (Ray sees the slice as ``GPU: 1``).
When the work is done the workers idle out and their jobs are cancelled, and a worker
still queued in gpush (its tenant at quota) is cancelled once no demand wants it. A Ray
Serve deployment of one-GPU replicas gets its first replica's worker, and under load its
second, the same way, and gives them back when it is deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from broker.client.sdk import GpushClient
from broker.ray.workers import LABEL_CLUSTER, LABEL_NODE_IP, NOT_JOINED
from integration.ray.harness import GPUSH, RAY, GpushBroker, RayHead, cluster_yaml, free_port, wait_for

TOKEN_ENV = "GPUSH_RAY_TOKEN"


@pytest.fixture
def slurm(slurm_cluster):
    slurm_cluster.cancel_all()
    yield slurm_cluster
    slurm_cluster.cancel_all()


@pytest.fixture
def broker(database_url, slurm):
    # Not under pytest's basetemp, which is private (0700) and rotated by other runs.
    workdir = Path(tempfile.mkdtemp(prefix="gpush-ray-"))
    b = GpushBroker(database_url, slurm, workdir)
    yield b
    b.stop()
    if not os.environ.get("GPUSH_RAY_KEEP"):
        shutil.rmtree(workdir, ignore_errors=True)


class RayCluster:
    def __init__(
        self, broker: GpushBroker, tenant: str, worker_ip: str = "loopback", ray_command: str | None = None, **options
    ):
        self.broker = broker
        self.token = broker.token("ray", tenant)
        self.client = GpushClient(broker.url, self.token)
        self.name = f"rt{int(time.time() * 1000) % 10**8}"
        self.head = None
        config = cluster_yaml(
            cluster_name=self.name, gpush_url=broker.url, head_address="", token_env=TOKEN_ENV, **options
        )
        config["provider"]["worker_ip"] = worker_ip
        if ray_command:
            config["provider"]["ray_command"] = ray_command
        config["provider"]["use_node_id_as_ip"] = worker_ip == "node-id"
        self.head = RayHead(config, {TOKEN_ENV: self.token})

    def jobs(self, states=()):
        return list(self.client.iter_jobs(labels={LABEL_CLUSTER: self.name}, states=states))

    def explain(self) -> str:
        jobs = [(j.id, j.state.value, j.state_reason, j.backend_id) for j in self.jobs()]
        nodes = [(n.get("node_ip"), n.get("state"), n.get("resources_total")) for n in self.head.alive_nodes()]
        return (
            f"gpush jobs: {jobs}\nray nodes: {nodes}\nray status:\n{self.head.status()}"
            f"\nmonitor:\n{self.head.monitor_log()[-3000:]}\nserver:\n{self.broker.log_tail()}"
        )

    def close(self):
        self.client.close()
        if self.head:
            self.head.stop()


@pytest.fixture
def ray_cluster(broker):
    clusters = []

    def make(tenant: str = "ray", **options) -> RayCluster:
        cluster = RayCluster(broker, tenant, **options)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


@pytest.mark.parametrize("worker_ip", ["loopback", "node-id"])
def test_gpu_work_brings_workers_through_gpush_and_they_go_away_when_idle(ray_cluster, slurm, worker_ip):
    rc = ray_cluster(worker_ip=worker_ip)
    driver = rc.head.run_driver("gpu_tasks.py", "2", "3")
    try:
        out, err = driver.communicate(timeout=150)
    except Exception:
        driver.kill()
        raise AssertionError(f"the driver did not finish:\n{rc.explain()}") from None
    assert driver.returncode == 0, f"{err[-3000:]}\n{rc.explain()}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 2 and "done" in out.splitlines(), rc.explain()

    jobs = rc.jobs()
    assert jobs, rc.explain()
    worker_ips = {j.spec["labels"][LABEL_NODE_IP] for j in jobs}
    # The tasks ran on the workers gpush started (never on the head, which has no GPU).
    assert {r["node"] for r in results} <= worker_ips, rc.explain()
    for job in jobs:
        assert job.placement["sharing"] == "slurm/mig" and job.placement["mig_profile"] == "1g.5gb"
        assert job.backend_id.isdigit()  # a Slurm job id: slurmd ran `ray start`

    # Idle for idle_timeout_minutes: the autoscaler terminates them, gpush cancels them in Slurm.
    wait_for(lambda: not rc.jobs(states=["running", "submitted"]), 90, f"the workers to go:\n{rc.explain()}", pause=1)
    assert {j.state.value for j in rc.jobs()} <= {"cancelled", "succeeded"}
    wait_for(lambda: len(rc.head.alive_nodes()) == 1, 30, "the workers to leave the Ray cluster", pause=1)


def test_a_worker_over_quota_stays_pending_with_gpushs_reason_and_starts_when_quota_frees(broker, ray_cluster, slurm):
    one_slice = 1 / 7  # a 1g.5gb slice of a 7-slice A100 in GPU-equivalents
    broker.admin.set_tenant("rayq", gpu_quota=round(one_slice, 4) + 0.001)
    rc = ray_cluster(tenant="rayq")
    driver = rc.head.run_driver("gpu_tasks.py", "2", "20")
    try:

        def one_running_one_waiting():
            states = sorted(j.state.value for j in rc.jobs())
            return states == ["queued", "running"]

        wait_for(one_running_one_waiting, 60, f"one worker running and one waiting:\n{rc.explain()}", pause=1)
        (waiting,) = rc.jobs(states=["queued"])
        assert waiting.state_reason.startswith("tenant rayq at quota"), rc.explain()
        # Ray's autoscaler shows the same worker as pending, with gpush's reason (`ray status`
        # prints it in lower case), and neither launches another one nor gives up on it.
        pending = f"{waiting.spec['labels'][LABEL_NODE_IP]}: mig_worker, queued in gpush: {waiting.state_reason}"
        wait_for(lambda: pending.lower() in (rc.head.status() or ""), 20, f"the reason in ray status:\n{rc.explain()}")
        time.sleep(5)
        assert len(rc.jobs()) == 2, rc.explain()

        broker.admin.set_tenant("rayq", gpu_quota=1)
        wait_for(lambda: rc.client.get(waiting.id).state.value == "running", 30, f"the waiting worker:\n{rc.explain()}")
        out, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, f"{err[-3000:]}\n{rc.explain()}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == 2
    assert len(rc.jobs()) == 2  # the waiting worker was never relaunched


def test_a_worker_whose_ray_start_is_slower_than_rays_heartbeat_timeout_is_pending_not_replaced(ray_cluster, slurm):
    """Ray's autoscaler replaces an up-to-date node that sends no heartbeat within 30 s
    ("lost contact with raylet"). Issue 33: on a cold machine a worker's ray start took
    longer than that after its job started, so Ray cancelled it and launched another. It
    is pending, with the reason, until it joins."""
    bin_dir = Path(tempfile.mkdtemp(prefix="gpush-slow-ray-"))
    bin_dir.chmod(0o755)  # Slurm's job runs it
    slow = bin_dir / "ray"
    slow.write_text(f'#!/bin/sh\nsleep 40\nexec {RAY} "$@"\n')
    slow.chmod(0o755)
    try:
        rc = ray_cluster(ray_command=str(slow))
        driver = rc.head.run_driver("gpu_tasks.py", "1", "1")
        try:
            wait_for(lambda: NOT_JOINED.lower() in (rc.head.status() or "").lower(), 90, f"the reason:\n{rc.explain()}")
            out, err = driver.communicate(timeout=150)
        finally:
            if driver.poll() is None:
                driver.kill()
        assert driver.returncode == 0, f"{err[-3000:]}\n{rc.explain()}"
        assert len(rc.jobs()) == 1, rc.explain()  # the worker was never replaced
        assert "lost contact with raylet" not in rc.head.monitor_log(tail=None), rc.explain()
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)


def test_a_queued_worker_is_cancelled_in_gpush_when_the_work_that_wanted_it_is_done(broker, ray_cluster, slurm):
    one_slice = 1 / 7
    broker.admin.set_tenant("rayc", gpu_quota=round(one_slice, 4) + 0.001)
    # The running worker idles out only after a minute (and holds the quota meanwhile, so the
    # queued one cannot start); the queued one is let go 6 s after the demand for it is gone.
    rc = ray_cluster(tenant="rayc", idle_timeout_minutes=1, queued_idle_timeout_minutes=0.1)
    driver = rc.head.run_driver("gpu_tasks.py", "2", "4")
    try:
        wait_for(
            lambda: sorted(j.state.value for j in rc.jobs()) == ["queued", "running"],
            60,
            f"one worker running and one waiting:\n{rc.explain()}",
            pause=1,
        )
        (waiting,) = rc.jobs(states=["queued"])
        (running,) = rc.jobs(states=["running"])
        assert waiting.state_reason.startswith("tenant rayc at quota"), rc.explain()
        # Both tasks run on the one worker gpush started, one after the other.
        out, err = driver.communicate(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, f"{err[-3000:]}\n{rc.explain()}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert {r["node"] for r in results} == {running.spec["labels"][LABEL_NODE_IP]}, rc.explain()

    # No demand left: the provider cancels the queued worker in gpush, and Ray forgets it.
    wait_for(
        lambda: rc.client.get(waiting.id).state.value == "cancelled", 30, f"the queued worker to go:\n{rc.explain()}"
    )
    wait_for(lambda: "queued in gpush" not in (rc.head.status() or "queued in gpush"), 20, rc.explain(), pause=1)
    line = wait_for(
        lambda: re.search(
            rf"cancelled queued worker {waiting.id} \(mig_worker, .*for (\d+) s", rc.head.monitor_log(tail=None)
        ),
        10,
        f"the monitor's log line:\n{rc.explain()}",
    )
    assert int(line.group(1)) >= 6  # not before the grace
    time.sleep(6)  # one more autoscaler update or so: nothing relaunched, the running worker untouched
    assert len(rc.jobs()) == 2, rc.explain()
    assert rc.client.get(running.id).state.value == "running", rc.explain()


def test_gpush_submit_ray_runs_a_ray_job_whose_gpus_come_through_gpush_and_follows_it(ray_cluster):
    rc = ray_cluster()
    script = Path(__file__).parent / "ray" / "gpu_tasks.py"
    result = subprocess.run(
        [GPUSH, "submit", "--ray", rc.head.dashboard_url, "--", sys.executable, str(script), "auto", "1", "1"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "GPUSH_TOKEN": rc.token},
    )
    assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}\n{rc.explain()}"
    lines = result.stdout.splitlines()
    assert "done" in lines  # the job's own output, followed to its end
    (task,) = [json.loads(line) for line in lines if line.startswith("{")]
    (worker,) = rc.jobs()
    assert task["node"] == worker.spec["labels"][LABEL_NODE_IP]  # on the worker gpush started
    failed = subprocess.run(
        [GPUSH, "submit", "--ray", rc.head.dashboard_url, "--", "sh", "-c", "exit 3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert failed.returncode == 1 and "failed" in failed.stderr.lower()


def test_a_ray_serve_deployment_gets_a_worker_per_gpu_replica_through_gpush_scales_on_load_and_gives_them_back(
    ray_cluster, slurm
):
    rc = ray_cluster()
    host, port = "127.0.0.2", free_port()  # Serve's one HTTP proxy, on the head (the head's address)
    url = f"http://{host}:{port}/"

    def run(*args: str, timeout: float) -> str:
        driver = rc.head.run_driver("serve_app.py", *args)
        try:
            out, err = driver.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            driver.kill()
            out, err = driver.communicate()
        assert driver.returncode == 0, f"serve_app.py {args} exited {driver.returncode}:\n{err[-3000:]}\n{rc.explain()}"
        return out

    # No worker yet: serve.run waits for min_replicas (1) replica of one GPU, which only a
    # worker gpush starts can hold.
    assert len(rc.head.alive_nodes()) == 1 and not rc.jobs()
    assert "deployed" in run("deploy", host, str(port), timeout=120).splitlines()
    (first,) = rc.jobs()
    assert first.state.value == "running", rc.explain()
    assert first.placement["sharing"] == "slurm/mig" and first.placement["mig_profile"] == "1g.5gb"
    answer = httpx.get(url, timeout=30).json()
    assert answer["node"] == first.spec["labels"][LABEL_NODE_IP], rc.explain()
    assert len(answer["gpu_ids"]) == 1

    # Load: four slow requests in flight at all times, against a target of one per replica.
    # Serve asks for a second replica, which makes the autoscaler launch a second worker.
    answers: list[dict] = []
    stop = threading.Event()

    def keep_asking() -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                answers.append(http.get(url, params={"sleep": 2}).json())

    with ThreadPoolExecutor(4) as pool:
        load = [pool.submit(keep_asking) for _ in range(4)]
        try:
            wait_for(
                lambda: len({a["replica"] for a in answers}) == 2 or any(f.done() for f in load),
                90,
                lambda: f"a second replica serving:\n{rc.explain()}",
                pause=0.5,
            )
        finally:
            stop.set()
        for f in load:
            f.result()  # every request was answered
    replicas = {a["replica"]: a["node"] for a in answers}
    assert len(replicas) == 2, f"{replicas}\n{rc.explain()}"
    jobs = rc.jobs()
    assert len(jobs) == 2, rc.explain()  # one worker per replica, no more
    assert {j.state.value for j in jobs} == {"running"}, rc.explain()
    assert all(j.placement["sharing"] == "slurm/mig" for j in jobs)
    # Each replica on a worker of its own, the two workers gpush started.
    assert sorted(replicas.values()) == sorted(j.spec["labels"][LABEL_NODE_IP] for j in jobs), rc.explain()

    # The load gone, Serve goes back to min_replicas (after downscale_delay_s); the worker of
    # the replica it removed idles out and gpush cancels its Slurm job, the other serves on.
    wait_for(
        lambda: sorted(j.state.value for j in rc.jobs()) == ["cancelled", "running"],
        60,
        lambda: f"one worker to be given back:\n{rc.explain()}",
        pause=1,
    )
    (kept,) = rc.jobs(states=["running"])
    assert httpx.get(url, timeout=30).json()["node"] == kept.spec["labels"][LABEL_NODE_IP]

    # Deleted: the last replica goes, its worker idles out and gpush cancels its Slurm job.
    assert "shut down" in run("shutdown", timeout=60).splitlines()
    wait_for(
        lambda: not rc.jobs(states=["running", "submitted"]), 90, lambda: f"the workers to go:\n{rc.explain()}", pause=1
    )
    assert {j.state.value for j in rc.jobs()} == {"cancelled"}, rc.explain()
    wait_for(lambda: len(rc.head.alive_nodes()) == 1, 30, "the workers to leave the Ray cluster", pause=1)
