"""The gpush node provider's logic (broker.ray.workers) against the API in this process,
without Ray: workers as labelled jobs, pending with gpush's reason, idempotent launch,
terminate as cancel, queued workers no demand wants cancelled. integration/test_ray.py
runs it under Ray's real autoscaler."""

from __future__ import annotations

import pytest

from broker.core.states import JobState, set_state
from broker.ray.workers import (
    LABEL_CLUSTER,
    LABEL_NODE_IP,
    STATUS_UP_TO_DATE,
    TAG_LAUNCH_CONFIG,
    TAG_NODE_KIND,
    TAG_NODE_STATUS,
    TAG_USER_NODE_TYPE,
    GpushWorkers,
    ProviderConfigError,
    ProviderSettings,
    serves,
)

PROVIDER = {"gpush_url": "http://gpush.test", "head_address": "127.0.0.2:6379", "ray_command": "/opt/ray/bin/ray"}
MIG_WORKER = {"gpush": {"kind": "inference", "isolation": "hardware", "gpu_memory_gb": 4, "time_limit": "1h"}}


@pytest.fixture
def workers(sdk, clock):
    def make(cluster: str = "serve", *, demand=None, raylets=None, min_workers=None, idle_timeout_minutes=5, **config):
        settings = ProviderSettings.from_provider_config({**PROVIDER, **config})
        return GpushWorkers(
            settings,
            cluster,
            client=sdk(user="ray", tenant="ml"),
            demand=demand,
            raylets=raylets,
            idle_timeout_minutes=idle_timeout_minutes,
            min_workers=min_workers,
            now=clock,
        )

    return make


def start(sessions, clock, node) -> None:
    with sessions() as session, session.begin():
        job_id = int(node.node_id)
        set_state(session, job_id, JobState.QUEUED, JobState.ROUTED, reason="r", now=clock())
        set_state(session, job_id, JobState.ROUTED, JobState.SUBMITTING, reason="s", now=clock())
        set_state(session, job_id, JobState.SUBMITTING, JobState.SUBMITTED, reason="s", now=clock())
        set_state(session, job_id, JobState.SUBMITTED, JobState.RUNNING, reason="on mig01", now=clock())


def test_a_worker_is_a_job_that_runs_ray_start_with_its_node_types_resources(workers):
    w = workers()
    (node,) = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1, "accel": 2}, 1, launch_config="abc123")
    spec = node.job.spec
    assert spec["kind"] == "inference" and spec["isolation"] == "hardware" and spec["gpu_memory_gb"] == 4
    argv = spec["command"]
    assert argv[:4] == ["/opt/ray/bin/ray", "start", "--address=127.0.0.2:6379", "--block"]
    assert "--num-cpus=1" in argv and "--num-gpus=1" in argv and '--resources={"accel": 2}' in argv
    assert f"--node-ip-address={node.internal_ip}" in argv and node.internal_ip.startswith("127.0.")
    assert any(a.startswith("--temp-dir=/tmp/ray-gpush/serve-") for a in argv)
    assert spec["labels"][LABEL_CLUSTER] == "serve"
    assert node.tags[TAG_NODE_KIND] == "worker" and node.tags[TAG_USER_NODE_TYPE] == "mig_worker"
    assert node.tags[TAG_LAUNCH_CONFIG] == "abc123"


def test_waiting_workers_are_pending_with_gpushs_reason_and_running_ones_up_to_date(workers, sessions, clock):
    w = workers()
    a, b = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2)
    assert a.internal_ip != b.internal_ip  # the autoscaler tells nodes apart by address
    with sessions() as session, session.begin():
        set_state(session, int(a.node_id), JobState.QUEUED, JobState.ROUTED, reason="r", now=clock())
        set_state(session, int(a.node_id), JobState.ROUTED, JobState.SUBMITTING, reason="s", now=clock())
        set_state(session, int(a.node_id), JobState.SUBMITTING, JobState.SUBMITTED, reason="s", now=clock())
        set_state(session, int(a.node_id), JobState.SUBMITTED, JobState.RUNNING, reason="on mig01", now=clock())
        set_state(
            session, int(b.node_id), JobState.QUEUED, JobState.HELD, reason="tenant ml at quota (1/1 GPU)", now=clock()
        )
    nodes = w.refresh()
    assert nodes[a.node_id].tags[TAG_NODE_STATUS] == STATUS_UP_TO_DATE
    assert nodes[b.node_id].tags[TAG_NODE_STATUS] == "held in gpush: tenant ml at quota (1/1 GPU)"


