"""The simulated fleet as the broker sees it: the fleet file and its errors, inventory,
and jobs that queue, run, end, fail and get cancelled in virtual time."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from broker.core.adapter import BackendState, ClusterAdapter, Placement, Rejected, Sharing, Unreachable, adapter_class
from broker.core.clock import ScaledClock
from broker.core.errors import InvalidRequest
from broker.core.schemas import JobSpec
from broker.simulation.cluster import SimulatedCluster
from broker.simulation.fleet import load_fleet, load_fleet_file

DEMO_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"
T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


class VirtualClock:
    """The time the broker would read: moved by the test, never by the wall clock."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now

    def at(self, seconds: float) -> None:
        self.now = T0 + timedelta(seconds=seconds)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def spec(duration: float | None = None, **fields) -> JobSpec:
    labels = fields.pop("labels", {})
    if duration is not None:
        labels["sim-duration"] = str(duration)
    return JobSpec(kind="batch", command=["python", "job.py"], labels=labels, **fields)


def placement(sharing: Sharing, units: int = 1, **fields) -> Placement:
    cluster = "slurm-a" if sharing.flavor == "slurm" else "k8s-a"
    return Placement(cluster=cluster, sharing=sharing, units=units, gpu_equivalents=float(units), **fields)


def slice_1g(node: str | None = "mig-01") -> Placement:
    return placement(Sharing.SLURM_MIG, mig_profile="1g.5gb", node=node)


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock()


@pytest.fixture
def slurm(clock: VirtualClock) -> SimulatedCluster:
    return SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET)}, clock=clock)


@pytest.fixture
def k8s(clock: VirtualClock) -> SimulatedCluster:
    return SimulatedCluster("k8s-a", {"fleet": str(DEMO_FLEET)}, clock=clock)


def units(cluster: SimulatedCluster, node: str, sharing: Sharing, profile: str | None = None):
    (unit,) = [u for u in cluster.inventory() if u.node == node and u.sharing is sharing and u.mig_profile == profile]
    return unit


def gpu_units(cluster: SimulatedCluster, node: str, sharing: Sharing):
    """The per-GPU units of an MPS or time-sliced node, by device index."""
    return sorted((u for u in cluster.inventory() if u.node == node and u.sharing is sharing), key=lambda u: u.gpus)


# -- the fleet file ----------------------------------------------------------------------


def test_demo_fleet_loads_with_numbered_nodes() -> None:
    fleet = load_fleet_file(DEMO_FLEET)
    slurm, k8s = fleet.cluster("slurm-a"), fleet.cluster("k8s-a")
    assert (slurm.flavor, k8s.flavor) == ("slurm", "k8s")
    assert [n.name for n in slurm.nodes] == ["mig-01", "mps-01", "gpu-01", "gpu-02"]
    assert [n.name for n in k8s.nodes] == ["t4-01", "t4-02", "a100-mig", "h100"]
    assert 30 <= slurm.gpu_count + k8s.gpu_count <= 50


def test_the_adapter_registry_finds_the_simulator(clock: VirtualClock) -> None:
    cls = adapter_class("sim")
    assert cls is SimulatedCluster
    assert isinstance(cls("k8s-a", {"fleet": str(DEMO_FLEET)}, clock=clock), ClusterAdapter)


