"""A node's MIG layout in gres.conf and slurm.conf (adapters.slurm.mig): what gpush rewrites,
what it keeps, and what it refuses. The daemons' reading of the files is tested on the real
cluster (integration/test_slurm_mig.py)."""

from __future__ import annotations

import pytest

from adapters.slurm.mig import GresConf, cap_minor, counts, mig_devices, of_minor, with_node_gres
from broker.core.adapter import Rejected

CAPS = "/dev/nvidia-caps"
# As the test cluster's start.sh writes it: GPU 0 seven 1g.5gb (instances 7-13), GPU 1 two 3g.20gb (1, 2).
GRES = f"""# site comment
AutoDetect=off
NodeName=mig01 Name=gpu Type=1g.5gb File={",".join(f"{CAPS}/nvidia-cap{cap_minor(0, gi)}" for gi in range(7, 14))}
NodeName=mig01 Name=gpu Type=3g.20gb File={CAPS}/nvidia-cap{cap_minor(1, 1)},{CAPS}/nvidia-cap{cap_minor(1, 2)}
NodeName=mps01 Name=gpu Type=a100 File=/dev/nvidia0
NodeName=mps01 Name=mps Count=100 File=/dev/nvidia0
NodeName=gpu01 Name=gpu Type=a100 File=/dev/nvidia[0-1]
"""
SLURM = """ClusterName=x
NodeName=mig01 NodeHostname=localhost CPUs=16 Gres=gpu:1g.5gb:7,gpu:3g.20gb:2 State=UNKNOWN  # the MIG node
NodeName=mps01 CPUs=16 Gres=gpu:a100:1,mps:100
PartitionName=gpu Nodes=mig01,mps01 Default=YES
"""


def test_minors_are_the_drivers_numbering():
    assert cap_minor(0, 7) == 66 and cap_minor(1, 1) == 147
    assert of_minor(147) == (1, 1) and of_minor(66) == (0, 7)
    assert of_minor(148) is None  # a compute instance's access, not a GPU instance's


def test_devices_read_per_gpu_with_ranges():
    conf = GresConf(GRES)
    mig = conf.devices("mig01")
    assert [(d.gpu, d.type, d.gi) for d in mig] == [(0, "1g.5gb", gi) for gi in range(7, 14)] + [
        (1, "3g.20gb", 1),
        (1, "3g.20gb", 2),
    ]
    assert all(d.slot is None for d in mig)  # not gpush's lines: no comment says where they lie
    assert [(d.gpu, d.file) for d in conf.devices("gpu01")] == [(0, "/dev/nvidia0"), (1, "/dev/nvidia1")]


def test_one_gpu_rewritten_the_rest_kept_byte_for_byte():
    conf = GresConf(GRES)
    new = mig_devices(1, CAPS, ["3g.20gb@0", "2g.10gb@4", "1g.5gb@6"], {"3g.20gb@0": 1, "2g.10gb@4": 5, "1g.5gb@6": 13})
    text = conf.with_gpu("mig01", 1, new)
    lines = text.splitlines()
    assert lines[:2] == ["# site comment", "AutoDetect=off"]
    assert lines[-3:] == GRES.splitlines()[-3:]  # other nodes' lines, mps included
    assert (
        f"NodeName=mig01 Name=gpu Type=2g.10gb File={CAPS}/nvidia-cap{cap_minor(1, 5)}  # gpush: GPU 1 2g.10gb@4"
        in lines
    )
    again = GresConf(text)
    gpu1 = [d for d in again.devices("mig01") if d.gpu == 1]
    assert sorted(d.slot for d in gpu1) == ["1g.5gb@6", "2g.10gb@4", "3g.20gb@0"]
    assert counts(again.devices("mig01")) == {"1g.5gb": 8, "2g.10gb": 1, "3g.20gb": 1}
    # GPU 0 kept its seven instances, on their devices
    assert [d.file for d in again.devices("mig01") if d.gpu == 0] == [d.file for d in conf.devices("mig01")][:7]
    # rewriting what is written changes nothing
    assert again.with_gpu("mig01", 1, [d for d in gpu1]) == text


def test_slurm_conf_gres_counts_set_other_gres_and_comment_kept():
    text = with_node_gres(SLURM, "mig01", {"1g.5gb": 8, "2g.10gb": 1, "3g.20gb": 1})
    assert text.splitlines()[1] == (
        "NodeName=mig01 NodeHostname=localhost CPUs=16 Gres=gpu:1g.5gb:8,gpu:2g.10gb:1,gpu:3g.20gb:1 "
        "State=UNKNOWN  # the MIG node"
    )
    assert text.splitlines()[2:] == SLURM.splitlines()[2:]
    kept = with_node_gres(SLURM, "mps01", {"a100": 1})
    assert "Gres=gpu:a100:1,mps:100" in kept


@pytest.mark.parametrize(
    ("gres", "why"),
    [
        ("NodeName=mig[01-04] Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "with other nodes"),
        ("NodeName=mig00,mig01 Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "with other nodes"),
        ("Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "every node"),
        ("NodeName=other Name=gpu Type=a100 File=/dev/nvidia0\n", "no Name=gpu line for node mig01"),
    ],
)
def test_lines_gpush_cannot_rewrite_alone_are_refused_saying_what_to_do(gres, why):
    with pytest.raises(Rejected, match=why):
        GresConf(gres).with_gpu("mig01", 0, [])


def test_a_node_defined_with_others_in_slurm_conf_is_refused():
    with pytest.raises(Rejected, match="NodeName line of its own"):
        with_node_gres("NodeName=mig[01-02] Gres=gpu:1g.5gb:7\n", "mig01", {"1g.5gb": 7})
    with pytest.raises(Rejected, match="no NodeName line for mig01"):
        with_node_gres("NodeName=other Gres=gpu:a100:1\n", "mig01", {"1g.5gb": 7})
    # a range that does not hold the node is someone else's
    assert with_node_gres("NodeName=gpu[01-02] Gres=gpu:a100:1\nNodeName=mig01\n", "mig01", {"1g.5gb": 7}).endswith(
        "NodeName=mig01 Gres=gpu:1g.5gb:7\n"
    )


def test_an_instance_the_agent_does_not_report_is_refused():
    with pytest.raises(Rejected, match="does not report the instance 7g.40gb@0"):
        mig_devices(0, CAPS, ["7g.40gb@0"], {"3g.20gb@0": 1})