def test_a_running_worker_is_pending_until_its_ray_start_joined_the_ray_cluster(workers, sessions, clock):
    """Ray's autoscaler replaces an up-to-date node that sends no heartbeat within 30 s: a
    worker whose ray start is slower than that (issue 33: a cold machine) stays pending,
    with the reason, until its raylet is in the Ray cluster."""
    joined: list[set[str] | None] = [set()]
    w = workers(raylets=lambda: joined[0])
    a, b = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2)
    start(sessions, clock, a)
    start(sessions, clock, b)
    joined[0] = {a.internal_ip}
    nodes = w.refresh()
    assert nodes[a.node_id].tags[TAG_NODE_STATUS] == STATUS_UP_TO_DATE
    assert nodes[b.node_id].tags[TAG_NODE_STATUS] == "running in gpush: ray start has not joined the Ray cluster yet"
    assert nodes[b.node_id].running  # running in gpush: never cancelled as a queued worker nobody wants
    joined[0] = None  # the GCS did not answer: running is taken as joined, as before
    assert {n.tags[TAG_NODE_STATUS] for n in w.refresh().values()} == {STATUS_UP_TO_DATE}


def test_node_id_workers_are_known_by_their_number_among_the_joined_raylets(workers, sessions, clock):
    joined = {"1"}  # the head
    w = workers(raylets=lambda: joined, worker_ip="node-id", use_node_id_as_ip=True)
    (a,) = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 1)
    start(sessions, clock, a)
    assert w.refresh()[a.node_id].tags[TAG_NODE_STATUS] != STATUS_UP_TO_DATE
    joined.add(a.internal_ip)  # "2": its NODE_ID_AS_RESOURCE, as the monitor keys it
    assert w.refresh()[a.node_id].tags[TAG_NODE_STATUS] == STATUS_UP_TO_DATE


def test_launch_is_idempotent_by_request_id(workers):
    w = workers()
    first = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2, request_id="req-1")
    again = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2, request_id="req-1")
    assert [n.node_id for n in again] == [n.node_id for n in first]
    assert len(w.refresh()) == 2


def test_a_restarted_provider_finds_its_workers_by_label_and_only_its_own(workers):
    mine = workers("serve").launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2)
    workers("other").launch("mig_worker", MIG_WORKER, {"GPU": 1}, 1)
    found = workers("serve").refresh()
    assert set(found) == {n.node_id for n in mine}
    assert {n.internal_ip for n in found.values()} == {n.internal_ip for n in mine}


def test_terminate_cancels_and_the_node_is_gone_at_once(workers, sdk):
    w = workers()
    a, b = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 2)
    w.terminate([a.node_id])
    assert set(w.refresh()) == {b.node_id}
    assert w.node(a.node_id) is None
    assert w.client.get(int(a.node_id)).state == JobState.CANCELLED
    # Its address is free again for the next worker.
    (c,) = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 1)
    assert c.internal_ip == a.internal_ip


def test_node_id_mode_names_workers_by_a_resource_instead_of_an_address(workers):
    w = workers(worker_ip="node-id", use_node_id_as_ip=True)
    (node,) = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 1)
    assert node.internal_ip == "2" and w.head_ip() == "1"
    assert '--resources={"NODE_ID_AS_RESOURCE": 2}' in node.job.spec["command"]
    assert not any(a.startswith("--node-ip-address") for a in node.job.spec["command"])


@pytest.mark.parametrize(
    "config, node_config, message",
    [
        ({"head_address": None}, MIG_WORKER, "head_address"),
        ({"worker_ip": "dhcp"}, MIG_WORKER, "worker_ip"),
        ({}, {}, "node_config.gpush"),
        ({}, {"gpush": {**MIG_WORKER["gpush"], "command": ["x"]}}, "set by the provider"),
        ({}, {"gpush": {"kind": "inference", "isolation": "hardware"}}, "gpu_memory_gb"),
    ],
)
def test_a_wrong_config_says_what_to_fix(workers, config, node_config, message):
    with pytest.raises(ProviderConfigError, match=message):
        workers(**config).launch("mig_worker", node_config, {"GPU": 1}, 1)