def refusal(text: str) -> str:
    with pytest.raises(InvalidRequest) as info:
        load_fleet(text, "fleet.yaml")
    return info.value.message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n"
            "      - {name: n, gpus: [{model: A100-SXM4-40GB, mig: [4g.20gb, 4g.20gb]}]}\n",
            ["cluster s, node n, GPU entry 1", "need 8 compute slices", "has 7", "Choose instances"],
            id="mig-layout-too-big",
        ),
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n"
            "      - {name: n, gpus: [{model: A100-SXM4-40GB, mig: [3g.20gb, 3g.20gb, 1g.5gb]}]}\n",
            ["node n", "do not fit A100-SXM4-40GB's MIG placements"],
            id="mig-layout-overlaps",
        ),
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n      - {name: n, gpus: [{model: A200}]}\n",
            ["cluster s, node n, GPU entry 1", "unknown GPU model 'A200'", "gpush knows"],
            id="unknown-model",
        ),
        pytest.param(
            "clusters:\n  k:\n    flavor: k8s\n    pools:\n"
            "      - {name: t4, nodes: 2, gpus_per_node: 4, model: T4, mig: [1g.5gb]}\n",
            ["cluster k, pool t4", "T4 is not MIG-capable", "remove mig"],
            id="mig-on-t4",
        ),
        pytest.param(
            "clusters:\n  k:\n    flavor: k8s\n    nodes:\n      - {name: n, gpus: [{model: T4}]}\n",
            ["cluster k", "lists node pools under pools"],
            id="k8s-written-as-slurm",
        ),
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n      - {name: n, gpu: [{model: T4}]}\n",
            ["cluster s, node n", "gpu: unknown field; did you mean 'gpus'?", "gpus: required"],
            id="typo",
        ),
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n"
            "      - {name: n, gpus: [{model: A100, mps: true, mig: [7g.40gb]}]}\n",
            ["GPU entry 1", "MIG or MPS, not both"],
            id="mig-and-mps",
        ),
        pytest.param(
            "clusters:\n  s:\n    flavor: slurm\n    nodes:\n      - {name: n, count: 2, gpus: [{model: T4}]}\n"
            "      - {name: n-01, gpus: [{model: T4}]}\n",
            ["two nodes called n-01"],
            id="duplicate-node",
        ),
    ],
)
def test_a_bad_fleet_is_refused_saying_where_and_what_to_do(text: str, words: list[str]) -> None:
    message = refusal(text)
    assert message.startswith("fleet.yaml: ")
    for word in words:
        assert word in message


def test_a_yaml_error_names_line_and_column() -> None:
    message = refusal("clusters:\n  s:\n    flavor: [slurm\n    nodes: []\n")
    assert "fleet.yaml, line 4, column 10: not valid YAML" in message


def test_an_unknown_cluster_name_lists_the_ones_there() -> None:
    with pytest.raises(InvalidRequest, match="has no cluster 'slurm-b': it has slurm-a, k8s-a"):
        load_fleet_file(DEMO_FLEET).cluster("slurm-b")


# -- inventory -----------------------------------------------------------------------------


def test_slurm_inventory_counts_slices_shares_and_whole_gpus(slurm: SimulatedCluster) -> None:
    small = units(slurm, "mig-01", Sharing.SLURM_MIG, "1g.5gb")
    assert (small.capacity, small.allocated, small.unit_memory_gb, small.in_mig_mode) == (7, 0, 5.0, True)
    assert small.gpu_equivalent == pytest.approx(1 / 7)
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "3g.20gb").gpu_equivalent == pytest.approx(3 / 7)
    # An MPS share lives on one GPU: one unit per physical GPU, 100% each.
    mps = gpu_units(slurm, "mps-01", Sharing.SLURM_MPS)
    assert [(u.capacity, u.gpu_equivalent, u.gpu_memory_gb, u.gpus) for u in mps] == [
        (100, 0.01, 40.0, (0,)),
        (100, 0.01, 40.0, (1,)),
    ]
    assert mps[0].unit_memory_gb == pytest.approx(0.4)
    whole = units(slurm, "gpu-01", Sharing.SLURM_EXCLUSIVE)
    assert (whole.capacity, whole.gpu_equivalent, whole.gpu_model, whole.gpus) == (
        4,
        1.0,
        "A100-SXM4-80GB",
        (0, 1, 2, 3),
    )


def test_k8s_inventory_counts_replicas_and_labels_nodes(k8s: SimulatedCluster) -> None:
    # A replica lives on one GPU: one unit per physical GPU, its 4 replicas and 16 GB.
    per_gpu = gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)
    assert [(u.gpus, u.capacity, u.gpu_memory_gb, u.memory_allocated_gb) for u in per_gpu] == [
        ((i,), 4, 16.0, 0.0) for i in range(4)
    ]
    replicas = per_gpu[0]
    assert replicas.gpu_equivalent == pytest.approx(1 / 4)
    assert replicas.labels["nvidia.com/gpu.replicas"] == "4"
    assert replicas.labels["nvidia.com/gpu.memory"] == "16384"
    mig = units(k8s, "a100-mig", Sharing.K8S_MIG, "1g.5gb")
    assert (mig.capacity, mig.labels["nvidia.com/mig.strategy"]) == (16, "mixed")
    assert units(k8s, "h100", Sharing.K8S_EXCLUSIVE).capacity == 8


def test_health_reports_nodes_and_gpus(slurm: SimulatedCluster) -> None:
    health = slurm.health()
    assert health.ok and health.version == "sim"
    assert "4 nodes, 12 GPUs" in health.detail


