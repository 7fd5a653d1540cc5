"""The Slurm suites' core on the Slurm versions sites run, not only Debian 12's 22.05.

Each Debian release in ``SLURM_SUITES`` (trixie: Slurm 24.11; sid: the newest Debian
carries) gets its own test cluster, started by the same start.sh inside a chroot of that
release's packages (integration/slurm/chroot.sh); the broker stays on the host and
reaches it by slurmrestd's port (REST backend, that version's data format) and by
``command_prefix = chroot ROOT`` (CLI backend). The tests are the host suites' own,
collected here again: the ``slurm_cluster`` and ``slurm_site`` fixtures below replace
the host's clusters for them.

- integration/test_slurm_adapter.py: every sharing mode to completion and a hostile
  command on both backends, why the eighth slice waits, cancel in every state, the
  broker killed between sbatch and its database write.
- integration/test_slurm_identity.py: jobs as their owners under their accounts with
  slurmdbd, a token that cannot choose the user, account limits as waiting reasons.
- integration/test_slurm_gangs.py: a two-node job whose ranks meet over TCP, a gang
  that waits in gpush rather than half-starting in Slurm, cancelling a running gang.
  The cluster has gpu02 beside gpu01 for them (two nodes of whole GPUs); the other
  suites' tests here ask for nothing that gpu02 changes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import delete

from adapters.slurm.client import REST_VERSIONS
from broker.core.clusters import add_cluster
from broker.core.models import Cluster
from broker.intake import queue
from broker.routing import versions as policystore
from broker.routing.versions import cluster_views
from integration.brokers import ADMIN
from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import SLURM_SUITES, chroot_cluster
from integration.test_slurm_adapter import (  # noqa: F401  (fixtures the collected tests use)
    backend,
    broker,
    slurm,
    test_a_broker_killed_between_sbatch_and_the_write_finds_the_job_by_its_tag,
    test_a_command_reaches_the_program_unchanged,
    test_a_job_that_links_its_output_to_a_broker_only_file_gets_a_refusal,
    test_an_impostor_job_of_another_user_is_not_adopted_and_its_output_not_read,
    test_cancel_works_in_every_state,
    test_each_sharing_mode_runs_to_completion,
    test_slurm_says_why_an_eighth_slice_job_waits,
)
from integration.test_slurm_gangs import (  # noqa: F401  (collected again on this version)
    test_a_gang_that_cannot_fit_yet_waits_in_gpush_and_never_half_starts_in_slurm,
    test_a_two_node_job_runs_a_rank_on_each_node_and_they_meet,
    test_cancelling_a_running_gang_cancels_its_one_slurm_job_on_every_node,
)

pytestmark = pytest.mark.skipif(not SLURM_SUITES, reason="GPUSH_SLURM_SUITES=none")


@pytest.fixture(scope="module", params=SLURM_SUITES)
def slurm_cluster(request, slurm_chroots: dict[str, Path]) -> Iterator[SlurmTestCluster]:
    yield from chroot_cluster(slurm_chroots, request.param, accounting=False, whole_nodes=2)


def test_the_cluster_runs_the_suites_slurm(slurm_cluster: SlurmTestCluster):
    assert slurm_cluster.chroot is not None
    assert slurm_cluster.version_info > (22, 5), slurm_cluster.version
    assert slurm_cluster.run("sinfo", "--version").stdout.split()[-1] == slurm_cluster.version


def offered_rest_versions(cluster: SlurmTestCluster) -> list[str]:
    """The slurm plugin's OpenAPI versions this slurmrestd serves, oldest first."""
    with httpx.Client(base_url=cluster.rest_url, headers=cluster.rest_headers(), timeout=10) as http:
        paths = " ".join(http.get("/openapi/v3").raise_for_status().json()["paths"])
    return sorted(set(re.findall(r"/slurm/(v\d+\.\d+\.\d+)/", paths)), key=lambda v: tuple(map(int, v[1:].split("."))))


def test_every_rest_data_format_gpush_speaks_runs_jobs_through_the_real_server(
    engine,
    sessions,
    slurm: SlurmTestCluster,  # noqa: F811  (the imported fixture, requested)
    tmp_path,
):
    """Each OpenAPI version the server offers and gpush speaks (24.11: v0.0.40-42; 26.05:
    v0.0.42-45), forced with api_version: a MIG job and an MPS job run to completion, a
    running one is cancelled. The newest the server offers must be one gpush speaks."""
    from integration.test_slurm_adapter import POLICY, TOKEN_ENV, Broker, Clock

    offered = offered_rest_versions(slurm)
    spoken = [v for v in offered if v in REST_VERSIONS]
    assert spoken, f"slurmrestd offers {offered}; gpush speaks {REST_VERSIONS}"
    assert offered[-1] in REST_VERSIONS, f"slurmrestd's newest format {offered[-1]} is one gpush does not speak"
    tmp_path.chmod(0o755)
    for version in spoken:
        os.environ[TOKEN_ENV] = slurm.token()
        config = {
            "rest_url": slurm.rest_url,
            "token_env": TOKEN_ENV,
            "user": "root",
            "api_version": version,
            "workdir": str(tmp_path),
            "cache_seconds": 0,
        }
        clock = Clock()
        with sessions() as session, session.begin():
            session.execute(delete(Cluster))
            add_cluster(session, name="slurm-a", kind="slurm", config=config, actor="root", now=clock())
        b = Broker(engine, sessions, clock, slurm)
        if version == spoken[0]:
            with sessions() as session, session.begin():
                views = cluster_views(session, b.pool)
                policystore.apply(
                    session, POLICY, comment="v", author="root", now=clock(), views=views, base_version=None
                )
        ran = [
            b.submit(kind="training", isolation="hardware", gpu_memory_gb=4, command=["true"]),
            b.submit(kind="inference", isolation="process", gpu_memory_gb=10, command=["true"]),
        ]
        b.cycle_until(lambda b=b, ran=ran: set(b.states(ran).values()) == {"succeeded"})
        assert b.adapter().client.api_version() == version
        waiting = b.submit(kind="training", gpus=2, command=["sleep", "60"])
        b.cycle_until(lambda b=b, job=waiting: b.job(job).state == "running")
        with sessions() as session, session.begin():
            queue.cancel_job(session, waiting, ADMIN, now=clock())
        b.cycle_until(lambda b=b, job=waiting: b.job(job).state == "cancelled", timeout=20)
