"""`gpush mig apply` on the real Slurm test cluster: a GPU of mig01 re-cut while jobs run, on
Debian 12's Slurm 22.05 and on each newer Slurm of SLURM_SUITES in its chroot (24.11, 26.05).

The broker runs here in-process (PostgreSQL, the real scheduling cycle and API), with one
cluster, ``slurm-mig``: a test cluster of its own (its own ports and files, since this test
rewrites them), whose adapter rewrites gres.conf and slurm.conf (adapters.slurm.mig) and
restarts slurmctld and mig01's slurmd (integration/slurm/reload.sh: Slurm 22.05 takes a
node's new GRES counts only then; the newer ones take them at ``scontrol reconfigure``).
mig01's agent is ``gpush agent --allow-mig-changes`` in this process, over a stateful fake
NVML (tests.doubles.fake_nvml) with the cluster's layout: GPU 0 seven 1g.5gb, GPU 1 two
3g.20gb. The test plays the driver too: the capability
device of each instance the agent creates appears under the cluster's fake /dev.
"""

from __future__ import annotations

import os
import shlex
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from broker.api.app import create_app
from broker.client.sdk import GpushClient
from broker.core import auth
from broker.core.clusters import add_cluster
from broker.core.models import Job, MigChange
from broker.core.schemas import Role
from broker.mig.config import mig_cap_minor as cap_minor
from broker.nodeagent.agent import collect, run_agent
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import SLURM_SUITES, chroot_cluster, own_cluster
from integration.test_slurm_adapter import Broker, Clock
from tests.doubles.fake_nvml import FakeNvml

HERE = Path(__file__).resolve().parent
RELOAD = HERE / "slurm" / "reload.sh"
PORTS = {
    "GPUSH_SLURMCTLD_PORT": "9617",
    "GPUSH_SLURMRESTD_PORT": "9620",
    "GPUSH_SLURMD_PORT": "9621",
}
CLUSTER = "slurm-mig"
POLICY = f"""
rules:
  - name: isolated-on-mig
    why: hardware isolation on the smallest MIG slice that holds the job
    match: {{isolation: hardware}}
    route: {{cluster: {CLUSTER}, sharing: slurm/mig}}
mig:
  step_timeout: 2m
preemption:
  grace: 2
"""
SEVEN = [f"1g.5gb@{i}" for i in range(7)]
TWO = ["3g.20gb@0", "3g.20gb@4"]


@pytest.fixture(scope="module", params=["host", *SLURM_SUITES])
def mig_slurm(request, slurm_chroots: dict[str, Path]) -> Iterator[SlurmTestCluster]:
    """The host's Slurm (22.05) in a cluster of this module's own; and each newer Slurm of
    SLURM_SUITES in its chroot (24.11, the newest Debian carries)."""
    if request.param != "host":
        yield from chroot_cluster(slurm_chroots, request.param, accounting=False)
        return
    yield from own_cluster("gpush-slurm-mig-", PORTS, "for MIG changes")


class Site(Broker):
    """The broker, its API in this process, and mig01's agent over a fake NVML."""

    def __init__(self, engine, sessions, clock, slurm: SlurmTestCluster):
        super().__init__(engine, sessions, clock, slurm)
        self.app = create_app(engine, clock=clock, token_cache_ttl=0)
        self.gpus = FakeNvml.with_layouts("A100-SXM4-40GB", [SEVEN, TWO])
        self.caps = slurm.state / "dev" / "mig01" / "nvidia-caps"
        with sessions() as session, session.begin():
            _, self.admin_token = auth.create_token(
                session, user="root", tenant="ops", role=Role.ADMIN, description=None, now=clock()
            )
            _, self.agent_token = auth.create_token(
                session,
                user="agent-mig01",
                tenant="ops",
                role=Role.AGENT,
                description=None,
                now=clock(),
                nodes=["mig01"],
            )

    def http(self) -> httpx.Client:
        from conftest import in_process

        return httpx.Client(base_url="http://gpush.test", transport=in_process(self.app))

    def admin(self) -> GpushClient:
        from conftest import in_process

        return GpushClient("http://gpush.test", self.admin_token, transport=in_process(self.app), retries=1)

    def agent_round(self) -> None:
        """``gpush agent --allow-mig-changes`` once on mig01; then the driver's part: a
        capability device for every GPU instance the fake GPUs hold."""
        with self.http() as client:
            run_agent(
                "http://gpush.test",
                self.agent_token,
                "mig01",
                0,
                library=self.gpus,
                once=True,
                client=client,
                allow_mig_changes=True,
            )
        for gpu in collect(self.gpus, "mig01").gpus:
            for instance in gpu.mig_instances:
                minor = cap_minor(gpu.index, instance.gi_id)
                device = self.caps / f"nvidia-cap{minor}"
                if not device.exists():
                    try:  # a character device as the driver makes (start.sh's fake /dev does the same)
                        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(237, minor))
                    except PermissionError:
                        device.touch()

    def running_on_slurm(self, job_id: int) -> bool:
        backend = self.job(job_id).backend_id
        return any(str(j["job_id"]) == backend and "RUNNING" in str(j["job_state"]) for j in self.slurm.jobs())


