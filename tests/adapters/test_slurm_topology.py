"""Topology on Slurm (issue 35): the network from ``scontrol show topology`` (topology/tree
on 22.05, topology/block on 24.11, recorded from the test cluster's start.sh --topology),
a node's NVLink islands and sockets from gres.conf, free GPUs from GresUsed, and what sbatch
is asked for a gang. integration/test_slurm_topology.py runs them on the real cluster."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from adapters.slurm.records import Gres, SlurmJob, held_indexes
from adapters.slurm.render import render
from adapters.slurm.topology import GresGpu, Network, gpu_topology, parse_topology, read_gres_conf
from broker.core.adapter import Placement, Sharing
from broker.core.topology import GpuTopology
from tests.adapters.test_slurm_adapter import V2205, V2411, RecordedRestd, adapter, recorded_2205, rest, spec

TOPOLOGY = Path(__file__).parent.parent / "data" / "slurm" / "topology"
TREE = (TOPOLOGY / "tree_2205.txt").read_text()
BLOCK = (TOPOLOGY / "block_2411.txt").read_text()
GRES_CONF = (TOPOLOGY / "gres_2205.conf").read_text()


def test_a_tree_gives_each_node_its_leaf_switch_and_the_switches_above_widest_first():
    network = parse_topology(TREE)
    assert network.plugin == "tree" and network.levels == ("switch2", "switch")
    assert network.position("gpu02") == (("switch2", "spine"), ("switch", "leaf1"))
    assert network.position("mps01") == (("switch2", "spine"), ("switch", "leaf2"))
    assert network.position("elsewhere") == (("switch2", None), ("switch", None))


def test_a_three_level_tree_names_the_levels_by_slurms_level():
    text = (
        "SwitchName=s0 Level=0 LinkSpeed=1 Nodes=n[1-2]\n"
        "SwitchName=s1 Level=0 LinkSpeed=1 Nodes=n3\n"
        "SwitchName=s2 Level=1 LinkSpeed=1 Nodes=n[1-3] Switches=s[0-1]\n"
        "SwitchName=top Level=2 LinkSpeed=1 Nodes=n[1-3] Switches=s2\n"
    )
    network = parse_topology(text)
    assert network.position("n3") == (("switch3", "top"), ("switch2", "s2"), ("switch", "s1"))


def test_blocks_give_each_node_its_block():
    network = parse_topology(BLOCK)
    assert network.plugin == "block"
    assert network.position("nvl01") == (("block", "b1"),)
    assert network.position("mig01") == (("block", "b2"),)
    assert network.position("elsewhere") == (("block", None),)


@pytest.mark.parametrize("text", ["", "No topology information available\n"])
def test_no_topology_plugin_means_no_levels(text):
    assert parse_topology(text).position("gpu01") == ()


def test_sbatch_is_asked_to_keep_a_gang_in_its_one_switch_or_block_and_never_across():
    tree, block = parse_topology(TREE), parse_topology(BLOCK)
    assert tree.sbatch_closeness(("gpu01", "gpu02"), (22, 5)) == {"switches": 1}
    assert tree.sbatch_closeness(("gpu01", "mig01"), (22, 5)) == {}  # two leaves: Slurm would wait for ever
    assert tree.sbatch_closeness(("gpu01", "elsewhere"), (22, 5)) == {}  # a node in no switch
    assert tree.sbatch_closeness(("gpu01",), (22, 5)) == {}
    assert block.sbatch_closeness(("gpu01", "gpu02", "nvl01"), (24, 11)) == {"segment": 3}
    assert block.sbatch_closeness(("gpu01", "mps01"), (24, 11)) == {}
    assert block.sbatch_closeness(("gpu01", "gpu02"), (24, 5)) == {}  # sbatch has no --segment before 24.11
    assert Network().sbatch_closeness(("gpu01", "gpu02"), (24, 11)) == {}


def test_links_in_gres_conf_make_the_nvlink_islands_in_slurms_device_order():
    layout = read_gres_conf(GRES_CONF)
    assert [g.index for g in layout["mig01"]] == list(range(9)) and all(g.mig for g in layout["mig01"])
    assert [(g.index, g.type) for g in layout["gpu01"]] == [(0, "a100"), (1, "a100")]
    topology = gpu_topology(layout["nvl01"])
    assert topology == GpuTopology(nvlink=((0, 2), (1, 3)), source="gres.conf")
    assert gpu_topology(layout["gpu01"]) is None  # no Links=, no Cores=: unknown, not "no NVLink"


def test_cores_put_each_gpu_on_its_socket_and_node_ranges_hold_for_each_node():
    text = (
        "NodeName=dgx[01-02] Name=gpu Type=h100 File=/dev/nvidia[0-1] Cores=0-7\n"
        "NodeName=dgx[01-02] Name=gpu Type=h100 File=/dev/nvidia[2-3] Cores=8-15\n"
        "NodeName=dgx[01-02] Name=gpu Type=h100 File=/dev/nvidia4 Cores=0-15  # on both: no one socket\n"
    )
    layout = read_gres_conf(text)
    assert layout.keys() == {"dgx01", "dgx02"}
    topology = gpu_topology(layout["dgx02"], cores_per_socket=8)
    assert topology == GpuTopology(socket=((0, 1), (2, 3)), source="gres.conf")
    assert gpu_topology(layout["dgx02"], cores_per_socket=0) is None  # sockets unknown


def test_gres_used_says_which_devices_are_held():
    used = "gpu:h100:3(IDX:0,2-3),mps:0"
    assert held_indexes(used, "gpu", "h100") == {0, 2, 3}
    assert held_indexes("gpu:h100:0(IDX:N/A),mps:0", "gpu", "h100") == set()
    assert held_indexes(used, "gpu", "a100") is None
    assert held_indexes("gpu:h100:1", "gpu", "h100") is None  # no indexes said


def nvl_cluster(tmp_path: Path, used: str = "gpu:h100:1(IDX:0),mps:0"):
    slurm = recorded_2205()
    slurm.topology_text = TREE
    base = next(n for n in slurm.node_list if n.name == "gpu01")
    slurm.node_list.append(
        replace(
            base,
            name="nvl01",
            gres=(Gres("gpu", "h100", 4),),
            gres_used=(Gres("gpu", "h100", 1),),
            gres_used_text=used,
            states=("MIXED",),
            sockets=2,
            cores_per_socket=8,
        )
    )
    conf = tmp_path / "gres.conf"
    conf.write_text(GRES_CONF)
    return slurm, conf


def test_the_inventory_reports_each_nodes_switches_islands_and_free_gpus(tmp_path):
    slurm, conf = nvl_cluster(tmp_path)
    units = adapter(slurm, gres_conf=str(conf)).inventory()
    nvl = next(u for u in units if u.node == "nvl01")
    assert nvl.sharing == Sharing.SLURM_EXCLUSIVE and (nvl.capacity, nvl.allocated) == (4, 1)
    assert nvl.topology == (("switch2", "spine"), ("switch", "leaf1"))
    assert nvl.gpu_topology == GpuTopology(nvlink=((0, 2), (1, 3)), source="gres.conf")
    assert nvl.free_gpus == (1, 2, 3)
    mig = [u for u in units if u.node == "mig01"]
    assert mig and all(u.topology == (("switch2", "spine"), ("switch", "leaf2")) for u in mig)
    assert all(u.free_gpus is None and u.gpu_topology is None for u in mig)


def test_without_gres_conf_or_topology_the_inventory_says_unknown(tmp_path):
    slurm, _conf = nvl_cluster(tmp_path)
    slurm.topology_text = ""
    nvl = next(u for u in adapter(slurm).inventory() if u.node == "nvl01")
    assert (nvl.topology, nvl.gpu_topology) == ((), None)
    assert nvl.free_gpus == (1, 2, 3)  # the node's one GPU type: indexes 0-3, GresUsed holds 0


def test_a_gang_in_one_leaf_switch_is_submitted_with_switches_and_one_across_leaves_without():
    slurm = recorded_2205()
    slurm.topology_text = TREE
    gpush = adapter(slurm)
    gang = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 2.0, node="gpu01", gpu_model="A100-SXM4-40GB")
    gpush.submit(40, spec(nodes=2, isolation="exclusive"), replace(gang, nodes=("gpu01", "gpu02")))
    gpush.submit(41, spec(nodes=2, isolation="exclusive"), replace(gang, nodes=("gpu01", "mig01")))
    inside, across = slurm.submitted
    assert "--switches=1" in inside.sbatch_args() and "--nodelist=gpu01,gpu02" in inside.sbatch_args()
    assert not any(a.startswith(("--switches", "--segment")) for a in across.sbatch_args())
    assert "--nodelist=gpu01,mig01" in across.sbatch_args()


def test_render_asks_for_a_segment_only_for_several_nodes():
    gang = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 2.0, node="gpu01", nodes=("gpu01", "gpu02"))
    job = render(7, spec(nodes=2), gang, tag="gpush", gres_type="a100", closeness={"segment": 2})
    assert "--segment=2" in job.sbatch_args() and "--nodes=2" in job.sbatch_args()
    one = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 1.0, node="gpu01")
    alone = render(8, spec(), one, tag="gpush", gres_type="a100", closeness={"switches": 1})
    assert not any(a.startswith("--switches") for a in alone.sbatch_args())


def test_rest_sends_switches_and_segment_where_the_api_has_them():
    gang = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 1, 2.0, node="gpu01", nodes=("gpu01", "gpu02"))
    job = render(7, spec(nodes=2), gang, tag="gpush", gres_type="a100", closeness={"switches": 1})
    old = RecordedRestd(V2205)
    rest(old).submit(job)
    assert "required_switches" not in json.loads(old.requests[-1].content)["job"]  # v0.0.38: "Disabled key"
    new = RecordedRestd(V2411)
    rest(new).submit(job)
    assert json.loads(new.requests[-1].content)["job"]["required_switches"] == 1
    segmented = render(7, spec(nodes=2), gang, tag="gpush", gres_type="a100", closeness={"segment": 2})
    rest(new).submit(segmented)
    assert json.loads(new.requests[-1].content)["job"]["segment_size"] == 2


def test_gpus_of_mig_lines_are_not_whole_gpus():
    gpus = [GresGpu(0, "1g.5gb", (), frozenset(), mig=True), GresGpu(1, "a100", (-1,), frozenset())]
    assert gpu_topology(gpus) == GpuTopology(nvlink=((1,),), source="gres.conf")


@pytest.mark.parametrize(("release", "asked"), [("22.05.8", "--gres=gpu:h100:2"), ("24.11.5", "--gpus=h100:2")])
def test_several_gpus_on_a_node_with_islands_are_asked_so_that_slurm_follows_links(tmp_path, release, asked):
    slurm, conf = nvl_cluster(tmp_path)
    slurm.release = release
    gpush = adapter(slurm, gres_conf=str(conf))
    on = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="nvl01", gpu_model="H100-SXM5-80GB")
    gpush.submit(50, spec(isolation="exclusive"), on)
    gpush.submit(51, spec(isolation="exclusive"), replace(on, units=1, gpu_equivalents=1.0))
    two, one = (s.sbatch_args() for s in slurm.submitted)
    assert asked in two and not ({"--gres=gpu:h100:2", "--gpus=h100:2"} - {asked}) & set(two)
    assert "--gres=gpu:h100:1" in one  # one GPU: nothing to keep together


def test_a_node_without_islands_keeps_the_per_node_request_on_24_11(tmp_path):
    slurm, conf = nvl_cluster(tmp_path)
    slurm.release = "24.11.5"
    gpush = adapter(slurm, gres_conf=str(conf))
    gpush.submit(52, spec(isolation="exclusive"), Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="gpu01"))
    assert "--gres=gpu:a100:2" in slurm.submitted[0].sbatch_args()


def test_rest_asks_gpus_per_job_and_squeue_reads_them_back_as_the_jobs_request():
    one = Placement("slurm-a", Sharing.SLURM_EXCLUSIVE, 2, 2.0, node="gpu01")
    job = render(7, spec(), one, tag="gpush", gres_type="a100", gpus_per_job=True)
    restd = RecordedRestd(V2411)
    rest(restd).submit(job)
    sent = json.loads(restd.requests[-1].content)["job"]
    assert sent["tres_per_job"] == "gres/gpu:a100=2" and "tres_per_node" not in sent
    listed = SlurmJob.of({"job_id": 9, "tres_per_node": "", "tres_per_job": "gres/gpu:h100:2"})
    assert listed.tres_per_node == (Gres("gpu", "h100", 2),)
