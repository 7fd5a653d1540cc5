"""The inventory's topology per node, as the API's ``GET /v1/inventory`` carries it (the
view's JSON): ``gpu_topology`` (the GPU groups and where they were read) and ``topology``
(the network levels, widest first).

Units are CapacityUnits carrying what the adapters fill (gres.conf ``Links=``, a network
position); agent reports are NodeReports as ``gpush agent`` posts them.
"""

from __future__ import annotations

import dataclasses

from broker.core.topology import GpuTopology
from tests.inventory.test_reconcile import node_view, run, slurm
from tests.inventory.test_topology_drift import whole

GRES_PAIRS = GpuTopology.from_links(range(4), [(0, 1), (2, 3)], pcie=[(0, 1, 2, 3)], source="gres.conf")


def test_a_node_carries_the_clusters_gpu_groups_and_network_position_in_the_json():
    unit = whole("gpu07", 4, gpu_topology=GRES_PAIRS, topology=(("block", "b1"), ("switch", None)))
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
    inventory = run(slurm([whole("gpu08", 2), dataclasses.replace(whole("gpu08", 2), gpus=())]))
    body = node_view(inventory, "slurm-a", "gpu08").to_dict()
    assert body["gpu_topology"] is None
    assert body["topology"] == []