def test_jobs_are_listed_by_label(sdk):
    client = sdk(user="alice", tenant="ml")
    job = {"kind": "batch", "command": ["true"]}
    a = client.submit({**job, "labels": {"team": "a", "tier": "x"}})
    client.submit({**job, "labels": {"team": "b", "tier": "x"}})
    assert [j.id for j in client.list(labels={"team": "a"}).jobs] == [a.id]
    assert len(client.list(labels={"tier": "x"}).jobs) == 2
    assert client.list(labels={"team": "a", "tier": "y"}).jobs == []


def test_a_label_filter_that_is_not_key_value_is_refused(http):
    response = http().get("/v1/jobs", params={"label": "team"})
    assert response.status_code == 422
    assert "KEY=VALUE" in response.json()["error"]["message"]


def test_the_shim_uses_rays_tag_names():
    from ray.autoscaler import tags  # Ray itself: imported here, the rest of the module runs without it

    assert (TAG_NODE_KIND, TAG_NODE_STATUS, TAG_USER_NODE_TYPE, TAG_LAUNCH_CONFIG) == (
        tags.TAG_RAY_NODE_KIND,
        tags.TAG_RAY_NODE_STATUS,
        tags.TAG_RAY_USER_NODE_TYPE,
        tags.TAG_RAY_LAUNCH_CONFIG,
    )
    assert STATUS_UP_TO_DATE == tags.STATUS_UP_TO_DATE
    assert LABEL_NODE_IP.startswith("ray.gpush.io/")


def test_gpush_list_filters_by_label(gpush):
    mine = gpush("submit", "--kind", "batch", "--label", "ray.gpush.io/cluster=serve", "--", "true").out.strip()
    gpush("submit", "--kind", "batch", "--", "true")
    result = gpush("list", "--label", "ray.gpush.io/cluster=serve", "--json")
    assert result.code == 0 and [j["id"] for j in result.json["jobs"]] == [int(mine)]
    assert gpush("list", "--label", "nokeyvalue").code == 2


class Demand:
    """A stand-in for the Ray cluster's demand: the shapes it waits for, or None (unknown)."""

    def __init__(self, *shapes):
        self.shapes = list(shapes)
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return None if self.shapes == [None] else list(self.shapes)


def test_a_queued_worker_is_cancelled_once_no_demand_it_could_serve_has_been_seen_for_the_grace(
    workers, sessions, clock, caplog
):
    demand = Demand({"GPU": 1, "CPU": 1})
    w = workers(demand=demand, idle_timeout_minutes=2)  # grace: the cluster's idle_timeout_minutes
    running, queued = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1}, 2)
    start(sessions, clock, running)

    clock.advance(600)  # demand present: kept however long it waits
    assert set(w.reap()) == {running.node_id, queued.node_id}

    demand.shapes = [{"CPU": 2}, {"GPU": 2}, {"TPU": 1}]  # nothing a mig_worker could hold
    clock.advance(119)
    assert set(w.reap()) == {running.node_id, queued.node_id}  # quiet for less than the grace

    clock.advance(2)
    with caplog.at_level("INFO", logger="gpush.ray"):
        assert set(w.reap()) == {running.node_id}  # a node that went away
    assert w.client.get(int(queued.node_id)).state == JobState.CANCELLED
    assert w.client.get(int(running.node_id)).state == JobState.RUNNING  # a running worker is Ray's to end
    (line,) = [r.getMessage() for r in caplog.records if "cancelled queued worker" in r.getMessage()]
    assert f"worker {queued.node_id} (mig_worker, queued in gpush" in line and "no pending demand" in line
    assert "for 121 s" in line

    clock.advance(600)
    caplog.clear()
    with caplog.at_level("INFO", logger="gpush.ray"):
        assert set(w.reap()) == {running.node_id}
    assert not caplog.records  # once: a cancelled worker is not listed, so not cancelled again
    assert w.node(queued.node_id) is None


def test_demand_that_comes_back_restarts_the_grace(workers, clock):
    demand = Demand()
    w = workers(demand=demand, idle_timeout_minutes=1)
    (queued,) = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1}, 1)
    clock.advance(50)
    demand.shapes = [{"GPU": 0.5}]  # a fraction of a GPU: a mig_worker could serve it
    assert set(w.reap()) == {queued.node_id}
    demand.shapes = []
    clock.advance(50)
    assert set(w.reap()) == {queued.node_id}  # 100 s since launch, only 50 since the demand
    clock.advance(11)
    assert w.reap() == {}


