"""`gpush inventory --topology` at a terminal's width: domains, islands, where each was read."""

import re
from pathlib import Path

import pytest
from rich.console import Console

from broker.cli.inventory_tables import gpu_ranges, topology_notes, topology_tables


def node(name, domains, topology, free=8.0, capacity=8.0):
    return {
        "name": name,
        "topology": [{"level": level, "domain": domain} for level, domain in domains],
        "gpu_topology": topology,
        "free_gpu_equivalents": free,
        "capacity_gpu_equivalents": capacity,
    }


PAIRS = {
    "nvlink": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "pcie": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "socket": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "source": "nvml",
}
DGX = {"nvlink": [list(range(8))], "pcie": [], "socket": [list(range(8))], "source": "gres.conf"}
LONE = {"nvlink": [[0], [1]], "pcie": [[0, 1]], "socket": [], "source": "nvml"}

INVENTORY = {
    "clusters": [
        {
            "name": "slurm-a",
            "nodes": [
                node("gpu-node-long-17", [("block", "b2")], DGX, free=0.0),
                node("gpu-node-long-01", [("block", "b1")], PAIRS),
                node("gpu-node-long-02", [("block", None)], None),
            ],
        },
        {"name": "k8s-b", "nodes": [node("kube-01", [], LONE, capacity=2.0, free=2.0)]},
    ]
}


def rendered(width=80):
    console = Console(width=width, record=True, color_system=None)
    for part in topology_tables(INVENTORY, width=width):
        console.print(part)
    for note in topology_notes(INVENTORY):
        console.print(note)
    return console.export_text()


def test_ranges():
    assert gpu_ranges([3, 0, 1, 2]) == "0-3"
    assert gpu_ranges([0, 2]) == "0,2"
    assert gpu_ranges([0, 1, 4]) == "0-1,4"


def test_each_node_shows_its_domain_islands_and_source_at_80_columns():
    text = rendered()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines)
    row = next(line for line in lines if "gpu-node-long-01" in line)
    assert "0-1 2-3 4-5 6-7" in row and "nvml" in row and "8/8" in row
    # Each node under its domain's heading row.
    assert lines[lines.index(row) - 1].strip() == "block b1"
    dgx = next(line for line in lines if "gpu-node-long-17" in line)
    assert "0-7" in dgx and "gres.conf" in dgx and "0/8" in dgx
    missing = next(line for line in lines if "gpu-node-long-02" in line)
    assert lines[lines.index(missing) - 1].strip() == "block (none)" and "?" in missing
    lone = next(line for line in lines if "kube-01" in line)
    assert " none " in lone and "0-1" in lone
    assert "slurm-a: network level block" in lines and "k8s-b: no network levels" in lines


def test_the_notes_count_idle_nodes_per_block():
    notes = topology_notes(INVENTORY)
    assert notes == ["slurm-a block (none): 1 node, 1 idle; b1: 1 node, 1 idle; b2: 1 node, 0 idle"]


# -- end to end, on the topology demo fleet (simulated, embedded broker) -----------------

ROOT = Path(__file__).resolve().parents[2]
POLICY = """rules:
  - {name: training, match: {kind: training}, route: {cluster: slurm-a, sharing: slurm/exclusive}}
  - {name: rest, match: {}, route: {cluster: k8s-a, sharing: k8s/exclusive}}
"""


@pytest.fixture
def topology_fleet(gpush, tmp_path):
    fleet = ROOT / "examples" / "fleet-topology.yaml"
    for name in ("slurm-a", "k8s-a"):
        assert gpush("cluster", "add", name, "--kind", "sim", "--fleet", fleet, "--speed", 600).code == 0
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    assert gpush("policy", "apply", policy, "-m", "test").code == 0

    def submit(*args) -> int:
        result = gpush("submit", "-k", "training", "-l", "sim-duration=86400", *args, "--", "./train.sh")
        assert result.code == 0, result.err
        return int(result.out)

    return submit


