"""A node's MIG layout in gres.conf and slurm.conf (adapters.slurm.mig): what gpush rewrites,
what it keeps, and what it refuses. The daemons' reading of the files is tested on the real
cluster (integration/test_slurm_mig.py)."""

from __future__ import annotations

import pytest

from adapters.slurm.adapter import SlurmAdapter
from adapters.slurm.mig import GresConf, counts, expand, mig_devices, of_minor, with_node_gres
from broker.core.adapter import Rejected
from broker.mig.config import mig_cap_minor, render_gres_conf
from broker.nodeagent.agent import collect
from tests.doubles.fake_nvml import FakeNvml

CAPS = "/dev/nvidia-caps"
# As the test cluster's start.sh writes it: GPU 0 seven 1g.5gb (instances 7-13), GPU 1 two 3g.20gb (1, 2).
SEVEN = ",".join(f"{CAPS}/nvidia-cap{mig_cap_minor(0, gi)}" for gi in range(7, 14))
GRES = f"""# site comment
AutoDetect=off
NodeName=mig01 Name=gpu Type=1g.5gb File={SEVEN} Cores=0-7
NodeName=mig01 Name=gpu Type=3g.20gb File={CAPS}/nvidia-cap{mig_cap_minor(1, 1)},{CAPS}/nvidia-cap{mig_cap_minor(1, 2)} Cores=8-15
NodeName=mps01 Name=gpu Type=a100 File=/dev/nvidia0
NodeName=mps01 Name=mps Count=100 File=/dev/nvidia0
NodeName=gpu01 Name=gpu Type=a100 File=/dev/nvidia[0-1]
"""  # noqa: E501
SLURM = """ClusterName=x
NodeName=mig01 NodeHostname=localhost CPUs=16 Gres=gpu:1g.5gb:7,gpu:3g.20gb:2 State=UNKNOWN  # the MIG node
NodeName=mps01 CPUs=16 Gres=gpu:a100:1,mps:100
PartitionName=gpu Nodes=mig01,mps01 Default=YES
"""
NEW = ["3g.20gb@0", "2g.10gb@4", "1g.5gb@6"]
MADE = {"3g.20gb@0": (1, 0), "2g.10gb@4": (5, 0), "1g.5gb@6": (13, 0)}


def test_minors_are_the_drivers_numbering():
    assert mig_cap_minor(0, 7) == 66 and mig_cap_minor(1, 1) == 147
    assert of_minor(147) == (1, 1) and of_minor(66) == (0, 7)
    assert of_minor(148) is None  # a compute instance's access, not a GPU instance's
    assert expand("/dev/nvidia[0,2-3]") == ["/dev/nvidia0", "/dev/nvidia2", "/dev/nvidia3"]
    assert expand("a[08-10],b") == ["a08", "a09", "a10", "b"]


def test_devices_read_per_gpu_with_ranges():
    conf = GresConf(GRES)
    mig = conf.devices("mig01")
    assert [(d.gpu, d.type, d.gi) for d in mig] == [(0, "1g.5gb", gi) for gi in range(7, 14)] + [
        (1, "3g.20gb", 1),
        (1, "3g.20gb", 2),
    ]
    assert all(d.slot is None for d in mig)  # not gpush's lines: no comment says where they lie
    assert [(d.gpu, d.files) for d in conf.devices("gpu01")] == [(0, ("/dev/nvidia0",)), (1, ("/dev/nvidia1",))]


def test_one_gpu_rewritten_the_rest_kept_byte_for_byte():
    conf = GresConf(GRES)
    text = conf.with_gpu("mig01", 1, mig_devices(1, CAPS, NEW, MADE))
    lines = text.splitlines()
    assert lines[:3] == GRES.splitlines()[:3]  # GPU 0's line untouched, Cores= and all
    assert lines[-3:] == GRES.splitlines()[-3:]  # other nodes' lines, mps included
    cap = f"{CAPS}/nvidia-cap{mig_cap_minor(1, 5)}"
    assert f"NodeName=mig01 Name=gpu Type=2g.10gb File={cap} Cores=8-15  # gpush: GPU 1 2g.10gb@4" in lines
    again = GresConf(text)
    gpu1 = [d for d in again.devices("mig01") if d.gpu == 1]
    assert sorted(d.slot for d in gpu1) == sorted(NEW)
    assert counts(again.devices("mig01")) == {"1g.5gb": 8, "2g.10gb": 1, "3g.20gb": 1}
    assert again.with_gpu("mig01", 1, gpu1) == text  # rewriting what is written changes nothing


