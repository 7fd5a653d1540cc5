"""The topology vocabulary: choosing a node's GPUs and a gang's nodes as close as they can be."""

import pytest
from pydantic import ValidationError

from broker.core.schemas import JobSpec
from broker.core.topology import GpuTopology, choose_gpus, choose_nodes, fewest_domains, most_in_one

# A PCIe server with NVLink bridges joining pairs: two switches of four, one socket each.
PAIRS = GpuTopology.from_links(
    range(8), [(0, 1), (2, 3), (4, 5), (6, 7)], pcie=[(0, 1, 2, 3), (4, 5, 6, 7)], socket=[range(4), range(4, 8)]
)
# A DGX-class node: NVSwitch joins all eight.
DGX = GpuTopology.from_links(range(8), [(i, j) for i in range(8) for j in range(i + 1, 8)], socket=[range(8)])


def test_islands_are_the_connected_components_of_nvlink_pairs():
    assert PAIRS.nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert DGX.nvlink == (tuple(range(8)),)
    lone = GpuTopology.from_links(range(3), [])
    assert lone.nvlink == ((0,), (1,), (2,)) and lone.islands() == []


def test_a_pair_job_takes_one_island_and_the_fullest_partly_used_one():
    assert choose_gpus(PAIRS, range(8), 2) == (0, 1)
    # islands {2,3} and {4,5} are free; {4,5}'s switch has fewer free, so {2,3}'s switch stays whole... best fit
    assert choose_gpus(PAIRS, [1, 2, 3, 4, 5], 2) == (4, 5)
    # no island has two: one switch
    chosen = choose_gpus(PAIRS, [0, 2, 4, 6], 2)
    assert chosen == (0, 2) and PAIRS.closeness(chosen) == 1


def test_one_gpu_goes_to_a_broken_island_so_whole_ones_stay_whole():
    assert choose_gpus(PAIRS, [0, 2, 3, 4, 5, 6, 7], 1) == (0,)
    assert choose_gpus(PAIRS, [1, 2, 3, 6], 1) == (6,)  # islands of one free: {1} and {6}; 6's switch has one free


def test_four_gpus_span_two_whole_islands_of_one_switch():
    assert choose_gpus(PAIRS, [0, 1, 3, 4, 5, 6, 7], 4) == (4, 5, 6, 7)
    chosen = choose_gpus(PAIRS, [0, 1, 2, 4, 5, 6], 3)
    assert chosen in ((0, 1, 2), (4, 5, 6))
    assert PAIRS.closeness(chosen) == 1


def test_across_sockets_keeps_islands_together():
    chosen = choose_gpus(PAIRS, [0, 1, 2, 4, 5, 7], 5)
    assert chosen is not None and {0, 1} <= set(chosen) and {4, 5} <= set(chosen)
    assert PAIRS.closeness(chosen) == 3


def test_too_few_free_and_unknown_topology():
    assert choose_gpus(PAIRS, [0, 1], 3) is None
    assert choose_gpus(None, [5, 3, 1], 2) == (1, 3)
    assert choose_gpus(GpuTopology(), [5, 3], 2) == (3, 5)


def test_round_trip():
    assert GpuTopology.from_dict(PAIRS.to_dict()) == PAIRS


POSITION = {f"n{i}": (("block", f"b{i // 4}"), ("rack", f"r{i // 2}")) for i in range(12)}


def test_a_gang_takes_the_narrowest_domain_that_holds_it():
    assert choose_nodes(["n0", "n2", "n3", "n4"], 2, POSITION).nodes == ("n2", "n3")  # one rack
    choice = choose_nodes(["n0", "n2", "n4", "n5", "n6"], 3, POSITION)
    assert choice.nodes == ("n4", "n5", "n6") and choice.level == "block" and choice.domains == 1


def test_best_fit_block_keeps_the_larger_block_whole():
    # block b0 has four candidates, b2 has three: a gang of three takes b2
    choice = choose_nodes(["n0", "n1", "n2", "n3", "n8", "n9", "n10"], 3, POSITION, level="block")
    assert choice.nodes == ("n8", "n9", "n10")


def test_fewest_blocks_when_none_holds_it_and_required_waits():
    candidates = ["n0", "n4", "n5", "n8", "n9", "n10"]
    choice = choose_nodes(candidates, 5, POSITION)
    assert choice.domains == 2 and set(choice.nodes) >= {"n8", "n9", "n10"}
    assert choose_nodes(candidates, 4, POSITION, level="block", required=True) is None
    assert most_in_one(candidates, POSITION, "block") == 3
    assert fewest_domains([1, 2, 3], 5) == 2 and fewest_domains([1, 1], 3) == 0


def test_nodes_without_a_domain_count_alone():
    position = {"a": (("block", None),), "b": (("block", None),), "c": (("block", "b1"),)}
    assert choose_nodes(["a", "b", "c"], 2, position, level="block", required=True) is None
    assert choose_nodes(["a", "b", "c"], 2, position, level="block").domains == 2


def test_a_job_asks_for_topology():
    spec = JobSpec(
        kind="training",
        command=["true"],
        gpus=8,
        nodes=4,
        isolation="exclusive",
        topology={"level": "block", "mode": "required"},
    )
    assert spec.topology.level == "block" and spec.topology.mode == "required"
    assert JobSpec(kind="training", command=["true"], topology={"level": "nvlink"}).topology.mode == "preferred"
    for bad in ({"level": "block", "mode": "always"}, {"level": ""}, {"level": "a b"}, {"mode": "required"}):
        with pytest.raises(ValidationError):
            JobSpec(kind="training", command=["true"], topology=bad)


def test_a_spec_without_topology_keeps_its_fingerprint():
    spec = JobSpec(kind="training", command=["true"], gpus=2)
    body = spec.model_dump(mode="json")
    assert "topology" in body
    assert JobSpec.fingerprint_of(body) == JobSpec.fingerprint_of({k: v for k, v in body.items() if k != "topology"})
