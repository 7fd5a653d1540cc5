"""Which lendable nodes move between two clusters, and when (broker.placement.lending)."""

from __future__ import annotations

import pytest

from broker.core.adapter import Sharing
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec
from broker.placement.lending import LendableNode, LendingTerms, called_off, need, plan_moves

TERMS = LendingTerms(("slurm-a", "k8s-a"), minimum={"slurm-a": 1}, hold=600, threshold=2, max_moving=2)


def nodes(*owners: str, busy: float = 0.0, since: float = 0.0) -> list[LendableNode]:
    return [LendableNode(f"n{i}", owner, 4, busy=busy, since=since) for i, owner in enumerate(owners)]


def test_idle_nodes_move_to_the_side_that_waits_as_many_as_it_needs():
    moves = plan_moves(TERMS, nodes("slurm-a", "slurm-a", "slurm-a", "slurm-a"), {"k8s-a": 6.0}, now=1000)
    assert [(m.node, m.source, m.target) for m in moves] == [("n0", "slurm-a", "k8s-a"), ("n1", "slurm-a", "k8s-a")]
    assert "6 GPU-eq wait for k8s-a against 0 for slurm-a; n0 idle" == moves[0].reason


def test_equal_queues_and_small_gaps_move_nothing():
    four = nodes("slurm-a", "slurm-a", "k8s-a", "k8s-a")
    assert plan_moves(TERMS, four, {"k8s-a": 5.0, "slurm-a": 4.0}, now=1000) == []
    assert plan_moves(TERMS, four, {}, now=1000) == []


def test_a_node_that_just_moved_stays_and_the_minimum_is_kept():
    assert plan_moves(TERMS, nodes("slurm-a", "slurm-a", since=900), {"k8s-a": 8.0}, now=1000) == []
    (only,) = plan_moves(TERMS, nodes("slurm-a", "slurm-a"), {"k8s-a": 8.0}, now=1000)
    assert only.node == "n0"  # slurm-a keeps one


def test_idle_nodes_go_first_then_the_least_busy_and_moves_in_flight_count():
    pool = [
        LendableNode("busy", "slurm-a", 4, busy=3.0),
        LendableNode("light", "slurm-a", 4, busy=0.5),
        LendableNode("idle", "slurm-a", 4),
        LendableNode("keep", "slurm-a", 4, busy=4.0),
    ]
    assert [m.node for m in plan_moves(TERMS, pool, {"k8s-a": 20.0}, now=1000)] == ["idle", "light"]
    pool[2] = LendableNode("idle", "slurm-a", 4, moving_to="k8s-a")
    assert [m.node for m in plan_moves(TERMS, pool, {"k8s-a": 20.0}, now=1000)] == ["light"]


def test_demand_back_home_moves_nodes_back_and_calls_off_a_drain():
    back = plan_moves(TERMS, nodes("k8s-a", "k8s-a", "slurm-a"), {"slurm-a": 9.0, "k8s-a": 1.0}, now=5000)
    assert [(m.node, m.target) for m in back] == [("n0", "slurm-a"), ("n1", "slurm-a")]
    draining = LendableNode("n0", "slurm-a", 4, busy=1.0, moving_to="k8s-a")
    assert called_off(TERMS, draining, {"slurm-a": 3.0, "k8s-a": 2.0})
    assert not called_off(TERMS, draining, {"k8s-a": 6.0})


def test_terms_join_two_clusters():
    with pytest.raises(ValueError, match="joins two clusters"):
        LendingTerms(("a", "a"))


def test_a_node_a_gang_keeps_never_moves_however_idle():
    pool = [
        LendableNode("reserved", "slurm-a", 4, kept="is reserved for multi-node job 7"),
        LendableNode("rank", "slurm-a", 4, busy=4.0, kept="runs a rank of multi-node job 8"),
        LendableNode("light", "slurm-a", 4, busy=0.5),
        LendableNode("other", "slurm-a", 4, busy=3.0),
    ]
    assert [m.node for m in plan_moves(TERMS, pool, {"k8s-a": 20.0}, now=1000)] == ["light", "other"]
    assert [m.node for m in plan_moves(TERMS, pool[:2] + pool[3:], {"k8s-a": 20.0}, now=1000)] == ["other"]


def test_a_waiting_gang_weighs_every_node_it_needs():
    model = gpu_model("A100-SXM4-80GB")
    spec = JobSpec.model_validate({"kind": "training", "command": ["run"], "gpus": 4, "nodes": 3})
    assert need(spec, Sharing.SLURM_EXCLUSIVE, model) == 12.0
    one = JobSpec.model_validate({"kind": "training", "command": ["run"], "gpus": 4})
    assert need(one, Sharing.SLURM_EXCLUSIVE, model) == 4.0