def test_a_worker_younger_than_the_grace_is_kept_and_unknown_demand_keeps_every_worker(workers, clock):
    demand = Demand(None)
    w = workers(demand=demand, queued_idle_timeout_minutes=1)
    clock.advance(120)  # the provider has run a while with no demand
    (young,) = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1}, 1)
    clock.advance(90)
    assert set(w.reap()) == {young.node_id}  # the GCS did not answer: kept
    demand.shapes = []
    clock.advance(30)
    assert set(w.reap()) == {young.node_id}  # unknown 30 s ago counts as demand then
    clock.advance(31)
    assert w.reap() == {}


def test_a_restarted_provider_waits_a_full_grace_and_cancels_only_once(workers, clock, sdk):
    w = workers(demand=Demand(), idle_timeout_minutes=1)
    a, b = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1}, 2)
    clock.advance(50)
    assert len(w.reap()) == 2
    # The monitor restarts: a new provider, no memory of when demand was last seen.
    clock.advance(30)
    again = workers(demand=Demand(), idle_timeout_minutes=1)
    assert len(again.reap()) == 2  # 80 s since launch, but it has not watched for a full grace
    clock.advance(61)
    assert again.reap() == {}
    # The old instance, still around, finds nothing to cancel: the cancels are in gpush.
    assert w.reap() == {}
    for node in (a, b):
        assert w.client.get(int(node.node_id)).state == JobState.CANCELLED
        cancels = [e for e in w.client.events(int(node.node_id)) if e.to_state == JobState.CANCELLED]
        assert len(cancels) == 1


def test_queued_workers_are_kept_down_to_min_workers_and_only_the_node_types_nobody_wants(workers, clock):
    cpu_worker = {"gpush": {"kind": "batch", "cpus": 4, "time_limit": "1h"}}
    demand = Demand({"CPU": 4})
    w = workers(demand=demand, idle_timeout_minutes=1, min_workers={"mig_worker": 1})
    mig = w.launch("mig_worker", MIG_WORKER, {"CPU": 1, "GPU": 1}, 3)
    (cpu,) = w.launch("cpu_worker", cpu_worker, {"CPU": 4}, 1)
    clock.advance(61)
    left = w.reap()
    # A CPU-only task a mig_worker cannot hold (it has 1 CPU) keeps the cpu_worker only;
    # of the mig_workers, min_workers stay: the oldest.
    assert set(left) == {cpu.node_id, mig[0].node_id}


def test_without_a_demand_reader_nothing_is_cancelled(workers, clock):
    w = workers(idle_timeout_minutes=0)
    (node,) = w.launch("mig_worker", MIG_WORKER, {"GPU": 1}, 1)
    clock.advance(3600)
    assert set(w.reap()) == {node.node_id}


def test_serves_compares_every_resource_of_the_shape():
    assert serves({"CPU": 1, "GPU": 1}, {"GPU": 1}) and serves({"CPU": 1, "GPU": 1}, {"GPU": 0.25, "CPU": 1})
    assert not serves({"CPU": 1, "GPU": 1}, {"GPU": 2}) and not serves({"CPU": 1}, {"accel": 1})
    assert serves(None, {"anything": 8})  # launched before the resources were recorded: kept


def test_queued_idle_timeout_must_be_minutes():
    with pytest.raises(ProviderConfigError, match="queued_idle_timeout_minutes"):
        ProviderSettings.from_provider_config({**PROVIDER, "queued_idle_timeout_minutes": "soon"})
    assert (
        ProviderSettings.from_provider_config(
            {**PROVIDER, "queued_idle_timeout_minutes": 0.1}
        ).queued_idle_timeout_minutes
        == 0.1
    )


def test_the_provider_reads_the_cluster_yaml_the_monitor_was_started_with(tmp_path):
    from broker.ray import provider as ray_provider  # imports Ray

    path = tmp_path / "cluster.yaml"
    path.write_text("idle_timeout_minutes: 0.5\navailable_node_types: {w: {min_workers: 2}}\n")
    argv = ["monitor.py", "--logs-dir=/tmp/x", f"--autoscaling-config={path}", "--gcs-address=127.0.0.2:6379"]
    assert ray_provider.monitor_cluster_config(argv)["available_node_types"]["w"]["min_workers"] == 2
    assert ray_provider._monitor_arg("gcs-address", argv) == "127.0.0.2:6379"
    assert ray_provider.monitor_cluster_config(["pytest"]) is None