# -- submitting and running --------------------------------------------------------------


def test_submit_is_idempotent_by_job_id(slurm: SimulatedCluster) -> None:
    first = slurm.submit(1, spec(600), slice_1g())
    again = slurm.submit(1, spec(900), slice_1g())
    assert first == again == "sim-slurm-a-1"
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "1g.5gb").allocated == 1
    assert [j.job_id for j in slurm.statuses().jobs] == [1]


def test_a_job_runs_for_its_virtual_duration_then_frees_its_units(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    slurm.submit(1, spec(600), slice_1g())
    running = slurm.find(1)
    assert (running.state, running.node, running.at) == (BackendState.RUNNING, "mig-01", T0)

    clock.at(599)
    assert slurm.find(1).state is BackendState.RUNNING
    clock.at(3600)  # the broker looks much later: the job ended at its own end time
    done = slurm.find(1)
    assert (done.state, done.exit_code, done.at) == (BackendState.SUCCEEDED, 0, at(600))
    assert units(slurm, "mig-01", Sharing.SLURM_MIG, "1g.5gb").allocated == 0


def test_durations_come_from_labels_else_half_the_time_limit_else_five_minutes(
    slurm: SimulatedCluster, clock: VirtualClock
) -> None:
    slurm.submit(1, spec(90), slice_1g())
    slurm.submit(2, spec(time_limit="01:00:00"), slice_1g())
    slurm.submit(3, spec(), slice_1g())
    slurm.submit(4, spec(7200, time_limit="01:00:00"), slice_1g())
    clock.at(24 * 3600)
    ended = {j: slurm.find(j) for j in (1, 2, 3, 4)}
    assert {j: b.at for j, b in ended.items()} == {1: at(90), 2: at(1800), 3: at(300), 4: at(3600)}
    assert ended[4].state is BackendState.FAILED
    assert ended[4].reason == "TIMEOUT: ran past its time limit of 01:00:00"


def test_a_job_asked_to_fail_fails_with_exit_code_1(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    slurm.submit(1, spec(60, labels={"sim-exit": "failed"}), slice_1g())
    clock.at(60)
    failed = slurm.find(1)
    assert (failed.state, failed.exit_code, failed.reason) == (BackendState.FAILED, 1, "exited with code 1")


def test_a_job_that_does_not_fit_waits_and_starts_exactly_when_a_slice_frees(
    slurm: SimulatedCluster, clock: VirtualClock
) -> None:
    start = slurm.statuses().cursor
    for job_id in range(1, 8):  # the seven 1g.5gb slices of mig-01, the first ending soonest
        slurm.submit(job_id, spec(100 * job_id), slice_1g())
    slurm.submit(8, spec(50), slice_1g())
    waiting = slurm.find(8)
    assert waiting.state is BackendState.PENDING
    assert waiting.reason == "waiting for a 1g.5gb slice on mig-01: all 7 busy"

    clock.at(1000)  # long after job 1 ended at 100 s
    changes = [(j.job_id, j.state, j.at) for j in slurm.statuses().jobs]
    assert (8, BackendState.SUCCEEDED, at(150)) in changes
    assert [(j.state, j.at) for j in slurm.statuses(start).jobs if j.job_id == 8] == [
        (BackendState.PENDING, T0),
        (BackendState.RUNNING, at(100)),  # when job 1's slice freed, not when the broker looked
        (BackendState.SUCCEEDED, at(150)),
    ]


def test_a_multi_gpu_job_takes_all_its_gpus_on_one_node_or_waits(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    exclusive = Sharing.SLURM_EXCLUSIVE
    slurm.submit(1, spec(100), placement(exclusive, 2, node="gpu-01"))
    slurm.submit(2, spec(200), placement(exclusive, 2, node="gpu-02"))
    slurm.submit(3, spec(60), placement(exclusive, 4))  # 4 GPUs free in all, but 2 per node
    waiting = slurm.find(3)
    assert waiting.state is BackendState.PENDING
    assert waiting.reason == "waiting for 4 whole A100-SXM4-80GB GPUs: at most 2 free on any one node of slurm-a"
    assert [units(slurm, n, exclusive).allocated for n in ("gpu-01", "gpu-02")] == [2, 2]

    clock.at(150)
    started = slurm.find(3)
    assert (started.state, started.node, started.at) == (BackendState.RUNNING, "gpu-01", at(100))
    assert units(slurm, "gpu-01", exclusive).allocated == 4


def test_an_unpinned_job_takes_the_first_node_with_room(slurm: SimulatedCluster) -> None:
    exclusive = Sharing.SLURM_EXCLUSIVE
    slurm.submit(1, spec(100), placement(exclusive, 3))
    slurm.submit(2, spec(100), placement(exclusive, 2))
    slurm.submit(3, spec(100), placement(exclusive, 1))
    assert [slurm.find(j).node for j in (1, 2, 3)] == ["gpu-01", "gpu-02", "gpu-01"]


def test_gpus_a_pinned_job_waits_for_are_not_given_to_later_jobs(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    exclusive = Sharing.SLURM_EXCLUSIVE
    slurm.submit(1, spec(100), placement(exclusive, 2, node="gpu-01"))
    slurm.submit(2, spec(100), placement(exclusive, 4, node="gpu-01"))  # waits for all four
    slurm.submit(3, spec(100), placement(exclusive, 1))
    assert slurm.find(2).reason == "waiting for 4 whole A100-SXM4-80GB GPUs on gpu-01: 2 of 4 free"
    assert slurm.find(3).node == "gpu-02"
    clock.at(100)
    assert (slurm.find(2).state, slurm.find(2).at) == (BackendState.RUNNING, at(100))


def test_mps_shares_live_on_one_gpu(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    mps = placement(Sharing.SLURM_MPS, 60, node="mps-01", gpu_memory_gb=24)
    slurm.submit(1, spec(100), mps)
    slurm.submit(2, spec(200), mps)
    slurm.submit(3, spec(100), mps)  # 80% free across the node, but only 40% on either GPU
    assert slurm.find(3).reason == "waiting for 60% of an MPS A100-SXM4-40GB GPU on mps-01: at most 40% free on one GPU"
    assert [u.allocated for u in gpu_units(slurm, "mps-01", Sharing.SLURM_MPS)] == [60, 60]
    clock.at(100)
    assert slurm.find(3).state is BackendState.RUNNING


def test_cancel_a_pending_and_a_running_job(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    whole = placement(Sharing.SLURM_EXCLUSIVE, 4, node="gpu-01")
    slurm.submit(1, spec(1000), whole)
    slurm.submit(2, spec(1000), whole)
    slurm.submit(3, spec(1000), whole)
    slurm.cancel(2)
    assert slurm.find(2).state is BackendState.CANCELLED

    clock.at(10)
    slurm.cancel(1)
    assert slurm.find(1).state is BackendState.CANCELLED
    third = slurm.find(3)  # the next in line starts on the GPUs the cancel freed
    assert (third.state, third.at) == (BackendState.RUNNING, at(10))
    slurm.cancel(1)  # again, and for a job the cluster never saw: no error
    slurm.cancel(99)
    assert units(slurm, "gpu-01", Sharing.SLURM_EXCLUSIVE).allocated == 4


def test_statuses_since_a_cursor_return_only_newer_changes(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    slurm.submit(1, spec(100), slice_1g())
    first = slurm.statuses()
    assert [(j.job_id, j.state) for j in first.jobs] == [(1, BackendState.RUNNING)]
    assert slurm.statuses(first.cursor).jobs == []

    slurm.submit(2, spec(300), slice_1g())
    clock.at(200)
    newer = slurm.statuses(first.cursor)
    assert [(j.job_id, j.state, j.at) for j in newer.jobs] == [
        (2, BackendState.RUNNING, T0),
        (1, BackendState.SUCCEEDED, at(100)),
    ]
    assert newer.jobs[0].backend_id == "sim-slurm-a-2"
    assert slurm.statuses(newer.cursor).jobs == []


def test_find_answers_after_the_fact(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    slurm.submit(1, spec(10), slice_1g())
    clock.at(86400)
    found = slurm.find(1)
    assert (found.backend_id, found.state, found.node) == ("sim-slurm-a-1", BackendState.SUCCEEDED, "mig-01")
    assert slurm.find(2) is None


# -- time-slicing ------------------------------------------------------------------------------


def test_time_sliced_memory_over_commit_is_oom_killed(k8s: SimulatedCluster) -> None:
    def replica(gb: float) -> Placement:
        return placement(Sharing.K8S_TIMESLICE, node="t4-01", gpu_memory_gb=gb)

    for job_id in range(1, 5):  # least-loaded first: one 10 GB job on each of the four T4s
        k8s.submit(job_id, spec(600), replica(10))
    k8s.submit(5, spec(600), replica(4))  # 14 GB of 16 on GPU 0: fine
    k8s.submit(6, spec(600), replica(10))  # 20 GB of 16 on GPU 1
    assert [k8s.find(j).state for j in range(1, 6)] == [BackendState.RUNNING] * 5
    killed = k8s.find(6)
    assert (killed.state, killed.exit_code) == (BackendState.FAILED, 137)
    assert killed.reason.startswith("OOMKilled: time-sliced GPU memory over-committed")
    # The killed job's replica and memory are free again; the others stay where they run.
    per_gpu = gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)
    assert [(u.allocated, u.memory_allocated_gb) for u in per_gpu] == [(2, 14.0), (1, 10.0), (1, 10.0), (1, 10.0)]


# -- placements that name a GPU ----------------------------------------------------------------


def test_a_share_pinned_to_a_gpu_runs_there_or_waits_for_it(slurm: SimulatedCluster, clock: VirtualClock) -> None:
    on_gpu_1 = placement(Sharing.SLURM_MPS, 60, node="mps-01", gpu_memory_gb=24, gpus=(1,))
    slurm.submit(1, spec(100), on_gpu_1)
    slurm.submit(2, spec(100), on_gpu_1)  # GPU 0 is idle, but the placement names GPU 1
    assert [u.allocated for u in gpu_units(slurm, "mps-01", Sharing.SLURM_MPS)] == [0, 60]
    waiting = slurm.find(2)
    assert waiting.state is BackendState.PENDING
    assert waiting.reason == "waiting for 60% of an MPS A100-SXM4-40GB GPU on mps-01, GPU 1: 40% free there"
    clock.at(150)
    assert slurm.find(2).at == at(100)  # started on GPU 1 when job 1 freed it
    assert [u.allocated for u in gpu_units(slurm, "mps-01", Sharing.SLURM_MPS)] == [0, 60]


def test_time_slice_replicas_go_to_the_gpus_their_placement_names(k8s: SimulatedCluster) -> None:
    two = placement(Sharing.K8S_TIMESLICE, node="t4-01", gpu_memory_gb=3, replicas=2, gpus=(2, 2))
    k8s.submit(1, spec(600), two)
    per_gpu = gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)
    assert [(u.allocated, u.memory_allocated_gb) for u in per_gpu] == [(0, 0.0), (0, 0.0), (2, 6.0), (0, 0.0)]


def test_a_job_waiting_for_its_gpu_holds_up_only_jobs_that_want_that_gpu(
    slurm: SimulatedCluster, clock: VirtualClock
) -> None:
    def share(gpu: int) -> Placement:
        return placement(Sharing.SLURM_MPS, 60, node="mps-01", gpu_memory_gb=24, gpus=(gpu,))

    slurm.submit(1, spec(100), share(1))
    slurm.submit(2, spec(100), share(1))  # waits for GPU 1
    slurm.submit(3, spec(100), share(1))  # behind job 2
    slurm.submit(4, spec(100), share(0))  # GPU 0 is free: nothing there waits before it
    assert [slurm.find(j).state for j in (2, 3, 4)] == [
        BackendState.PENDING,
        BackendState.PENDING,
        BackendState.RUNNING,
    ]
    assert slurm.find(3).reason == "waiting for 60% of an MPS A100-SXM4-40GB GPU on mps-01, GPU 1: 40% free there"
    # Job 2 takes GPU 1 when job 1 frees it at 100 s; job 3 when job 2 ends.
    clock.at(150)
    assert (slurm.find(2).state, slurm.find(2).at, slurm.find(3).state) == (
        BackendState.RUNNING,
        at(100),
        BackendState.PENDING,
    )
    clock.at(250)
    assert (slurm.find(3).state, slurm.find(3).at) == (BackendState.RUNNING, at(200))


@pytest.mark.parametrize(
    ("where", "words"),
    [
        pytest.param(
            placement(Sharing.K8S_TIMESLICE, gpus=(0,)), ["names GPU 0 but no node", "give the node"], id="no-node"
        ),
        pytest.param(
            placement(Sharing.K8S_TIMESLICE, node="t4-01", gpus=(7,)),
            ["node t4-01 of k8s-a has no", "on GPU 7", "are 0, 1, 2, 3"],
            id="no-such-gpu",
        ),
        pytest.param(
            placement(Sharing.K8S_TIMESLICE, node="t4-01", replicas=3, gpus=(0, 1)),
            ["names 2 GPUs for 3 replicas"],
            id="count",
        ),
        pytest.param(
            placement(Sharing.K8S_TIMESLICE, 3, node="t4-01", replicas=2, gpus=(1,)),
            ["GPU 1 of node t4-01 can never hold", "4 units"],
            id="too-many-on-one-gpu",
        ),
    ],
)
def test_a_gpu_the_node_cannot_give_is_rejected(k8s: SimulatedCluster, where: Placement, words: list[str]) -> None:
    with pytest.raises(Rejected) as info:
        k8s.submit(1, spec(60), where)
    for word in words:
        assert word in str(info.value)


def test_a_state_file_keeps_a_waiting_jobs_gpu(tmp_path: Path, clock: VirtualClock) -> None:
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}
    before = SimulatedCluster("slurm-a", config, clock=clock)
    on_gpu_0 = placement(Sharing.SLURM_MPS, 70, node="mps-01", gpu_memory_gb=28, gpus=(0,))
    before.submit(1, spec(100), on_gpu_0)
    before.submit(2, spec(100), on_gpu_0)
    after = SimulatedCluster("slurm-a", config, clock=clock)
    clock.at(150)
    assert (after.find(2).state, after.find(2).at) == (BackendState.RUNNING, at(100))
    assert [u.allocated for u in gpu_units(after, "mps-01", Sharing.SLURM_MPS)] == [70, 0]


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("where", "words"),
    [
        pytest.param(
            placement(Sharing.SLURM_MIG, mig_profile="2g.10gb"),
            ["has no MIG slices 2g.10gb under slurm/mig", "it offers 1g.5gb on A100-SXM4-40GB, 3g.20gb on"],
            id="mig-profile-missing",
        ),
        pytest.param(placement(Sharing.K8S_TIMESLICE), ["offers slurm/exclusive", "not k8s/timeslice"], id="k8s-mode"),
        pytest.param(
            placement(Sharing.SLURM_EXCLUSIVE, node="gpu-09"), ["has no node gpu-09", "mig-01, mps-01"], id="no-node"
        ),
        pytest.param(
            placement(Sharing.SLURM_EXCLUSIVE, node="mig-01"), ["node mig-01 of slurm-a has no"], id="wrong-node"
        ),
        pytest.param(
            placement(Sharing.SLURM_EXCLUSIVE, 8),
            ["no node of slurm-a can hold 8 whole", "the largest has 4"],
            id="big",
        ),
        pytest.param(placement(Sharing.SLURM_MPS, 150), ["percent of one GPU", "150"], id="mps-over-100"),
        pytest.param(placement(Sharing.SLURM_MIG), ["needs a mig_profile"], id="mig-without-profile"),
    ],
)
def test_a_placement_this_cluster_cannot_run_is_rejected(
    slurm: SimulatedCluster, where: Placement, words: list[str]
) -> None:
    with pytest.raises(Rejected) as info:
        slurm.submit(1, spec(60), where)
    for word in words:
        assert word in str(info.value)
    assert slurm.find(1) is None


def test_an_unreachable_cluster_raises_and_reports_unhealthy(slurm: SimulatedCluster) -> None:
    slurm.simulate_outage("slurmctld not responding")
    with pytest.raises(Unreachable, match="slurmctld not responding"):
        slurm.submit(1, spec(60), slice_1g())
    assert not slurm.health().ok
    slurm.simulate_outage(None)
    assert slurm.submit(1, spec(60), slice_1g()) == "sim-slurm-a-1"


# -- persistence and replay ------------------------------------------------------------------


def test_a_state_file_survives_a_new_simulator(tmp_path: Path, clock: VirtualClock) -> None:
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}
    before = SimulatedCluster("slurm-a", config, clock=clock)
    whole = placement(Sharing.SLURM_EXCLUSIVE, 4, node="gpu-01")
    before.submit(1, spec(100), whole)
    before.submit(2, spec(100), whole)
    cursor = before.statuses().cursor

    clock.at(500)  # the broker restarts; the cluster kept running meanwhile
    after = SimulatedCluster("slurm-a", config, clock=clock)
    assert after.submit(2, spec(100), whole) == "sim-slurm-a-2"  # still known: not submitted twice
    assert [(j.job_id, j.state, j.at) for j in after.statuses(cursor).jobs] == [
        (1, BackendState.SUCCEEDED, at(100)),
        (2, BackendState.RUNNING, at(100)),
        (2, BackendState.SUCCEEDED, at(200)),
    ]
    assert units(after, "gpu-01", Sharing.SLURM_EXCLUSIVE).allocated == 0


def test_a_state_file_keeps_running_allocations(tmp_path: Path, clock: VirtualClock) -> None:
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "k8s-a.json")}
    before = SimulatedCluster("k8s-a", config, clock=clock)
    before.submit(1, spec(100), placement(Sharing.K8S_TIMESLICE, 2, node="t4-02", gpu_memory_gb=6))
    after = SimulatedCluster("k8s-a", config, clock=clock)
    per_gpu = gpu_units(after, "t4-02", Sharing.K8S_TIMESLICE)
    assert [(u.allocated, u.memory_allocated_gb) for u in per_gpu] == [(1, 6.0), (1, 6.0), (0, 0.0), (0, 0.0)]
    assert after.next_event_time() == at(100)


def test_a_state_file_keeps_waiting_jobs_in_order(tmp_path: Path, clock: VirtualClock) -> None:
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "slurm-a.json")}
    before = SimulatedCluster("slurm-a", config, clock=clock)
    share = placement(Sharing.SLURM_MPS, 70, gpu_memory_gb=28)
    for job_id, seconds in ((1, 100), (2, 200), (3, 50), (4, 50)):
        before.submit(job_id, spec(seconds), share)
    after = SimulatedCluster("slurm-a", config, clock=clock)
    assert [u.allocated for u in gpu_units(after, "mps-01", Sharing.SLURM_MPS)] == [70, 70]
    assert after.find(4).reason == "waiting for 70% of an MPS A100-SXM4-40GB GPU: 1 earlier job(s) waiting first"
    clock.at(1000)
    # 3 takes job 1's share when it ends at 100 s, and 4 takes 3's at 150 s: in order, each for 50 s.
    assert [(after.find(j).state, after.find(j).at) for j in (3, 4)] == [
        (BackendState.SUCCEEDED, at(150)),
        (BackendState.SUCCEEDED, at(200)),
    ]


