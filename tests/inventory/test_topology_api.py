"""Topology over HTTP: an agent's report carries it (bounded, 422 when malformed, nothing
stored), and ``GET /v1/inventory`` gives it back per node and GPU. Reports are what ``gpush
agent`` collects from the synthetic NVML data of tests/data/nvml."""

from __future__ import annotations

import pytest

from tests.inventory.test_inventory_api import admin, agent, error_of, report, stored_reports

__all__ = ["admin", "agent"]  # fixtures


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (lambda r: r["topology"].update(nvlink=[[0, 1], [1]]), "topology", "more than one group"),
        (lambda r: r["topology"].update(socket=[[0, 99]]), "topology.socket.0.1", "less than 64"),
        (lambda r: r["topology"].update(pcie=[[0]] * 65), "topology.pcie", "at most 64"),
        (lambda r: r["topology"].update(source="gres.conf"), "topology.source", "'nvml'"),
        (lambda r: r["gpus"][0].update(cpu_affinity="0-3;reboot"), "gpus.0.cpu_affinity", "pattern"),
        (lambda r: r["gpus"][0].update(cpu_affinity="0," * 600), "gpus.0.cpu_affinity", "at most 1024"),
        (lambda r: r["gpus"][0].update(numa_node=-1), "gpus.0.numa_node", "greater than or equal to 0"),
        (lambda r: r["gpus"][0]["nvlinks"][0].update(links=0), "gpus.0.nvlinks.0.links", "greater than or equal"),
        (lambda r: r["gpus"][0]["nvlinks"][0].update(kind="cable"), "gpus.0.nvlinks.0.kind", "'gpu'"),
        (lambda r: r["gpus"][0].update(nvlinks=r["gpus"][0]["nvlinks"] * 40), "gpus.0.nvlinks", "at most 36"),
    ],
)
def test_a_malformed_topology_is_refused_with_the_field_and_nothing_is_stored(
    agent, sessions, clock, change, field, words
):
    body = report("mig01.json", clock())
    change(body)

    response = agent.post("/v1/agent/reports", json=body)

    assert response.status_code == 422, response.text
    assert field in error_of(response) and words in error_of(response)
    assert stored_reports(sessions) == 0


def test_a_reported_topology_comes_back_in_the_inventory(agent, admin, clock):
    posted = agent.post("/v1/agent/reports", json=report("mig01.json", clock()))
    assert posted.status_code == 202, posted.text

    (node,) = admin.get("/v1/inventory").json()["unscheduled"]

    assert node["gpu_topology"] == {"nvlink": [[0, 1]], "pcie": [[0], [1]], "socket": [[0, 1]], "source": "nvml"}
    assert node["topology"] == []  # no cluster lists it: no network position
    assert [(g["numa_node"], g["cpu_affinity"]) for g in node["gpus"]] == [(0, "0-63"), (0, "0-63")]
    assert node["gpus"][0]["nvlinks"] == [{"kind": "gpu", "gpu": 1, "pci_bus_id": "00000000:0F:00.0", "links": 12}]
