"""Replays in virtual time, the whole-GPU comparison, the openb trace, fragmentation-aware
placement, the inflation experiment and the simulation report."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from broker.core.adapter import Sharing
from broker.core.errors import InvalidRequest
from broker.placement.fgd import NodeState, TaskShape, WorkloadDistribution, best_fit, choose, node_fragmentation
from broker.placement.fragmentation import SharedGpuNodes, SharedNode
from broker.routing.policy import load_policy
from broker.simulation.fleet import load_fleet, load_fleet_file
from broker.simulation.inflation import inflation_arrivals, inflation_experiment
from broker.simulation.replay import replay
from broker.simulation.report import run_simulation
from broker.simulation.report_text import summary_lines
from broker.simulation.shared import CpuWork, replay_shared
from broker.simulation.traces import load_openb, openb_policy, pod_job, read_pods, trace_model
from broker.simulation.workload import TenantTerms, parse_workload, read_workload, whole_gpu_fleet, whole_gpu_policy

ROOT = Path(__file__).resolve().parents[2]
DEMO_FLEET = ROOT / "examples" / "fleet.yaml"
DEMO_WORKLOAD = ROOT / "examples" / "workload.yaml"
DEFAULT_POLICY = ROOT / "policies" / "default.yaml"
# The openb trace lists the tests read, in the repository (data/traces/alibaba-openb-2023/README.md
# says where they come from and on what terms).
SHIPPED_TRACE = ROOT / "data" / "traces" / "alibaba-openb-2023"

SMALL_FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - {name: gpu, count: 1, gpus: [{model: A100-SXM4-80GB, count: 2}]}
  k8s-a:
    flavor: k8s
    pools:
      - {name: t4, nodes: 1, gpus_per_node: 2, model: T4, timeslice_replicas: 4}
"""
SMALL_POLICY = """
rules:
  - name: shared
    match: {isolation: none, gpu_memory_gb: {max: 4}}
    route: {cluster: k8s-a, sharing: k8s/timeslice}
  - name: rest
    match: {}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""


def policy(text: str = SMALL_POLICY):
    return load_policy(text, "test policy")


def default_policy():
    return load_policy(DEFAULT_POLICY.read_text(), str(DEFAULT_POLICY))


def jobs_by_name(result) -> dict:
    return {job.name: job for job in result.jobs}


# -- the workload file -----------------------------------------------------------------


def test_a_workload_file_gives_timed_jobs_with_copies() -> None:
    arrivals = parse_workload(
        """
jobs:
  - {name: tune, at: 10, duration: 90m, count: 3, every: 60, kind: training, isolation: hardware,
     gpu_memory_gb: 5, tenant: nlp}
  - {at: 0, duration: 30, kind: inference, isolation: none, gpu_memory_gb: 2}
""",
        "w.yaml",
    )
    assert [(a.spec.name, a.at, a.duration) for a in arrivals] == [
        ("tune-1", 10, 5400),
        ("tune-2", 70, 5400),
        ("tune-3", 130, 5400),
        (None, 0, 30),
    ]
    assert arrivals[0].tenant == "nlp"
    assert arrivals[3].spec.command == ["sleep", "30"]  # a simulated job runs nothing


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("jobs: [{at: 0, kind: training}]", ["job 1", "duration is required"]),
        ("jobs: [{at: -5, duration: 10, kind: training}]", ["job 1", "at -5", "0 or more"]),
        ("jobs: [{name: x, at: 0, duration: 10, kind: trainer}]", ["job 1 (x)", "kind"]),
        ("jobs: [{at: 0, duration: 10, kind: training, count: 0}]", ["count 0"]),
        ("jobs: {at: 0}", ["expected jobs:"]),
    ],
)
def test_a_bad_workload_says_which_job_and_field(text: str, words: list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_workload(text, "w.yaml")
    for word in words:
        assert word in str(err.value)


# -- replay on a simulated fleet -------------------------------------------------------------


def test_replay_places_and_finishes_a_mixed_workload_on_the_demo_fleet() -> None:
    arrivals = parse_workload(
        """
jobs:
  - {name: mig, at: 0, duration: 600, kind: training, isolation: hardware, gpu_memory_gb: 5}
  - {name: mps, at: 30, duration: 300, kind: inference, isolation: process, gpu_memory_gb: 2}
  - {name: chat, at: 60, duration: 900, kind: inference, isolation: none, gpu_memory_gb: 3,
     elastic: {min_replicas: 2, max_replicas: 4}}
  - {name: big, at: 90, duration: 1200, kind: training, gpus: 4}
