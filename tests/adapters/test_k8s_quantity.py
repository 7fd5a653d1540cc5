"""adapters/k8s/quantity.py: every form of a Quantity a real API server may answer, read right.

A real server answers quantities in their canonical form, so gpush reads ``1k``, ``2``, ``1e3``,
``1536Mi`` or ``107374182400m`` and must make the same numbers of them as of what was sent. The
property tests against the test API server's canonicaliser are in integration/test_k8s_quantity.py.
"""

from __future__ import annotations

import copy
import json
from fractions import Fraction
from pathlib import Path

import pytest

from adapters.k8s.inventory import gpu_requests_by_node, node_units
from adapters.k8s.quantity import count, parse_quantity

DATA = Path(__file__).resolve().parents[1] / "data" / "k8s"
NODES = json.loads((DATA / "nodes.json").read_text())
PODS = json.loads((DATA / "pods.json").read_text())


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("2", 2),
        ("2000m", 2),
        ("500m", Fraction(1, 2)),
        ("1k", 1000),
        ("1M", 10**6),
        ("1G", 10**9),
        ("1T", 10**12),
        ("1P", 10**15),
        ("1E", 10**18),
        ("1Ki", 1024),
        ("1536Mi", 1536 * 2**20),
        ("16Gi", 16 * 2**30),
        ("1Ti", 2**40),
        ("1Pi", 2**50),
        ("1Ei", 2**60),
        ("1e3", 1000),
        ("1.5E-2", Fraction(3, 200)),
        ("1e21", 10**21),
        ("+1", 1),
        ("-1500m", Fraction(-3, 2)),
        ("1.", 1),
        (".5", Fraction(1, 2)),
        ("1.G", 10**9),
        ("107374182400m", Fraction(107374182400, 1000)),
        ("5n", Fraction(5, 10**9)),
        ("3u", Fraction(3, 10**6)),
        ("0.9n", Fraction(1, 10**9)),  # Kubernetes keeps nano precision, rounding up
        ("9Ei", 2**63 - 1),  # and caps a binary-suffixed value at 2^63-1
        (8, 8),
        (0.5, Fraction(1, 2)),
    ],
)
def test_every_form_is_read_to_its_exact_value(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "16GB", "1.1.M", "0.1mi", "aoeu", "1i", "-3.01e-", "1e", "Gi", None, True])
def test_what_is_not_a_quantity_is_refused(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


@pytest.mark.parametrize(
    ("served", "expected"),
    [("2", 2), ("2000m", 2), ("2e0", 2), ("1k", 1000), ("1500m", 2), (None, 0), ("", 0), ("16GB", 0)],
)
def test_an_extended_resource_count(served, expected):
    assert count(served) == expected


@pytest.mark.parametrize("spelling", ["8", "8000m", "8e0", "0.008k"])
def test_a_nodes_gpus_read_the_same_however_the_server_spells_them(spelling):
    node = copy.deepcopy(NODES["h100-whole"])
    node["status"]["allocatable"]["nvidia.com/gpu"] = spelling
    (unit,) = node_units("k8s-a", node, {"nvidia.com/gpu": 3})
    assert (unit.capacity, unit.allocated) == (8, 3)


def test_a_pods_gpu_request_reads_the_same_however_the_server_spells_it():
    pod = copy.deepcopy(PODS["running"])
    for container in pod["spec"]["containers"]:
        resources = container.get("resources") or {}
        for group in ("requests", "limits"):
            if "nvidia.com/gpu" in (resources.get(group) or {}):
                resources[group]["nvidia.com/gpu"] = "1000m"
    assert dict(gpu_requests_by_node([pod])) == {"t4-1": {"nvidia.com/gpu": 1}}
