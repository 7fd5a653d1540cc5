"""Multi-node jobs on the real Slurm test cluster (issue 34): gpush places a gang of whole
GPUs on two nodes and Slurm runs it as one batch job there, with one rank per node.

The cluster is the suites' own (integration/slurm/start.sh) with a second node of two
whole A100s (``--whole-nodes=2``: gpu01 and gpu02) and slurmdbd (``--accounting``, so
that sacct has the job), on ports of its own beside the session's cluster. Each test runs
on both backends (sbatch and slurmrestd). The ranks are a small Perl program (perl-base is
in every Debian, the newer Slurms' chroots included; Python is not): rank 0 listens on
``MASTER_ADDR:MASTER_PORT``, every other rank connects and says who it is, and each prints
its rank, node rank, node and GPUs.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adapters.slurm.records import parse_gres
from broker.core.adapter import Sharing
from broker.intake import queue
from integration import test_slurm_adapter as suite
from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import own_cluster
from integration.test_slurm_adapter import ADMIN, Broker, output, tagged_in_slurm

# The Slurm suite's fixtures, on this module's cluster (slurm_cluster below): both
# backends, a broker on PostgreSQL with the suite's policy (training on whole GPUs).
backend, broker, slurm = suite.backend, suite.broker, suite.slurm

GANG_PORTS = {
    "GPUSH_SLURMCTLD_PORT": "9317",
    "GPUSH_SLURMDBD_PORT": "9319",
    "GPUSH_SLURMRESTD_PORT": "9320",
    "GPUSH_SLURMD_PORT": "9321",  # four nodes: 9321-9324
}

# One rank: rank 0 listens, the others connect (retrying until rank 0 listens); each
# prints whom it met, then waits for GANG_MARKER (so that the test sees the job run).
RANK = r"""
use strict; use IO::Socket::INET; $| = 1;
my ($rank, $nrank, $node, $world) = @ENV{qw(RANK NODE_RANK SLURMD_NODENAME WORLD_SIZE)};
my ($addr, $port) = @ENV{qw(MASTER_ADDR MASTER_PORT)};
my $me = "rank $rank (node rank $nrank) on $node";
my $gpus = $ENV{CUDA_VISIBLE_DEVICES} // "none";
if ($rank == 0) {
    my $server = IO::Socket::INET->new(LocalAddr => $addr, LocalPort => $port, Listen => 8, ReuseAddr => 1)
        or die "$me: cannot listen on $addr:$port: $!";
    for (2 .. $world) {
        my $peer = $server->accept or die "$me: accept: $!";
        my $hello = <$peer>; chomp $hello;
        print $peer "$me\n"; close $peer;
        print "$me with GPUs $gpus met $hello at $addr:$port\n";
    }
} else {
    my $peer;
    for (1 .. 300) {
        $peer = IO::Socket::INET->new(PeerAddr => $addr, PeerPort => $port) and last;
        select(undef, undef, undef, 0.1);
    }
    $peer or die "$me: nobody listens on $addr:$port";
    print $peer "$me\n";
    my $reply = <$peer>; chomp $reply;
    print "$me with GPUs $gpus met $reply at $addr:$port\n";
}
select(undef, undef, undef, 0.1) until -e $ENV{GANG_MARKER};
"""


@pytest.fixture(scope="module")
def slurm_cluster() -> Iterator[SlurmTestCluster]:
    """The test cluster with gpu01 and gpu02 (two whole A100s each) and slurmdbd."""
    yield from own_cluster("gpush-slurm-gangs-", GANG_PORTS, "with two whole-GPU nodes", accounting=True, whole_nodes=2)


def gang(b: Broker, marker: Path) -> int:
    """A job of two nodes with one whole GPU each, one rank per node."""
    return b.submit(kind="training", gpus=1, nodes=2, command=["perl", "-e", RANK], env={"GANG_MARKER": str(marker)})


def gpus_in_use(cluster: SlurmTestCluster) -> dict[str, int]:
    """Whole A100s Slurm says are in use, per node (its GresUsed)."""
    return {
        name: sum(g.count for g in parse_gres(node.get("gres_used")) if (g.name, g.type) == ("gpu", "a100"))
        for name, node in cluster.nodes().items()
        if name.startswith("gpu")
    }


def met(text: str) -> list[tuple[str, str, str, str]]:
    """(rank, node rank, node, the rank it met) of each line a rank printed."""
    return re.findall(
        r"^rank (\d) \(node rank (\d)\) on (\S+) with GPUs \d met (rank \d) \(node rank \d\) on \S+ at ", text, re.M
    )


def test_a_two_node_job_runs_a_rank_on_each_node_and_they_meet(broker: Broker, slurm: SlurmTestCluster, backend):
    marker = broker.workdir / "done"
    job_id = gang(broker, marker)
    broker.cycle_until(lambda: broker.job(job_id).state == "running", timeout=40)
    placement = broker.job(job_id).placement
    assert sorted(placement["nodes"]) == ["gpu01", "gpu02"] and placement["units"] == 1

    deadline = time.monotonic() + 30
    while len(met(_output_or_empty(broker, job_id))) < 2:
        assert time.monotonic() < deadline, f"the ranks did not meet: {_output_or_empty(broker, job_id)!r}"
        time.sleep(0.2)
    ranks = sorted(met(output(broker, job_id)))
    # gpush's rank 0 node is Slurm's first node of the job, which runs the batch script
    # and so is the rendezvous.
    first = placement["nodes"][0]
    second = next(n for n in placement["nodes"] if n != first)
    assert ranks == [("0", "0", first, "rank 1"), ("1", "1", second, "rank 0")], output(broker, job_id)

    # Slurm runs it as gpush placed it: one job, on both nodes, one A100 on each.
    assert tagged_in_slurm(slurm, broker)[job_id] == 1
    record = slurm.job(int(broker.job(job_id).backend_id))
    assert record is not None and record["nodes"] == "gpu[01-02]"
    assert parse_gres(record["tres_per_node"]) == parse_gres("gpu:a100:1")
    assert gpus_in_use(slurm) == {"gpu01": 1, "gpu02": 1}
    held = {u.node: u.allocated for u in broker.adapter().inventory() if u.sharing == Sharing.SLURM_EXCLUSIVE}
    assert held == {"gpu01": 1, "gpu02": 1}
    assert broker.held_gpus() == pytest.approx(2.0)  # the ledger charges both nodes' GPUs

    marker.touch()
    broker.cycle_until(lambda: broker.job(job_id).state == "succeeded", timeout=30)
    if slurm.accounting:  # slurmdbd recorded one job of two nodes holding two GPUs
        _sacct_agrees(slurm, broker.job(job_id).backend_id)


def _sacct_agrees(cluster: SlurmTestCluster, backend_id: str) -> None:
    """sacct has the job as one allocation of two nodes and two GPUs, and its ranks' step
    on both nodes. (22.05's slurmdbd records the allocation's NodeList as its first node
    alone here, with NNodes 2; the step names both.)"""
    deadline = time.monotonic() + 20
    while "COMPLETED" not in (rows := _sacct(cluster, backend_id)).get(backend_id, ("",))[0]:
        assert time.monotonic() < deadline, f"sacct has no finished record of job {backend_id}: {rows}"
        time.sleep(0.3)
    _state, _nodes, count, tres = rows[backend_id]
    assert count == "2" and {"node=2", "gres/gpu=2"} <= set(tres.split(",")), rows
    _state, nodes, count, tres = rows[f"{backend_id}.0"]  # srun's step: every rank
    assert (nodes, count) == ("gpu[01-02]", "2") and "gres/gpu=2" in tres.split(","), rows


def _sacct(cluster: SlurmTestCluster, backend_id: str) -> dict[str, list[str]]:
    """Job or step id -> [State, NodeList, NNodes, AllocTRES], as sacct has them."""
    out = cluster.run(
        "sacct", "-a", "-n", "-P", "--format=JobID,State,NodeList,NNodes,AllocTRES", "-j", backend_id
    ).stdout
    return {line.split("|")[0]: line.split("|")[1:] for line in out.splitlines() if line}


def test_a_gang_that_cannot_fit_yet_waits_in_gpush_and_never_half_starts_in_slurm(
    broker: Broker, slurm: SlurmTestCluster, backend
):
    # A one-node job takes both GPUs of one of the two nodes: a rank would fit on the other.
    blocker_done = broker.workdir / "blocker-done"
    blocker = broker.submit(
        kind="training", gpus=2, command=["sh", "-c", f'while [ ! -e "{blocker_done}" ]; do sleep 0.1; done']
    )
    broker.cycle_until(lambda: broker.job(blocker).state == "running", timeout=30)
    marker = broker.workdir / "done"
    marker.touch()  # the ranks end as soon as they met
    waiting = gang(broker, marker)
    for _ in range(4):
        broker.scheduler.run_cycle()
        time.sleep(0.3)
    job = broker.job(waiting)
    assert job.state == "queued", broker.summary()
    assert job.state_reason.startswith("waiting for 2 nodes with 1 free A100"), job.state_reason
    assert "1 has them now" in job.state_reason
    assert waiting not in tagged_in_slurm(slurm, broker)  # nothing of it reached Slurm
    busy = gpus_in_use(slurm)
    assert sorted(busy.values()) == [0, 2], busy  # the blocker's node full, the other idle

    blocker_done.touch()
    broker.cycle_until(lambda: broker.job(waiting).state == "succeeded", timeout=40)
    assert len(met(output(broker, waiting))) == 2
    assert tagged_in_slurm(slurm, broker)[waiting] == 1


def test_cancelling_a_running_gang_cancels_its_one_slurm_job_on_every_node(
    broker: Broker, slurm: SlurmTestCluster, backend
):
    job_id = gang(broker, broker.workdir / "never")
    broker.cycle_until(lambda: len(met(_output_or_empty(broker, job_id))) == 2, timeout=40)
    with broker.sessions() as session, session.begin():
        queue.cancel_job(session, job_id, ADMIN, now=broker.clock())
    broker.cycle_until(lambda: broker.job(job_id).state == "cancelled", timeout=20)
    record = slurm.wait_for(int(broker.job(job_id).backend_id), "CANCELLED", timeout=20)
    assert record["nodes"] == "gpu[01-02]"
    deadline = time.monotonic() + 20
    while any(gpus_in_use(slurm).values()):  # both ranks ended, both nodes' GPUs free
        assert time.monotonic() < deadline, gpus_in_use(slurm)
        time.sleep(0.2)


def _output_or_empty(b: Broker, job_id: int) -> str:
    path = b.workdir / "gpush-logs" / f"{b.adapter().settings.tag}-{job_id}.out"
    return path.read_text() if path.exists() else ""