""",
        "w.yaml",
    )
    result = replay(load_fleet_file(DEMO_FLEET), default_policy(), arrivals)
    jobs = jobs_by_name(result)
    assert {name: (j.state, j.cluster, j.sharing) for name, j in jobs.items()} == {
        "mig": ("succeeded", "slurm-a", "slurm/mig"),
        "mps": ("succeeded", "slurm-a", "slurm/mps"),
        "chat": ("succeeded", "k8s-a", "k8s/timeslice"),
        "big": ("succeeded", "slurm-a", "slurm/exclusive"),
    }
    for job in jobs.values():
        assert job.start == job.arrival  # the fleet is empty: nobody waits
    assert jobs["mig"].end == 600 and jobs["big"].end == 90 + 1200
    assert jobs["mig"].gpu_equivalents == pytest.approx(1 / 7)  # a 1g.5gb slice
    assert jobs["chat"].gpu_equivalents == pytest.approx(2 / 4)  # two replicas of a T4 split 4 ways
    summary = result.summary()
    assert summary["placed"] == 4 and summary["held"] == 0 and summary["still_waiting"] == 0
    assert 0 < summary["allocation_peak"] < 1
    assert set(summary["tier_allocation_mean"]) == {"slurm", "k8s"}
    assert result.timeline.allocated[-1] == 0  # everything ended


def test_a_job_waits_until_a_gpu_frees_and_the_wait_is_recorded() -> None:
    arrivals = parse_workload(
        "jobs: [{name: train, at: 0, duration: 100, count: 3, every: 10, kind: training}]", "w.yaml"
    )
    result = replay(load_fleet(SMALL_FLEET, "fleet"), policy(), arrivals)
    jobs = jobs_by_name(result)
    assert [jobs[f"train-{i}"].start for i in (1, 2, 3)] == [0, 10, 100]  # two GPUs
    assert jobs["train-3"].wait == 80
    assert result.waits()["training"]["p50"] == 0
    assert max(result.timeline.queue) == 1
    # While train-3 waited, the two time-sliced T4s were free, but it is not routed there.
    assert max(result.timeline.stranded) == 2


def test_held_jobs_are_counted_with_their_reasons() -> None:
    no_catch_all = policy(
        """
rules:
  - name: training-only
    match: {kind: training}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
"""
    )
    arrivals = parse_workload(
        """
jobs:
  - {name: huge, at: 0, duration: 60, kind: training, gpus: 16}
  - {name: stray, at: 0, duration: 60, kind: batch}
  - {name: fine, at: 0, duration: 60, kind: training}
""",
        "w.yaml",
    )
    result = replay(load_fleet(SMALL_FLEET, "fleet"), no_catch_all, arrivals)
    jobs = jobs_by_name(result)
    assert jobs["fine"].state == "succeeded"
    assert jobs["huge"].state == jobs["stray"].state == "held"
    assert "can never fit" in jobs["huge"].reason and "16 whole GPUs" in jobs["huge"].reason
    assert "no rule matches" in jobs["stray"].reason
    summary = result.summary()
    assert summary["held"] == 2
    assert sorted(summary["held_reasons"].values()) == [1, 1]


# -- fair share and quotas ----------------------------------------------------------------------

# One contended pool: 8 whole A100s, every job sent there.
POOL_FLEET = """
clusters:
  slurm-a:
    flavor: slurm
    nodes:
      - {name: gpu, count: 2, gpus: [{model: A100-SXM4-80GB, count: 4}]}
"""
POOL_POLICY = "rules:\n  - {name: all, match: {}, route: {cluster: slurm-a, sharing: slurm/exclusive}}\n"


def pool_replay(text: str, **options):
    workload = read_workload(text, "w.yaml")
    return replay(
        load_fleet(POOL_FLEET, "fleet"), policy(POOL_POLICY), workload.arrivals, tenants=workload.tenants, **options
    )


def held_at(result, tenant: str, t: float) -> float:
    """GPU-equivalents the tenant held at virtual time ``t``."""
    timeline = result.timeline
    at = max(i for i, when in enumerate(timeline.t) if when <= t)
    return timeline.tenants[tenant][at]


def test_a_workload_lists_tenants_weights_and_quotas() -> None:
    workload = read_workload(
        """
tenants:
  nlp: {weight: 2, gpu_quota: 8}
  vision: {weight: 1}
  ops:
jobs:
  - {at: 0, duration: 60, kind: training, tenant: nlp}