def test_a_cluster_may_be_named_apart_from_its_entry_in_the_fleet_file(clock: VirtualClock) -> None:
    text = DEMO_FLEET.read_text()
    cluster = SimulatedCluster("inference", {"fleet_yaml": text, "cluster": "k8s-a"}, clock=clock)
    assert cluster.submit(7, spec(60), placement(Sharing.K8S_EXCLUSIVE, 8)) == "sim-inference-7"
    assert {u.cluster for u in cluster.inventory()} == {"inference"}
    with pytest.raises(InvalidRequest, match="unknown setting fleet_file"):
        SimulatedCluster("x", {"fleet_file": str(DEMO_FLEET)}, clock=clock)


def test_a_replay_jumps_from_event_to_event(slurm: SimulatedCluster) -> None:
    for job_id, seconds in enumerate((30, 10, 20), 1):
        slurm.submit(job_id, spec(seconds), slice_1g())
    seen = []
    while (moment := slurm.next_event_time()) is not None:
        slurm.advance(moment)
        seen.append(moment)
    assert seen == [at(10), at(20), at(30)]


def test_ten_thousand_jobs_run_through_one_cluster_in_virtual_time(clock: VirtualClock) -> None:
    cluster = SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET)}, clock=clock)
    start = cluster.statuses().cursor
    whole = placement(Sharing.SLURM_EXCLUSIVE)
    for job_id in range(1, 10_001):
        cluster.submit(job_id, spec(60), whole)
    assert cluster.health().detail.endswith("8 jobs running, 9992 pending")
    clock.at(365 * 86400)
    changes = cluster.statuses(start).jobs
    assert sum(j.state is BackendState.SUCCEEDED for j in changes) == 10_000
    assert cluster.find(10_000).at == at(10_000 // 8 * 60)  # 8 GPUs, back to back


# -- scaling a running job ---------------------------------------------------------------------


def test_a_running_job_scales_on_its_node_within_its_room(k8s: SimulatedCluster) -> None:
    """Replicas stay together on the job's node (4 T4s x 4 time-slice replicas = 16 there)."""
    job = placement(Sharing.K8S_TIMESLICE, node="t4-01", replicas=2, gpu_memory_gb=5)
    k8s.submit(1, spec(600), job)
    assert k8s.scale(1, 6) == 6
    units = gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)
    assert sum(u.allocated for u in units) == 6
    with pytest.raises(Rejected, match="no room for 17 replicas"):
        k8s.scale(1, 17)
    assert sum(u.allocated for u in gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)) == 6  # unchanged
    assert k8s.scale(1, 1) == 1
    assert sum(u.allocated for u in gpu_units(k8s, "t4-01", Sharing.K8S_TIMESLICE)) == 1
    # Scaling up past the GPUs' memory would over-commit them: refused, not OOM-killed.
    with pytest.raises(Rejected, match="no room"):
        k8s.scale(1, 16)  # 4 x 5 GB on each 16 GB T4
    assert k8s.find(1).state is BackendState.RUNNING


