"""Multi-node jobs (gangs) in the one decision: N distinct nodes each with the per-node
request free, taken in one cycle or not at all, charged N x per node, and why they wait."""

from __future__ import annotations

import pytest

from broker.core.adapter import CapacityUnit, Placement, Sharing
from broker.core.schemas import JobSpec
from broker.placement.capacity import CapacityView, Fit, NoFit
from broker.placement.decision import CycleDecisions, Held, Placed, WaitCause, Waiting
from broker.placement.fairshare import FairShare
from broker.routing.policy import load_policy

POLICY = load_policy(
    """
rules:
  - name: training
    match: {kind: training}
    route: {cluster: slurm-a, sharing: slurm/exclusive}
  - name: mig
    match: {kind: inference, isolation: hardware}
    route: {cluster: slurm-a, sharing: slurm/mig}
"""
)


class Job:
    def __init__(self, tenant: str = "ml", **fields) -> None:
        self.tenant = tenant
        self.spec = JobSpec.model_validate({"kind": "training", "command": ["torchrun"], **fields})

    @property
    def asked(self) -> JobSpec:
        return self.spec


def whole(node: str, count: int, allocated: int = 0, model: str = "A100-SXM4-80GB") -> CapacityUnit:
    return CapacityUnit(
        "slurm-a", node, Sharing.SLURM_EXCLUSIVE, model, 80.0, count, allocated, 1.0, gpus=tuple(range(count))
    )


def mig(node: str, count: int, allocated: int = 0) -> CapacityUnit:
    return CapacityUnit(
        "slurm-a", node, Sharing.SLURM_MIG, "A100-SXM4-40GB", 5.0, count, allocated, 1 / 7,
        mig_profile="1g.5gb", in_mig_mode=True,
    )  # fmt: skip


def free(view: CapacityView) -> dict[str, int]:
    return {s.unit.node: s.free for s in view.slots["slurm-a"][Sharing.SLURM_EXCLUSIVE]}


def decide(view: CapacityView, job: Job, fair: FairShare | None = None):
    return CycleDecisions(POLICY, view, fair or FairShare({}, {})).decide(job)


def test_a_gang_takes_its_request_on_n_distinct_nodes_at_once_charged_n_times_per_node():
    view = CapacityView.build({"slurm-a": [whole("a1", 8), whole("a2", 8, 2), whole("a3", 8)]})
    fair = FairShare({}, {})
    outcome = decide(view, Job(nodes=2, gpus=6), fair)
    assert isinstance(outcome, Placed)
    p = outcome.placement
    # best fit per node: a2 (6 free) is left with none, then a1 before a3 (inventory order)
    assert (p.nodes, p.node, p.units, p.gpu_equivalents) == (("a1", "a2"), "a1", 6, 12.0)
    assert free(view) == {"a1": 2, "a2": 0, "a3": 8}
    assert fair.usage["ml"] == 12.0


def test_a_node_with_room_for_two_ranks_still_holds_only_one():
    view = CapacityView.build({"slurm-a": [whole("big", 16), whole("a2", 8, 8)]})
    outcome = decide(view, Job(nodes=2, gpus=8))
    assert isinstance(outcome, Waiting)
    assert outcome.reason == "waiting for 2 nodes with 8 free A100-SXM4-80GBs on slurm-a: 1 has them now"
    assert free(view) == {"big": 16, "a2": 0}  # nothing taken


def test_a_gang_that_does_not_fit_whole_takes_nothing_and_says_how_far_it_is():
    view = CapacityView.build({"slurm-a": [whole(f"a{i}", 8, 0 if i < 2 else 4) for i in range(4)]})
    before = free(view)
    decisions = CycleDecisions(POLICY, view, FairShare({}, {}))
    outcome = decisions.decide(Job(nodes=4, gpus=8))
    assert isinstance(outcome, Waiting) and outcome.cause is WaitCause.CAPACITY
    assert outcome.reason == "waiting for 4 nodes with 8 free A100-SXM4-80GBs on slurm-a: 2 have them now"
    assert free(view) == before
    # the next gang waiting for the same says it is behind
    second = decisions.decide(Job(nodes=4, gpus=8))
    assert second.reason.endswith("(1 job ahead)")


