"""The inventory's topology per node, as the API's ``GET /v1/inventory`` carries it (the
view's JSON): ``gpu_topology`` (the GPU groups and where they were read) and ``topology``
(the network levels, widest first).

Units are CapacityUnits carrying what the adapters fill (gres.conf ``Links=``, a network
position); agent reports are NodeReports as ``gpush agent`` posts them.
"""

from __future__ import annotations

import dataclasses

from broker.core.adapter import CapacityUnit, Sharing
from broker.core.topology import GpuTopology
from tests.inventory.test_reconcile import node_view, run, slurm

GRES_PAIRS = GpuTopology.from_links(range(4), [(0, 1), (2, 3)], pcie=[(0, 1, 2, 3)], source="gres.conf")


def whole_gpus(node: str, count: int, **kw) -> CapacityUnit:
    return CapacityUnit(
        cluster="slurm-a",
        node=node,
        sharing=Sharing.SLURM_EXCLUSIVE,
        gpu_model="a100-40gb",
        unit_memory_gb=40,
        capacity=count,
        allocated=0,
        gpu_equivalent=1.0,
        gpus=tuple(range(count)),
        **kw,
    )


def test_a_node_carries_the_clusters_gpu_groups_and_network_position_in_the_json():
    unit = whole_gpus("gpu07", 4, gpu_topology=GRES_PAIRS, topology=(("block", "b1"), ("switch", None)))
    inventory = run(slurm([unit]))
    body = node_view(inventory, "slurm-a", "gpu07").to_dict()
    assert body["gpu_topology"] == {
        "nvlink": [[0, 1], [2, 3]],
        "pcie": [[0, 1, 2, 3]],
        "socket": [],
        "source": "gres.conf",
    }
    assert body["topology"] == [{"level": "block", "domain": "b1"}, {"level": "switch", "domain": None}]
    assert GpuTopology.from_dict(body["gpu_topology"]) == GRES_PAIRS


def test_a_node_the_cluster_says_nothing_of_has_no_topology():
    inventory = run(slurm([whole_gpus("gpu08", 2), dataclasses.replace(whole_gpus("gpu08", 2), gpus=())]))
    body = node_view(inventory, "slurm-a", "gpu08").to_dict()
    assert body["gpu_topology"] is None
    assert body["topology"] == []