def test_a_scaled_job_keeps_its_replicas_across_a_restart(tmp_path: Path, clock: VirtualClock) -> None:
    """The README: a simulated cluster's state survives broker restarts, a scale too."""
    config = {"fleet": str(DEMO_FLEET), "state_file": str(tmp_path / "k8s-a.json")}
    before = SimulatedCluster("k8s-a", config, clock=clock)
    before.submit(1, spec(600), placement(Sharing.K8S_TIMESLICE, node="t4-01", replicas=2, gpu_memory_gb=3))
    assert before.scale(1, 4) == 4

    after = SimulatedCluster("k8s-a", config, clock=clock)
    assert sum(u.allocated for u in gpu_units(after, "t4-01", Sharing.K8S_TIMESLICE)) == 4
    assert after.scale(1, 4) == 4  # unchanged, so nothing to do
    assert after.scale(1, 3) == 3
    again = SimulatedCluster("k8s-a", config, clock=clock)
    assert sum(u.allocated for u in gpu_units(again, "t4-01", Sharing.K8S_TIMESLICE)) == 3


def test_an_elastic_job_with_no_time_limit_runs_until_cancelled(k8s: SimulatedCluster, clock: VirtualClock) -> None:
    service = JobSpec(
        kind="inference", isolation="none", gpu_memory_gb=3, elastic={"min_replicas": 2, "max_replicas": 4}, image="x"
    )
    k8s.submit(1, service, placement(Sharing.K8S_TIMESLICE, replicas=2, gpu_memory_gb=3))
    clock.at(7 * 86400)
    assert k8s.find(1).state is BackendState.RUNNING
    k8s.cancel(1)
    assert k8s.find(1).state is BackendState.CANCELLED