""",
        "w.yaml",
    )
    assert workload.tenants == {
        "nlp": TenantTerms(2.0, 8.0),
        "vision": TenantTerms(1.0, None),
        "ops": TenantTerms(1.0, None),
    }
    assert [a.tenant for a in workload.arrivals] == ["nlp"]
    assert read_workload("jobs: [{at: 0, duration: 60, kind: training}]", "w.yaml").tenants == {}


@pytest.mark.parametrize(
    ("section", "words"),
    [
        ("tenants: {nlp: {weight: 0}}", ["tenant nlp", "weight 0 must be more than 0"]),
        ("tenants: {nlp: {gpu_quota: -1}}", ["tenant nlp", "gpu_quota -1 must be 0 or more"]),
        ("tenants: {nlp: {quota: 8}}", ["tenant nlp", "unknown field 'quota'", "gpu_quota"]),
        ("tenants: {nlp: {weight: lots}}", ["tenant nlp", "weight 'lots' must be a number"]),
        ("tenants: [nlp]", ["tenants: expected a mapping"]),
    ],
)
def test_a_bad_tenants_section_says_which_tenant_and_field(section: str, words: list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        read_workload(section + "\njobs: [{at: 0, duration: 60, kind: training}]", "w.yaml")
    for word in words:
        assert word in str(err.value)


def test_tenants_weighted_3_to_1_converge_to_75_25_of_a_contended_pool() -> None:
    # Both tenants arrive together and fill the pool half and half; as jobs end, the freed
    # GPUs go to whoever is furthest below its weighted share, until a holds 6 and b 2.
    jobs = [
        f"  - {{at: {i * 7}, duration: {600 + (i * 137) % 900}, kind: training, tenant: {tenant}}}"
        for tenant, count in (("a", 60), ("b", 20))
        for i in range(count)
    ]
    result = pool_replay("tenants: {a: {weight: 3}, b: {weight: 1}}\njobs:\n" + "\n".join(jobs))
    assert (held_at(result, "a", 60), held_at(result, "b", 60)) == (4, 4)
    for t in (3000, 5000, 7000):
        assert (held_at(result, "a", t), held_at(result, "b", t)) == (6, 2)
    tenants = result.summary()["tenants"]
    assert tenants["a"]["weight_share"] == 0.75 and tenants["b"]["weight_share"] == 0.25
    assert tenants["a"]["gpu_share_mean"] == pytest.approx(0.75, abs=0.03)
    assert tenants["b"]["gpu_share_mean"] == pytest.approx(0.25, abs=0.03)
    assert tenants["a"]["placed"] == 60 and tenants["b"]["placed"] == 20


QUOTA_WORKLOAD = """
tenants:
  nlp: {gpu_quota: 2}
jobs:
  - {name: nlp, at: 0, duration: 100, count: 5, kind: training, tenant: nlp}
  - {name: vision, at: 0, duration: 100, count: 4, kind: training, tenant: vision}
  - {name: nlp-big, at: 0, duration: 100, kind: training, gpus: 3, tenant: nlp}
"""


def test_a_tenant_at_its_quota_waits_with_the_reason_and_runs_as_its_jobs_end() -> None:
    result = pool_replay(QUOTA_WORKLOAD)
    jobs = jobs_by_name(result)
    # Two at a time, each pair once the one before ends; vision goes ahead meanwhile.
    assert [jobs[f"nlp-{i}"].start for i in range(1, 6)] == [0, 0, 100, 100, 200]
    assert [jobs[f"vision-{i}"].start for i in range(1, 5)] == [0, 0, 0, 0]
    assert max(result.timeline.tenants["nlp"]) == 2  # never over its quota
    assert [jobs[f"nlp-{i}"].quota_wait for i in range(1, 6)] == [0, 0, 100, 100, 200]
    assert jobs["nlp-3"].waited_for == jobs["nlp-5"].waited_for == "tenant nlp at quota (2/2 GPU)"
    assert jobs["nlp-1"].waited_for is None
    # Three GPUs never fit a quota of two: it waits, as the broker says, to the end.
    big = jobs["nlp-big"]
    assert big.state == "waiting" and big.start is None
    assert big.reason == "tenant nlp at quota (0/2 GPU)"
    assert big.quota_wait == 300
    nlp = result.summary()["tenants"]["nlp"]
    assert nlp["gpu_quota"] == 2 and nlp["gpu_peak"] == 2
    assert nlp["time_at_quota"] == 300 and nlp["jobs_waited_at_quota"] == 4
    assert result.summary()["tenants"]["vision"]["time_at_quota"] == 0


def test_free_gpus_while_jobs_wait_only_at_their_quota_are_not_stranded() -> None:
    result = pool_replay(QUOTA_WORKLOAD)
    # nlp's jobs wait at its quota with two of the eight GPUs free: a quota, not placement.
    assert max(result.timeline.queue) > 0
    assert max(result.timeline.stranded) == 0
    assert result.summary()["stranded_mean_gpus"] == 0


def test_quotas_hold_on_whole_gpus_and_on_gpu_sharing_nodes() -> None:
    whole = pool_replay(QUOTA_WORKLOAD, whole_gpus=True)
    assert max(whole.timeline.tenants["nlp"]) == 2
    assert jobs_by_name(whole)["nlp-5"].start == 200
    # Half-GPU jobs on one 4-GPU sharing node: a quota of 1 lets two run at a time.
    workload = read_workload(
        """
