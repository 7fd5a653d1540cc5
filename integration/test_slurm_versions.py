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
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import SLURM_SUITES, chroot_cluster
from integration.test_slurm_adapter import (  # noqa: F401  (fixtures the collected tests use)
    backend,
    broker,
    slurm,
    test_a_broker_killed_between_sbatch_and_the_write_finds_the_job_by_its_tag,
    test_a_command_reaches_the_program_unchanged,
    test_cancel_works_in_every_state,
    test_each_sharing_mode_runs_to_completion,
    test_slurm_says_why_an_eighth_slice_job_waits,
)

pytestmark = pytest.mark.skipif(not SLURM_SUITES, reason="GPUSH_SLURM_SUITES=none")


@pytest.fixture(scope="module", params=SLURM_SUITES)
def slurm_cluster(request, slurm_chroots: dict[str, Path]) -> Iterator[SlurmTestCluster]:
    yield from chroot_cluster(slurm_chroots, request.param, accounting=False)


def test_the_cluster_runs_the_suites_slurm(slurm_cluster: SlurmTestCluster):
    assert slurm_cluster.chroot is not None
    assert slurm_cluster.version_info > (22, 5), slurm_cluster.version
    assert slurm_cluster.run("sinfo", "--version").stdout.split()[-1] == slurm_cluster.version