def test_a_jobs_output_only_grows_so_following_it_from_an_offset_reads_each_line_once(
    slurm: SimulatedCluster, clock: VirtualClock
) -> None:
    slurm.submit(1, spec(600), slice_1g())
    clock.at(300)
    running = slurm.logs(1, "sim-1")
    assert "started on mig-01" in running.text
    clock.at(900)
    rest = slurm.logs(1, "sim-1", offset=running.next_offset)
    assert "[simulated] succeeded (exit 0)" in rest.text and "started" not in rest.text
    assert running.text + rest.text == slurm.logs(1, "sim-1").text
    assert slurm.logs(1, "sim-1", tail=1).text == rest.text


def test_a_fast_clusters_output_shows_wall_clock_times_and_its_pace(clock: VirtualClock) -> None:
    """A cluster at speed 60, registered at T0: a job submitted 10 s later (virtual 10 min)
    that runs 10 virtual minutes prints the wall-clock times it started and ended at."""
    fast = SimulatedCluster("slurm-a", {"fleet": str(DEMO_FLEET)}, clock=ScaledClock(clock, T0, 60))
    clock.at(10)
    fast.submit(1, spec(600), slice_1g())
    clock.at(20)
    started, ended = fast.logs(1, "sim-1").text.splitlines()
    assert started.startswith("2025-03-01T09:00:10Z [simulated] job 1 replica 0 started on mig-01")
    assert "virtual time at 60x the wall clock" in started
    assert ended == "2025-03-01T09:00:20Z [simulated] succeeded (exit 0) after 00:10:00 (00:00:10 of wall-clock time)"


def test_a_fleet_path_with_a_nul_is_refused_in_words_not_a_value_error():
    # Path("a\0").read_text() raises ValueError ("embedded null byte"): a 500 at the API.
    with pytest.raises(InvalidRequest, match="NUL"):
        load_fleet_file("/tmp/fleet\x00.yaml")