tenants: {a: {gpu_quota: 1}}
jobs:
  - {name: a, at: 0, duration: 100, count: 6, kind: inference, isolation: none, gpu_memory_gb: 8, tenant: a}
""",
        "w.yaml",
    )
    shared = replay_shared(
        [SharedNode("n", 4, gpu_memory_gb=16)],
        "openb",
        openb_policy("openb"),
        workload.arrivals,
        tenants=workload.tenants,
    )
    jobs = jobs_by_name(shared)
    assert {j.gpu_equivalents for j in jobs.values()} == {0.5}
    assert [jobs[f"a-{i}"].start for i in range(1, 7)] == [0, 0, 100, 100, 200, 200]
    assert max(shared.timeline.tenants["a"]) == 1
    assert shared.summary()["tenants"]["a"]["time_at_quota"] == 200


def test_a_lone_tenant_uses_the_whole_pool() -> None:
    # b's weight is large, but b has no jobs: a alone may use everything.
    result = pool_replay(
        "tenants: {a: {weight: 1}, b: {weight: 9}}\n"
        "jobs: [{name: a, at: 0, duration: 100, count: 12, kind: training, tenant: a}]"
    )
    assert max(result.timeline.tenants["a"]) == 8
    assert sorted(j.start for j in result.jobs) == [0] * 8 + [100] * 4
    assert result.summary()["tenants"]["a"]["gpu_share_mean"] == 1.0


def test_priority_goes_before_fair_share_and_fair_share_before_age_in_a_replay() -> None:
    # a fills the pool; b arrives and waits far below its share, behind a's older job.
    result = pool_replay(
        """
jobs:
  - {name: a-first, at: 0, duration: 100, kind: training, tenant: a}
  - {name: a-second, at: 0, duration: 200, kind: training, tenant: a}
  - {name: a, at: 0, duration: 1000, count: 6, kind: training, tenant: a}
  - {name: a-older, at: 5, duration: 100, kind: training, tenant: a}
  - {name: b, at: 10, duration: 1000, count: 4, kind: training, tenant: b}
  - {name: a-urgent, at: 20, duration: 100, kind: training, tenant: a, priority: 10}
