"""Topology over HTTP: an agent's report carries it (bounded: the malformed ones are among
tests/inventory/test_inventory_api.py's), and ``GET /v1/inventory`` gives it back per node
and GPU. Reports are what ``gpush agent`` collects from the synthetic NVML data of
tests/data/nvml."""

from __future__ import annotations

from tests.inventory.test_inventory_api import admin, agent, report

__all__ = ["admin", "agent"]  # fixtures


def test_a_reported_topology_comes_back_in_the_inventory(agent, admin, clock):
    posted = agent.post("/v1/agent/reports", json=report("mig01.json", clock()))
    assert posted.status_code == 202, posted.text

    (node,) = admin.get("/v1/inventory").json()["unscheduled"]

    assert node["gpu_topology"] == {"nvlink": [[0, 1]], "pcie": [[0], [1]], "socket": [[0, 1]], "source": "nvml"}
    assert node["topology"] == []  # no cluster lists it: no network position
    assert [(g["numa_node"], g["cpu_affinity"]) for g in node["gpus"]] == [(0, "0-63"), (0, "0-63")]
    assert node["gpus"][0]["nvlinks"] == [{"kind": "gpu", "gpu": 1, "pci_bus_id": "00000000:0F:00.0", "links": 12}]