def test_a_gang_asking_for_one_block_gets_one_and_the_inventory_shows_blocks_and_islands(
    gpush, topology_fleet, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "80")
    gang = topology_fleet("-N", "3", "-G", "8", "--topology", "block:required")
    too_big = topology_fleet("-N", "5", "-G", "8", "--topology", "block:required")
    pair = topology_fleet("-G", "2")
    assert gpush("scheduler", "run", "--cycles", 2, "--interval", 0.1).code == 0

    status = gpush("status", gang).out
    nodes = re.search(r"Where\s+slurm-a exclusive x8 (\S+)", status).group(1).split(",")
    assert len(nodes) == 3 and len({n.startswith("pcie-b") for n in nodes}) == 1  # all in b1 or all in b2
    assert re.search(r"Topology\s+block, required \(waits until one block domain has room\)", status)

    held = gpush("status", too_big).out
    assert "needs 5 nodes with 8 A100-SXM4-80GBs in one block; the most in one block of slurm-a" in " ".join(
        held.split()
    )
    # The pair goes on one NVLink island of a node the gang left whole, named in its placement.
    where = re.search(r"Where\s+(.*)", gpush("status", pair).out).group(1)
    assert re.fullmatch(r"slurm-a exclusive x2 \S+ GPUs (0-1|2-3|4-5|6-7)", where.strip()), where

    inventory = gpush("inventory", "--topology")
    assert inventory.code == 0
    lines = inventory.out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "slurm-a: network level block" in lines
    row = next(line for line in lines if line.split()[:1] == ["pcie-01"])
    assert row.split()[:5] == ["pcie-01", "0-1", "2-3", "4-5", "6-7"]
    assert lines[lines.index(row) - 1].strip() == "block b1"
    assert any(line.startswith("slurm-a block b1: 4 nodes") for line in lines)


@pytest.mark.parametrize("bad", ["block:maybe", "", "a b", "block:required:x"])
def test_a_bad_topology_ask_is_refused_and_stores_nothing(gpush, topology_fleet, bad):
    result = gpush("submit", "-k", "training", "--topology", bad, "--", "x")
    assert result.code == 2, (result.out, result.err)
    assert "topology" in result.err
    assert gpush("list", "-o", "name").out.strip() == ""


def test_gpush_status_says_the_topology_ask_in_words():
    from broker.cli.job_detail import topology_rows

    def said(level, mode):
        return topology_rows({"topology": {"level": level, "mode": mode}})[0][1]

    assert said("nvlink", "required") == "nvlink, required (waits until one NVLink island has room)"
    assert said("pcie", "preferred") == "pcie, preferred (as few PCIe switches as possible)"
    assert said("block", "preferred") == "block, preferred (as few block domains as possible)"
    assert said("rack", "required") == "rack, required (waits until one rack domain has room)"
    assert topology_rows({"topology": None}) == []


def test_long_node_and_domain_names_leave_the_islands_whole_at_80_columns():
    inventory = {
        "clusters": [
            {
                "name": "gke-prod",
                "nodes": [
                    node(
                        "gke-a3-highgpu-pool-7f3c9a1b-zzzz",
                        [("block", "us-central1-a-blk-7"), ("subblock", "sb-3"), ("rack", "rack-17")],
                        PAIRS,
                        free=3.5,
                    )
                ],
            }
        ]
    }
    console = Console(width=80, record=True, color_system=None)
    for part in topology_tables(inventory, width=80):
        console.print(part)
    lines = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert "block us-central1-a-blk-7, subblock sb-3, rack rack-17" in lines
    row = next(line for line in lines if "gke-a3-highgpu-pool-7f3c9a1b-zzzz" in line)
    assert "0-1 2-3 4-5 6-7" in row and "3.5/8" in row


def test_drift_names_a_node_with_no_block_in_a_cluster_with_blocks_and_takes_dash_m(gpush, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    # The demo fleet with gpu-01 and gpu-02 in block b1: mig-01 and mps-01 are in none.
    demo = (ROOT / "examples" / "fleet.yaml").read_text()
    assert "        count: 2\n        cpus: 128\n" in demo
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(
        demo.replace(
            "        count: 2\n        cpus: 128\n", "        count: 2\n        block: b1\n        cpus: 128\n"
        )
    )
    for name in ("slurm-a", "k8s-a"):
        assert gpush("cluster", "add", name, "--kind", "sim", "--fleet", fleet).code == 0
    slurm = gpush("inventory", "drift", "-M", "slurm-a", "--severity", "warning")
    assert slurm.code == 0, slurm.err
    text = " ".join(slurm.out.split())
    assert "slurm-a/mps-01 (network_level_missing) mps-01 has no block in slurm-a's network topology why:" in text
    assert "fix: give mps-01 a block in the simulated cluster's fleet file" in text
    assert "gpu-01" not in text  # it has its block
    assert "block" not in " ".join(gpush("inventory", "drift", "-M", "k8s-a").out.split())