@pytest.fixture
def site(engine, sessions, mig_slurm: SlurmTestCluster, tmp_path) -> Iterator[Site]:
    clock = Clock()
    tmp_path.chmod(0o755)
    etc = mig_slurm.state / "etc"
    config = {
        "slurm_conf": str(mig_slurm.conf),
        "jobcomp_file": str(mig_slurm.jobcomp),
        "workdir": str(tmp_path),
        "cache_seconds": 0,
        "mig_gres_conf": str(etc / "gres.conf"),
        "mig_caps_dir": str(mig_slurm.state / "dev" / "{node}" / "nvidia-caps"),
        # 22.05 takes new GRES counts only when slurmctld restarts (reload.sh restarts it and
        # the node's slurmd); from 23.11 the default, scontrol reconfigure, restarts both.
        "mig_reload": f"{shlex.quote(str(RELOAD))} {shlex.quote(str(mig_slurm.state))} {{node}}",
    }
    if mig_slurm.chroot is not None:
        prefix = shlex.join(mig_slurm.command_prefix)
        config.update(command_prefix=prefix, mig_reload=f"{prefix} scontrol reconfigure")
    with sessions() as session, session.begin():
        add_cluster(session, name=CLUSTER, kind="slurm", config=config, actor="root", now=clock())
    made = Site(engine, sessions, clock, mig_slurm)
    with sessions() as session, session.begin():
        policystore.apply(
            session,
            POLICY,
            comment="MIG changes on Slurm",
            author="root",
            now=clock(),
            views=cluster_views(session, made.pool),
            base_version=None,
        )
    yield made
    mig_slurm.cancel_all()


def test_mig_apply_recuts_a_gpu_that_slurm_then_offers_and_no_job_is_lost(site: Site, mig_slurm):
    site.agent_round()
    # Both 3g.20gb instances (GPU 1) run training that may be preempted. Slurm aborts every job
    # on a node whose GRES change, so the change of GPU 0 waits for mig01 to be empty: gpush
    # preempts them, and they run again afterwards.
    sleep = ["sleep", "600"]
    holders = [
        site.submit(kind="training", isolation="hardware", gpu_memory_gb=20, command=sleep, preemptible=True)
        for _ in range(2)
    ]
    site.cycle_until(lambda: all(site.running_on_slurm(i) for i in holders), timeout=30)
    # Work that needs 10 GB: no instance of 10 GB exists, the 3g.20gb are taken: it waits.
    wanting = [site.submit(kind="training", isolation="hardware", gpu_memory_gb=10, command=["true"]) for _ in range(2)]
    for _ in range(3):
        site.scheduler.run_cycle()
    assert site.states(wanting) == {i: "queued" for i in wanting}

    with site.admin() as admin:
        applied = admin.mig_apply(node="mig01")
    (gpu,) = [g for g in applied["gpus"] if g["change"] is not None]
    assert (gpu["node"], gpu["gpu"]) == ("mig01", 0), applied
    planned = {p.partition("@")[0] for p in gpu["planned"]}

    deadline = time.monotonic() + 90
    while True:
        site.scheduler.run_cycle()
        site.agent_round()
        with site.sessions() as session:
            step = session.scalars(select(MigChange)).one().step
        if step in ("done", "rolled-back", "failed", "cancelled") or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    with site.admin() as admin:
        shown = admin.mig_change(gpu["change"])
    assert step == "done", shown
    steps = [e["step"] for e in shown["events"]]
    assert steps[:3] == ["planned", "draining", "emptying"] and steps[-3:] == ["publishing", "confirming", "done"]
    notes = " / ".join(e["note"] for e in shown["events"])
    assert all(f"preempting job {i}" in notes for i in holders), notes

    # Slurm offers the new layout: gpush's lines in gres.conf, slurmctld counts them, mig01 resumed.
    node = mig_slurm.run("scontrol", "show", "node", "mig01").stdout
    assert "gpu:3g.20gb:2" in node and "gpu:1g.5gb" not in node and "DRAIN" not in node, node
    gres = (mig_slurm.state / "etc" / "gres.conf").read_text()
    assert "# gpush: GPU 0 " in gres and "Name=mps" in gres, gres  # other nodes' lines kept
    # Nothing is lost: the waiting work runs on the new instances, the preempted training again.
    site.cycle_until(lambda: site.states(wanting) == {i: "succeeded" for i in wanting}, timeout=60)
    site.cycle_until(lambda: all(site.running_on_slurm(i) for i in holders), timeout=60)
    with site.sessions() as session:
        placed = [session.get(Job, i).placement for i in wanting]
    assert {p["mig_profile"] for p in placed} <= planned - {"1g.5gb"}, placed
    assert {p["node"] for p in placed} == {"mig01"}
