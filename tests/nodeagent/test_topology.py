"""The node agent's reading of how close the GPUs are (broker.nodeagent.topology), over the
synthetic NVML data of tests/data/nvml: a DGX with NVSwitch, a PCIe server whose GPUs are
joined in pairs by NVLink bridges, a PCIe server without NVLink, a GPU that fell off the bus,
and NVML answering errors where a driver cannot say."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from broker.core.topology import GpuTopology, choose_gpus
from broker.inventory.agent_report import GpuGroups, NodeReport
from broker.nodeagent.agent import collect
from broker.nodeagent.nvml import RecordedLibrary, Recorder, nvml_error
from broker.nodeagent.topology import cpu_list, normal_bus_id

DATA = Path(__file__).parents[1] / "data" / "nvml"
TOPOLOGY_CALLS = (
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetNvLinkRemoteDeviceType",
    "nvmlDeviceGetNvLinkRemotePciInfo",
    "nvmlDeviceGetNumaNodeId",
    "nvmlDeviceGetCpuAffinity",
    "nvmlDeviceGetTopologyCommonAncestor",
)


def report_of(name: str, library: Any = None) -> NodeReport:
    return collect(library or RecordedLibrary(DATA / f"{name}.json"), name, process_name=None, mps_control=None)


def topology_of(report: NodeReport) -> GpuTopology:
    assert report.topology is not None
    return report.topology.gpu_topology()


class Refusing:
    """A recorded machine whose driver answers ``error`` to some calls (by name)."""

    def __init__(self, name: str, error: str, calls: tuple[str, ...]):
        self.library, self.error, self.calls = RecordedLibrary(DATA / f"{name}.json"), error, calls

    def __getattr__(self, name: str) -> Any:
        if name in self.calls:

            def refuse(*args: Any) -> Any:
                raise nvml_error(self.error)

            return refuse
        return getattr(self.library, name)


def test_a_dgx_h100_is_one_nvswitch_island_of_eight_over_two_sockets():
    report = report_of("h100-80gb-dgx")
    topology = topology_of(report)
    assert topology == GpuTopology(
        nvlink=((0, 1, 2, 3, 4, 5, 6, 7),),
        pcie=tuple((i,) for i in range(8)),
        socket=((0, 1, 2, 3), (4, 5, 6, 7)),
        source="nvml",
    )
    for gpu in report.gpus:
        assert [(p.kind, p.gpu, p.links) for p in gpu.nvlinks] == [("switch", None, 18)]
    assert [(g.numa_node, g.cpu_affinity) for g in report.gpus] == [(0, "0-55")] * 4 + [(1, "56-111")] * 4


def test_a_dgx_a100_has_pcie_switches_holding_pairs_inside_its_island():
    topology = topology_of(report_of("a100-40gb-dgx"))
    assert topology.islands() == [(0, 1, 2, 3, 4, 5, 6, 7)]
    assert topology.pcie == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_a_pcie_server_with_nvlink_bridges_has_islands_of_two():
    report = report_of("a100-pcie-nvlink-pairs")
    topology = topology_of(report)
    assert topology.nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topology.socket == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert [(p.kind, p.gpu, p.links) for p in report.gpus[2].nvlinks] == [("gpu", 3, 12)]
    assert report.gpus[2].nvlinks[0].pci_bus_id == report.gpus[3].pci_bus_id
    # What placement makes of it: two GPUs of one bridge, four of one socket.
    assert choose_gpus(topology, range(8), 2) == (0, 1)
    assert choose_gpus(topology, [1, 2, 3, 5, 6], 2) == (2, 3)
    assert choose_gpus(topology, [0, 1, 2, 3, 4, 5], 4) == (0, 1, 2, 3)


def test_a_pcie_server_without_nvlink_has_islands_of_one_and_sockets_from_the_pcie_tree():
    report = report_of("t4")
    topology = topology_of(report)
    assert topology.nvlink == ((0,), (1,), (2,), (3,)) and topology.islands() == []
    assert topology.socket == ((0, 1), (2, 3))
    assert all(g.nvlinks == [] and g.numa_node is None for g in report.gpus)  # NUMA id NOT_SUPPORTED
    assert [g.cpu_affinity for g in report.gpus] == ["0-19", "0-19", "20-39", "20-39"]


def test_a_mesh_of_direct_links_counts_the_links_to_each_gpu():
    report = report_of("a100-80gb")
    assert topology_of(report).islands() == [(0, 1, 2, 3)]
    assert [(p.gpu, p.links) for p in report.gpus[0].nvlinks] == [(1, 4), (2, 4), (3, 4)]


def test_a_lost_gpu_is_left_out_and_the_others_are_still_read():
    report = report_of("gpu-lost")
    assert report.gpus[2].error and report.gpus[2].nvlinks == []
    assert topology_of(report).nvlink == ((0, 1, 3),)


def test_links_that_are_down_join_nothing():
    report = report_of("mps01")
    assert topology_of(report).nvlink == ((0,),) and report.gpus[0].nvlinks == []


@pytest.mark.parametrize("error", ["NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_UNKNOWN", "NVML_ERROR_NO_PERMISSION"])
def test_a_driver_that_cannot_say_leaves_the_topology_unknown_and_the_report_whole(error):
    report = report_of("h100-80gb-dgx", Refusing("h100-80gb-dgx", error, TOPOLOGY_CALLS))
    assert report.error is None and all(g.error is None for g in report.gpus)
    assert [len(g.mig_instances) for g in report.gpus] == [7] + [0] * 7
    topology = topology_of(report)
    assert topology.islands() == [] and topology.pcie == () and topology.socket == ()
    assert all(g.numa_node is None and g.cpu_affinity is None and g.nvlinks == [] for g in report.gpus)


def test_without_the_remote_device_type_a_peer_is_found_by_bus_id():
    calls = ("nvmlDeviceGetNvLinkRemoteDeviceType",)
    pairs = report_of(
        "a100-pcie-nvlink-pairs", Refusing("a100-pcie-nvlink-pairs", "NVML_ERROR_FUNCTION_NOT_FOUND", calls)
    )
    assert topology_of(pairs).nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    switched = report_of("h100-80gb-dgx", Refusing("h100-80gb-dgx", "NVML_ERROR_NOT_SUPPORTED", calls))
    assert topology_of(switched).islands() == [(0, 1, 2, 3, 4, 5, 6, 7)]


def test_sockets_by_numa_node_when_nvml_does_not_give_the_pcie_tree():
    calls = ("nvmlDeviceGetTopologyCommonAncestor",)
    report = report_of("a100-pcie-nvlink-pairs", Refusing("a100-pcie-nvlink-pairs", "NVML_ERROR_NOT_SUPPORTED", calls))
    topology = topology_of(report)
    assert topology.socket == ((0, 1, 2, 3), (4, 5, 6, 7)) and topology.pcie == ()


def test_the_recorder_writes_the_cpu_bitmask_array_as_numbers():
    class Affinity:
        def nvmlDeviceGetCpuAffinity(self, handle: Any, words: int) -> Any:
            mask = (ctypes.c_ulonglong * words)()
            mask[0], mask[1] = 0xF, 1
            return mask

    recorder = Recorder(Affinity())
    recorder.nvmlDeviceGetCpuAffinity("gpu0", 2)
    assert recorder.calls == {"nvmlDeviceGetCpuAffinity(gpu0, 2)": {"return": [15, 1]}}


def test_cpu_lists_and_bus_ids():
    assert cpu_list([0xF0F, 0, 1]) == "0-3,8-11,128"
    assert cpu_list([0, 0]) == ""
    assert normal_bus_id("0000:07:00.0") == normal_bus_id("00000000:07:00.0") == "0000:07:00.0"
    assert normal_bus_id("00000000:1C:00.0") == normal_bus_id("0000:1c:00.0")


@pytest.mark.parametrize(
    ("groups", "words"),
    [
        ({"nvlink": [[0, 1], [1, 2]]}, "GPU 1 is in more than one group"),
        ({"pcie": [[0, 0]]}, "GPU 0 is in more than one group"),
        ({"socket": [[64]]}, "less than 64"),
        ({"nvlink": [[]]}, "at least 1 item"),
        ({"nvlink": [[i] for i in range(65)]}, "at most 64 items"),
        ({"source": "gres.conf"}, "'nvml'"),
    ],
)
def test_a_reports_groups_are_disjoint_and_bounded(groups, words):
    with pytest.raises(ValidationError, match=words):
        GpuGroups.model_validate(groups)