def test_a_gang_over_its_tenants_quota_gives_back_every_node_it_took():
    view = CapacityView.build({"slurm-a": [whole("a1", 8), whole("a2", 8), whole("a3", 8)]})
    fair = FairShare({}, {"ml": 20})  # one node's 8 would pass; the gang's 24 do not
    outcome = decide(view, Job(nodes=3, gpus=8), fair)
    assert isinstance(outcome, Waiting) and outcome.cause is WaitCause.QUOTA
    assert "at quota" in outcome.reason
    assert free(view) == {"a1": 8, "a2": 8, "a3": 8}
    assert fair.usage.get("ml", 0) == 0


def test_a_gang_that_can_never_fit_is_held_saying_so():
    view = CapacityView.build({"slurm-a": [whole("a1", 8), whole("a2", 8), whole("small", 4)]})
    outcome = decide(view, Job(nodes=3, gpus=8))
    assert isinstance(outcome, Held)
    assert "needs 3 nodes with 8 A100-SXM4-80GBs each; slurm-a has 2 such nodes" in outcome.reason


def test_a_gang_placement_not_started_yet_counts_on_each_of_its_nodes_and_comes_back_whole():
    gang = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 8, 16.0, node="a1", nodes=("a1", "a3"))
    view = CapacityView.build({"slurm-a": [whole("a1", 8), whole("a2", 8), whole("a3", 8)]}, [gang])
    assert free(view) == {"a1": 0, "a2": 8, "a3": 0}
    view.give_back(gang)
    assert free(view) == {"a1": 8, "a2": 8, "a3": 8}


def test_a_gang_placement_is_stored_with_its_nodes_and_a_one_node_one_as_before():
    gang = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 8, 16.0, node="a1", nodes=("a1", "a3"))
    assert Placement.from_dict(gang.to_dict()) == gang and gang.to_dict()["nodes"] == ["a1", "a3"]
    one = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 8, 8.0, node="a1")
    assert "nodes" not in one.to_dict() and Placement.from_dict(one.to_dict()) == one


def test_a_gang_of_mig_slices_takes_one_profile_on_each_node():
    view = CapacityView.build({"slurm-a": [mig("m1", 7, 6), mig("m2", 7), mig("m3", 7, 3)]})
    outcome = decide(view, Job(kind="inference", isolation="hardware", gpu_memory_gb=5, nodes=2, gpus=3))
    assert isinstance(outcome, Placed)
    p = outcome.placement
    assert (p.nodes, p.mig_profile, p.units) == (("m2", "m3"), "1g.5gb", 3)
    assert p.gpu_equivalents == pytest.approx(6 / 7)


def mig3g(node: str, count: int, allocated: int = 0) -> CapacityUnit:
    return CapacityUnit(
        "slurm-a", node, Sharing.SLURM_MIG, "A100-SXM4-40GB", 20.0, count, allocated, 3 / 7,
        mig_profile="3g.20gb", in_mig_mode=True,
    )  # fmt: skip


def test_a_mig_gang_takes_the_smallest_profile_that_holds_it_as_a_one_node_job_does():
    # Each node has two 3g.20gb and seven 1g.5gb slices free. 2 x 5 GB per node fits the
    # 1g.5gb slices; taking both 3g.20gb ones would leave fewer slices free but hold six
    # sevenths of a GPU per node for a job that needs two sevenths.
    units = [u for n in ("m1", "m2") for u in (mig3g(n, 2), mig(n, 7))]
    one = decide(
        CapacityView.build({"slurm-a": units}), Job(kind="inference", isolation="hardware", gpu_memory_gb=5, gpus=2)
    )
    assert isinstance(one, Placed) and one.placement.mig_profile == "1g.5gb"
    outcome = decide(
        CapacityView.build({"slurm-a": units}),
        Job(kind="inference", isolation="hardware", gpu_memory_gb=5, nodes=2, gpus=2),
    )
    assert isinstance(outcome, Placed)
    p = outcome.placement
    assert (p.nodes, p.mig_profile, p.units) == (("m1", "m2"), "1g.5gb", 2)
    assert p.gpu_equivalents == pytest.approx(4 / 7)


def test_a_gang_on_a_sharing_mode_within_one_node_is_never_fitted():
    view = CapacityView.build({"slurm-a": [whole("a1", 8)]})
    fit = view.fit(Job(nodes=2, gpus=1).spec, "slurm-a", Sharing.SLURM_MPS)
    assert isinstance(fit, NoFit) and fit.never
    assert isinstance(view.fit(Job(gpus=1).spec, "slurm-a", Sharing.SLURM_EXCLUSIVE), Fit)