def test_the_multiple_files_style_gpush_renders_is_read_and_kept():
    """``gpush slurm gres-conf NODE`` (MultipleFiles=: the GPU, its GPU- and compute-instance
    capabilities, one line per instance) is what a site installs: rewritten in that style."""
    gpus = FakeNvml.with_layouts("A100-SXM4-40GB", [[f"1g.5gb@{i}" for i in range(7)], ["3g.20gb@0", "3g.20gb@4"]])
    rendered = "\n".join(render_gres_conf("mig01", collect(gpus, "mig01").gpus).lines) + "\n"
    conf = GresConf(rendered)
    assert conf.style("mig01") == "multiple-files"
    assert counts(conf.devices("mig01")) == {"1g.5gb": 7, "3g.20gb": 2}
    new = mig_devices(1, CAPS, NEW, MADE, style="multiple-files", gpu_device="/dev/nvidia1")
    text = conf.with_gpu("mig01", 1, new)
    assert [d.type for d in GresConf(text).devices("mig01") if d.gpu == 0] == ["1g.5gb"] * 7
    line = next(x for x in text.splitlines() if "Type=2g.10gb" in x)
    assert line == (
        f"NodeName=mig01 Name=gpu Type=2g.10gb MultipleFiles=/dev/nvidia1,{CAPS}/nvidia-cap{mig_cap_minor(1, 5)},"
        f"{CAPS}/nvidia-cap{mig_cap_minor(1, 5, 0)}  # gpush: GPU 1 2g.10gb@4"
    )


def test_slurm_conf_gres_counts_set_other_gres_and_comment_kept():
    text = with_node_gres(SLURM, "mig01", {"1g.5gb": 8, "2g.10gb": 1, "3g.20gb": 1})
    assert text.splitlines()[1] == (
        "NodeName=mig01 NodeHostname=localhost CPUs=16 Gres=gpu:1g.5gb:8,gpu:2g.10gb:1,gpu:3g.20gb:1 "
        "State=UNKNOWN  # the MIG node"
    )
    assert text.splitlines()[2:] == SLURM.splitlines()[2:]
    assert "Gres=gpu:a100:1,mps:100" in with_node_gres(SLURM, "mps01", {"a100": 1})
    # Gres= from a NodeName=DEFAULT line: its other GRES stay; a comment keeps its place.
    inherited = "NodeName=DEFAULT Gres=gpu:a100:2,mps:200\nNodeName=mig01 CPUs=4 # c"
    assert with_node_gres(inherited, "mig01", {"7g.40gb": 1}).splitlines()[1] == (
        "NodeName=mig01 CPUs=4 Gres=gpu:7g.40gb:1,mps:200 # c"
    )


@pytest.mark.parametrize(
    ("gres", "why"),
    [
        ("NodeName=mig[01-04] Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "with other nodes"),
        ("NodeName=mig00,mig01 Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "with other nodes"),
        ("Name=gpu Type=1g.5gb File=/dev/nvidia-caps/nvidia-cap66\n", "every node"),
        ("NodeName=other Name=gpu Type=a100 File=/dev/nvidia0\n", "no Name=gpu line for node mig01"),
        ("NodeName=mig01 Name=gpu Type=1g.5gb Count=7\n", "without naming their devices"),
        ("NodeName=mig01 Name=gpu Type=1g.5gb \\\n  File=/dev/nvidia-caps/nvidia-cap66\n", "write it on one line"),
        ("NodeName=mig01 AutoDetect=nvml\n", "auto-detected"),
    ],
)
def test_lines_gpush_cannot_rewrite_alone_are_refused_saying_what_to_do(gres, why):
    with pytest.raises(Rejected, match=why):
        GresConf(gres).with_gpu("mig01", 0, [])


def test_slurm_conf_lines_it_cannot_set_are_refused():
    with pytest.raises(Rejected, match="lines of its own"):
        with_node_gres("NodeName=mig[01-02] Gres=gpu:1g.5gb:7\n", "mig01", {"1g.5gb": 7})
    with pytest.raises(Rejected, match="no NodeName line for mig01"):
        with_node_gres("NodeName=other Gres=gpu:a100:1\n", "mig01", {"1g.5gb": 7})
    with pytest.raises(Rejected, match="write it on one line"):
        with_node_gres("NodeName=mig01 CPUs=64 \\\n  Gres=gpu:3g.20gb:2\n", "mig01", {"1g.5gb": 7})
    # a range that does not hold the node is someone else's
    assert with_node_gres("NodeName=gpu[01-02] Gres=gpu:a100:1\nNodeName=mig01\n", "mig01", {"1g.5gb": 7}).endswith(
        "NodeName=mig01 Gres=gpu:1g.5gb:7\n"
    )


def test_an_instance_the_agent_does_not_report_is_refused():
    with pytest.raises(Rejected, match="does not report the instance 7g.40gb@0"):
        mig_devices(0, CAPS, ["7g.40gb@0"], {"3g.20gb@0": (1, 0)})


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"mig_gres_conf": ""}, "leave it out rather than empty"),
        ({"mig_gres_conf": "/x/gres.conf", "mig_reload": "'/x {node}"}, "is not a command line"),
        ({"mig_gres_conf": "/x/gres.conf", "mig_reload": ""}, "mig_reload is a command"),
        (
            {"mig_gres_conf": "/x/gres.conf", "mig_reload": "systemctl restart slurmctld && ssh {node} true"},
            "put the commands in a script",
        ),
        ({"mig_gres_conf": "/x/gres.conf", "rest_url": "http://h:6820", "token": "t"}, "give mig_slurm_conf"),
    ],
)
def test_mig_settings_a_cluster_cannot_use_are_refused_when_it_is_added(config, why):
    with pytest.raises(Exception, match=why):
        SlurmAdapter("s", {"slurm_conf": "/x/slurm.conf", **config} if "rest_url" not in config else config)