"""
    )
    jobs = jobs_by_name(result)
    # One GPU frees at 100: a's urgent job takes it, although b holds nothing.
    assert jobs["a-urgent"].start == 100 and held_at(result, "b", 100) == 0
    # Two free at 200: both go to b, furthest below its share, before a's older job.
    assert [jobs[f"b-{i}"].start for i in (1, 2)] == [200, 200]
    assert jobs["a-older"].start > 200


# -- whole GPUs ------------------------------------------------------------------------------


def test_whole_gpus_turn_every_gpu_whole_and_every_route_exclusive() -> None:
    fleet = whole_gpu_fleet(load_fleet_file(DEMO_FLEET))
    for cluster in fleet.clusters.values():
        assert {gpu.mode for node in cluster.nodes for gpu in node.gpus} == {"whole"}
    assert fleet.cluster("slurm-a").gpu_count == 12 and fleet.cluster("k8s-a").gpu_count == 24
    whole = whole_gpu_policy(default_policy())
    rules = {rule.name: [(r.cluster, r.sharing) for r in rule.routes] for rule in whole.rules}
    assert rules["isolated-training-on-mig"] == [
        ("slurm-a", Sharing.SLURM_EXCLUSIVE),
        ("k8s-a", Sharing.K8S_EXCLUSIVE),
    ]
    assert rules["shared-inference-and-batch-on-timeslice"] == [("k8s-a", Sharing.K8S_EXCLUSIVE)]


def test_a_fractional_workload_takes_more_gpus_and_waits_longer_on_whole_gpus() -> None:
    arrivals = parse_workload(
        "jobs: [{name: serve, at: 0, duration: 600, count: 8, kind: inference, isolation: none, gpu_memory_gb: 3}]",
        "w.yaml",
    )
    fleet = load_fleet(SMALL_FLEET, "fleet")
    shared = replay(fleet, policy(), arrivals)
    whole = replay(fleet, policy(), arrivals, whole_gpus=True)
    # Eight quarter-GPU replicas fit the two time-sliced T4s at once...
    assert shared.summary()["placed"] == 8
    assert max(shared.timeline.allocated) == pytest.approx(2.0)
    assert shared.summary()["waits"]["all"]["p99"] == 0
    # ... but take a whole GPU each when nothing is shared: the T4s hold two at a time.
    assert {j.sharing for j in whole.jobs} == {"k8s/exclusive"}
    assert {j.gpu_equivalents for j in whole.jobs} == {1.0}
    assert whole.summary()["gpu_hours"] == pytest.approx(4 * shared.summary()["gpu_hours"])
    assert whole.summary()["waits"]["all"]["p99"] > 0
    assert whole.summary()["makespan"] > shared.summary()["makespan"]


# -- the openb trace -------------------------------------------------------------------------

NODES_CSV = """sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,32000,262144,0,
openb-node-0001,96000,393216,8,G2
openb-node-0002,32000,131072,4,V100M16
openb-node-0003,96000,786432,8,V100M32
openb-node-0004,8000,61440,1,G1
"""
PODS_CSV = """\
name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time
openb-pod-0000,12000,16384,1,1000,,LS,Running,0,1000,0
openb-pod-0001,6000,12288,1,460,,LS,Running,10,500,12
openb-pod-0002,4000,8192,1,810,,BE,Failed,20,300,20
openb-pod-0003,88000,0,0,0,,BE,Running,30,900,30
openb-pod-0004,64000,262144,8,1000,,LS,Pending,40,700,
openb-pod-0005,4000,8192,1,230,V100M16|V100M32,Burstable,Succeeded,50,80,51
"""


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES_CSV)
    (tmp_path / "openb_pod_list_default.csv").write_text(PODS_CSV)
    return tmp_path


def test_openb_models_map_to_gpush_models() -> None:
    assert trace_model("V100M16").name == "V100-SXM2-16GB"
    assert trace_model("V100M32").name == "V100-SXM2-32GB"
    assert trace_model("P100").name == "P100-PCIE-16GB"
    assert (trace_model("G2").memory_gb, trace_model("G3").memory_gb) == (16, 32)
    assert trace_model("G1").name == "G2"  # not in the catalog: taken as a 16 GB GPU
    with pytest.raises(InvalidRequest, match="openb codes are"):
        trace_model("X9")


def test_an_openb_trace_becomes_a_k8s_fleet_and_gpu_jobs(trace_dir: Path) -> None:
    trace = load_openb(trace_dir)
    fleet = trace.fleet()
    (cluster,) = fleet.clusters.values()
    assert (cluster.name, cluster.flavor) == ("openb", "k8s")
    assert [len(node.gpus) for node in cluster.nodes] == [8, 4, 8, 1]  # the CPU-only node is left out
    assert cluster.nodes[1].gpus[0].model.name == "V100-SXM2-16GB"
    assert trace.gpu_count == 21 and trace.reference_memory_gb == 16  # G2 (8) and G1 (1) are 16 GB
    assert trace.cpu_only_pods == 1
    jobs = {a.spec.name: a for a in trace.workload()}
    assert "openb-pod-0003" not in jobs  # CPU-only: skipped
    whole, shared, batch, multi, picky = (jobs[f"openb-pod-000{i}"] for i in (0, 1, 2, 4, 5))
    assert (whole.spec.kind, whole.spec.isolation, whole.spec.gpus) == ("training", "exclusive", 1)
    assert (shared.spec.kind, shared.spec.isolation) == ("inference", "none")
    assert shared.spec.gpu_memory_gb == pytest.approx(0.46 * 16)
    assert shared.task == TaskShape(460, 1, 6000, 12288)
    assert (shared.at, shared.duration) == (10, 488)  # from scheduling to deletion
    assert batch.spec.kind == "batch"  # best-effort
    assert (multi.spec.gpus, multi.duration) == (8, 660)  # never scheduled: from creation
    assert picky.gpu_models == ("V100M16", "V100M32")


def test_a_bad_trace_file_is_refused_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "pods.csv"
    path.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,0,1,lots\n")
    with pytest.raises(InvalidRequest, match="line 2: gpu_milli 'lots'"):
        read_pods(path)
    path.write_text("name,cpu_milli\np,1000\n")
    with pytest.raises(InvalidRequest, match="missing column"):
        read_pods(path)


def test_a_cpu_only_pod_is_not_a_gpush_job(trace_dir: Path) -> None:
    pod = next(p for p in load_openb(trace_dir).pods if p.cpu_only)
    with pytest.raises(ValueError, match="no GPU"):
        pod_job(pod, 16)


def test_the_trace_replays_on_gpu_sharing_nodes(trace_dir: Path) -> None:
    trace = load_openb(trace_dir)
    result = replay_shared(trace.shared_nodes(), trace.cluster, trace.policy(), trace.workload())
    jobs = jobs_by_name(result)
    assert all(j.state == "succeeded" for j in jobs.values())
    assert jobs["openb-pod-0001"].sharing == "k8s/timeslice"
    assert jobs["openb-pod-0001"].gpu_equivalents == pytest.approx(0.46)
    assert jobs["openb-pod-0004"].sharing == "k8s/exclusive"
    # The replay is deterministic: of the nodes that could hold each, the one FGD chose.
    assert jobs["openb-pod-0004"].node == "openb-node-0001"  # of the two 8-GPU nodes (0001, 0003)
    assert jobs["openb-pod-0005"].node == "openb-node-0002"  # of the two its gpu_spec names (0002, 0003)
    whole = replay_shared(
        trace.shared_nodes(), trace.cluster, trace.policy(), trace.workload(), placement="best-fit", whole_gpus=True
    )
    assert jobs_by_name(whole)["openb-pod-0001"].gpu_equivalents == 1.0
    assert jobs_by_name(whole)["openb-pod-0001"].demand == pytest.approx(0.46)


def test_cpu_only_work_holds_the_nodes_cpu_and_a_gpu_job_waits_for_it() -> None:
    # One node, 4 GPUs and 8 CPUs; a CPU-only task takes 6 CPUs from t=0 to t=50, so a
    # job that asks for 4 CPUs and a GPU waits for it; a second CPU-only task that
    # arrives while the node is full waits too, behind the waiting job.
    workload = read_workload("jobs: [{name: j, at: 10, duration: 100, kind: training, gpus: 1, cpus: 4}]", "w.yaml")
    node = SharedNode("n", 4, gpu_memory_gb=16, cpu_milli=8000, memory_mib=64000)
    work = [CpuWork(0, 50, 6000), CpuWork(20, 10, 8000), CpuWork(0, 5, 1_000_000)]
    result = replay_shared([node], "openb", openb_policy("openb"), workload.arrivals, cpu_work=work)
    assert jobs_by_name(result)["j"].start == 50
    assert "3 CPU-only pods" in result.notes[-1]
    assert "1 waited for room" in result.notes[-1] and "1 fit no node" in result.notes[-1]
    assert "never found room" not in result.notes[-1]  # placed when the job ended
    # Without the CPU-only work, the job starts when it arrives.
    alone = replay_shared([node], "openb", openb_policy("openb"), workload.arrivals)
    assert jobs_by_name(alone)["j"].start == 10
    assert not any("CPU-only" in n for n in alone.notes)


def test_the_trace_replay_places_its_cpu_only_pods(trace_dir: Path) -> None:
    trace = load_openb(trace_dir)
    work = trace.cpu_work()
    assert len(work) == trace.cpu_only_pods == 1
    result = replay_shared(trace.shared_nodes(), trace.cluster, trace.policy(), trace.workload(), cpu_work=work)
    assert all(j.state == "succeeded" for j in result.jobs)
    assert any("1 CPU-only pods" in n for n in result.notes)


def test_a_slice_of_the_shipped_trace_parses(tmp_path: Path) -> None:
    for name, rows in (("openb_node_list_gpu_node.csv", 60), ("openb_pod_list_default.csv", 200)):
        lines = (SHIPPED_TRACE / name).read_text().splitlines()[: rows + 1]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    trace = load_openb(tmp_path)
    assert len(trace.nodes) == 60 and len(trace.pods) == 200
    assert len(trace.workload()) + trace.cpu_only_pods == 200
    assert all(0 < t.gpu_milli <= 1000 for t in trace.tasks())


# -- fragmentation-aware placement -----------------------------------------------------------


def test_fgd_leaves_less_fragmentation_where_best_fit_strands_capacity() -> None:
    # Half-GPU tasks are what comes; a 200-milli task arrives. Best fit puts it on the
    # fuller GPU (500 free), leaving 300 that no half-GPU task can use; FGD puts it on the
    # emptier one (700 free), leaving 500 there, and both GPUs can still take a half.
    workload = WorkloadDistribution.of([TaskShape(500)] * 9 + [TaskShape(200)])
    nodes = [NodeState("a", (700,)), NodeState("b", (500,))]
    task = TaskShape(200)
    assert best_fit(nodes, task).node.name == "b"
    chosen = choose(nodes, task, workload)
    assert (chosen.node.name, chosen.gpus) == ("a", (0,))
    assert chosen.fragmentation_increase == pytest.approx(0.0)
    assert node_fragmentation((300,), None, workload) > node_fragmentation((500,), None, workload)

    def halves_placed(placement: str) -> int:
        nodes = [SharedNode("a", 1, model="A"), SharedNode("b", 1, model="B")]
        cluster = SharedGpuNodes(nodes, placement=placement, distribution=workload)
        cluster.place(TaskShape(300), models=("A",))  # a: 700 free
        cluster.place(TaskShape(500), models=("B",))  # b: 500 free
        assert cluster.nodes[cluster.place(task).node].name == ("a" if placement == "fgd" else "b")
        return sum(cluster.place(TaskShape(500)) is not None for _ in range(3))

    assert halves_placed("fgd") == 2
    assert halves_placed("best-fit") == 1


def test_fgd_counts_a_node_without_cpu_for_a_task_as_all_fragment() -> None:
    workload = WorkloadDistribution.of([TaskShape(1000, 1, 8000)])
    assert node_fragmentation((1000, 1000), 16000, workload) == 0
    assert node_fragmentation((1000, 1000), 4000, workload) == 2000
    assert node_fragmentation((1000, 600), None, workload) == 600


def test_the_placement_engine_agrees_with_choose_and_best_fit() -> None:
    rng = random.Random(7)
    shapes = [TaskShape(m, 1, c) for m in (230, 470, 810, 1000) for c in (2000, 8000)] + [TaskShape(1000, 2, 8000)]
    workload = WorkloadDistribution.of(shapes)
    nodes = [SharedNode(f"n{i}", rng.choice((1, 2, 4)), cpu_milli=rng.choice((None, 16000))) for i in range(8)]
    for placement, reference in (("fgd", lambda s, t: choose(s, t, workload)), ("best-fit", best_fit)):
        # FGD's rule alone: without the avoidance of kinds that larger work needs, which
        # choose() does not know (tests/placement/test_fragmentation_demand.py has it).
        cluster = SharedGpuNodes(
            nodes, placement=placement, distribution=workload, shapes=shapes, pinned_avoidance=0, size_avoidance=0
        )
        held = []
        for _ in range(150):
            if held and rng.random() < 0.3:
                cluster.release(held.pop(rng.randrange(len(held))))
                continue
            task = rng.choice(shapes)
            states = [cluster.state(i) for i in range(len(nodes))]
            expected = reference(states, task)
            slot = cluster.place(task)
            if expected is None:
                assert slot is None
                continue
            assert (nodes[slot.node].name, slot.gpus) == (expected.node.name, expected.gpus)
            held.append(slot)
        total = sum(node_fragmentation(s.gpu_free, s.cpu_free, workload) for s in map(cluster.state, range(8)))
        assert cluster.fragmentation_milli() == pytest.approx(total)


def test_inflation_on_a_small_synthetic_trace() -> None:
    nodes = [SharedNode(f"n{i}", gpus) for i, gpus in enumerate((4, 4, 4, 4, 2, 2, 8, 8))]
    tasks = (
        [TaskShape(300)] * 6
        + [TaskShape(700)] * 6
        + [TaskShape(500)] * 4
        + [TaskShape(1000)] * 6
        + [TaskShape(1000, 2)] * 2
        + [TaskShape(1000, 4)]
    )
    arrivals = inflation_arrivals(tasks, seed=3, capacity_milli=36_000)
    assert sum(t.demand_milli for t in arrivals) >= 1.3 * 36_000
    assert arrivals == inflation_arrivals(tasks, seed=3, capacity_milli=36_000)  # seeded
    result = inflation_experiment(nodes, tasks, seeds=range(5))
    medians = result["medians"]
    for name in ("gpush (fgd)", "gpush (best-fit)", "whole GPUs (best-fit)"):
        assert 0 < medians[name]["at_full"] <= 1
        assert 0 < medians[name]["at_first_failure"] <= medians[name]["at_end"] <= 1
    assert medians["gpush (fgd)"]["at_full"] >= medians["gpush (best-fit)"]["at_full"]
    assert medians["whole GPUs (best-fit)"]["at_full"] < medians["gpush (best-fit)"]["at_full"]


# -- the report -------------------------------------------------------------------------------


def test_the_demo_report_writes_markdown_json_and_plots(tmp_path: Path) -> None:
    result = run_simulation(
        str(DEMO_FLEET), str(DEMO_WORKLOAD), None, str(DEFAULT_POLICY), None, str(tmp_path / "report")
    )
    out = tmp_path / "report"
    for name in ("report.md", "results.json", "allocation.png", "queue.png", "waits.png", "jobs.png", "tiers.png"):
        assert (out / name).stat().st_size > 0, name
    json.dumps(result)  # what `gpush simulate --json` prints
    detail = json.loads((out / "results.json").read_text())
    assert len(detail["primary"]["jobs"]) == result["primary"]["jobs"]
    primary, whole = result["primary"], result["comparison"]
    assert whole["label"] == "whole GPUs"
    assert primary["held"] == whole["held"] == 1  # too-big, in both
    assert "16 whole GPUs" in next(iter(primary["held_reasons"]))
    # Sharing: the same jobs hold fewer GPUs and wait less.
    assert primary["gpu_hours"] < whole["gpu_hours"]
    assert primary["waits"]["all"]["p95"] <= whole["waits"]["all"]["p95"]
    assert whole["demand_mean"] == pytest.approx(primary["demand_mean"])
    report = (out / "report.md").read_text()
    assert "## Summary" in report and "![allocation.png](allocation.png)" in report
    lines = summary_lines(result)
    assert any("GPU allocation" in line for line in lines) and any("whole GPUs" in line for line in lines)


def test_a_trace_report_includes_the_inflation_experiment(trace_dir: Path, tmp_path: Path) -> None:
    result = run_simulation(None, None, str(trace_dir), None, None, str(tmp_path / "r"), seed=1)
    assert (tmp_path / "r" / "inflation.png").exists()
    assert set(result["inflation"]["medians"]) == {
        "gpush (fgd)",
        "gpush (fgd, joint)",
        "gpush (best-fit)",
        "gpush (first-fit)",
        "whole GPUs (best-fit)",
    }
    assert any("CPU-only pods" in note for note in result["notes"])
    assert result["primary"]["placement"] == "fgd"


def test_a_trace_replay_refuses_a_policy_for_other_clusters(trace_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="one cluster called 'openb'"):
        run_simulation(None, None, str(trace_dir), str(DEFAULT_POLICY), None, str(tmp_path / "r"))


def test_the_report_gives_per_tenant_figures(tmp_path: Path) -> None:
    for name, text in (("fleet.yaml", POOL_FLEET), ("workload.yaml", QUOTA_WORKLOAD), ("policy.yaml", POOL_POLICY)):
        (tmp_path / name).write_text(text)
    result = run_simulation(
        str(tmp_path / "fleet.yaml"),
        str(tmp_path / "workload.yaml"),
        None,
        str(tmp_path / "policy.yaml"),
        None,
        str(tmp_path / "r"),
        plots=False,
    )
    assert result["inputs"]["tenants"] == "nlp (weight 1, quota 2 GPU)"
    nlp = result["primary"]["tenants"]["nlp"]
    assert (nlp["jobs"], nlp["placed"], nlp["time_at_quota"]) == (6, 5, 300)
    assert result["comparison"]["tenants"]["nlp"]["gpu_peak"] == 2  # the whole-GPU run keeps the quota too
    assert not any("not replayed" in note for note in result["notes"] + result["primary"]["notes"])
    report = (tmp_path / "r" / "report.md").read_text()
    assert "## Tenants" in report
    assert "| nlp | 1 (50.0%) | 2 | 5 / 0 of 6 |" in report and "| 5m (4 jobs) |" in report
    detail = json.loads((tmp_path / "r" / "results.json").read_text())
    assert max(detail["primary"]["timeline"]["tenants"]["nlp"]) == 2
    assert max(detail["primary"]["timeline"]["at_quota"]["nlp"]) == 4
    lines = summary_lines(result)
    assert any(line.split() == ["nlp", "at", "quota", "5m", "5m"] for line in lines)
