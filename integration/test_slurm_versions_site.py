"""Jobs as their owners, with slurmdbd, on the newer Slurm versions (see
integration/test_slurm_versions.py for how each version runs)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.slurm.cluster import SlurmTestCluster
from integration.slurm_fixtures import SITE_USERS, SLURM_SUITES, chroot_cluster
from integration.test_slurm_identity import (  # noqa: F401  (fixtures the collected tests use)
    backend,
    broker,
    site,
    test_a_user_cancels_their_own_running_job,
    test_a_users_job_that_links_its_log_directory_to_the_brokers_gets_a_refusal,
    test_a_users_job_that_links_its_output_to_a_broker_only_file_gets_a_refusal,
    test_a_users_token_cannot_make_a_job_run_as_someone_else,
    test_an_account_gpu_limit_is_a_waiting_reason_in_the_users_words,
    test_an_unmapped_user_is_refused_and_nothing_runs,
    test_another_users_job_named_like_a_users_job_is_not_taken_for_it,
    test_each_job_runs_as_its_owner_under_its_tenants_account,
    test_proxy_mode_runs_the_job_as_its_owner,
    workdir,
)

pytestmark = pytest.mark.skipif(not SLURM_SUITES, reason="GPUSH_SLURM_SUITES=none")


@pytest.fixture(scope="module", params=SLURM_SUITES)
def slurm_site(request, slurm_chroots: dict[str, Path]) -> Iterator[SlurmTestCluster]:
    clusters = chroot_cluster(slurm_chroots, request.param, accounting=True)
    cluster = next(clusters)
    cluster.sacctmgr("add", "account", ",".join(sorted(set(SITE_USERS.values()))))
    for user, account in SITE_USERS.items():
        cluster.sacctmgr("add", "user", user, f"account={account}")
    yield cluster
    next(clusters, None)
