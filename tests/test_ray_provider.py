"""The gpush node provider's logic (broker.ray_workers) against the API in this process,
without Ray: workers as labelled jobs, pending with gpush's reason, idempotent launch,
terminate as cancel. integration/test_ray.py runs it under Ray's real autoscaler."""

from __future__ import annotations

import pytest

from broker.ray_workers import (
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
)
from broker.states import JobState, set_state

PROVIDER = {"gpush_url": "http://gpush.test", "head_address": "127.0.0.2:6379", "ray_command": "/opt/ray/bin/ray"}
MIG_WORKER = {"gpush": {"kind": "inference", "isolation": "hardware", "gpu_memory_gb": 4, "time_limit": "1h"}}


@pytest.fixture
def workers(sdk):
    def make(cluster: str = "serve", **config) -> GpushWorkers:
        settings = ProviderSettings.from_provider_config({**PROVIDER, **config})
        return GpushWorkers(settings, cluster, client=sdk(user="ray", tenant="ml"))

    return make


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
    assert response.status_code == 422 or response.status_code == 400
    assert "KEY=VALUE" in response.json()["error"]["message"]


def test_the_shim_uses_rays_tag_names():
    tags = pytest.importorskip("ray.autoscaler.tags")
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
