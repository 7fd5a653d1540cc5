"""pytest fixtures for the real Slurm test cluster (integration/slurm/).

``slurm_cluster`` (session scope) starts the cluster fresh in a temporary STATE and
stops and deletes it when the session ends. The STATE is not under pytest's
basetemp, which is private (0700), because slurmrestd runs as another user and must
read its configuration there. With ``GPUSH_SLURM_STATE`` set to the STATE of a
cluster that is already up (``integration/slurm/start.sh STATE``), it uses that one
and leaves it running. A cluster that does not start is a failure, never a skip:
`make test` installs Slurm first (``make slurm``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from integration.slurm.cluster import SlurmClusterError, SlurmTestCluster, chroot_of, start, unmount_chroot


def _running_cluster(state: str) -> SlurmTestCluster | None:
    try:
        cluster = SlurmTestCluster.load(state)
    except (SlurmClusterError, KeyError, OSError):
        return None
    return cluster if cluster.is_up() else None


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmTestCluster]:
    """A running Slurm cluster: mig01 (MIG slices), mps01 (MPS), gpu01 (whole GPUs)."""
    chosen = os.environ.get("GPUSH_SLURM_STATE")
    if chosen and (cluster := _running_cluster(chosen)):
        yield cluster
        cluster.cancel_all()  # someone else's cluster: leave it up, but as we found it
        return

    # A GPUSH_SLURM_STATE that is not running yet is started there and kept
    # afterwards, logs included; a temporary one is deleted.
    state = Path(chosen) if chosen else Path(tempfile.mkdtemp(prefix="gpush-slurm-"))
    try:
        cluster = start(state, fresh=True)
    except SlurmClusterError as exc:
        failure = str(exc)  # start.sh's own output: the reason and the daemons' log tails
    else:
        failure = None
    if failure:
        if not chosen:
            shutil.rmtree(state, ignore_errors=True)
        pytest.fail(f"the Slurm test cluster did not start in {state}:\n{failure}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop(purge=not chosen)


# -- a site's cluster: slurmdbd, associations, users and accounts ---------------------

# The site's people: Unix users the setup creates, each in the Slurm account of a tenant.
SITE_USERS = {"alice": "vision", "bob": "nlp"}
# Its own ports, so that it runs beside the session's plain cluster.
SITE_PORTS = {
    "GPUSH_SLURMCTLD_PORT": "7817",
    "GPUSH_SLURMDBD_PORT": "7819",
    "GPUSH_SLURMRESTD_PORT": "7820",
    "GPUSH_SLURMD_PORT": "7821",
}


def ensure_unix_user(name: str) -> None:
    """The Unix user ``name``, created (with a home) if the machine has none: a site's
    jobs run as real users, whose files and processes are theirs."""
    try:
        pwd.getpwnam(name)
        return
    except KeyError:
        pass
    if os.geteuid() != 0:
        pytest.fail(f"the site tests need a Unix user {name!r}: create it (useradd -m {name}) or run as root")
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)


@pytest.fixture(scope="session")
def slurm_site() -> Iterator[SlurmTestCluster]:
    """A Slurm cluster as a real site runs one (start.sh --accounting): slurmdbd on the
    machine's MariaDB, AccountingStorageEnforce=associations,limits,qos, Unix users alice
    and bob, account vision (alice's) and nlp (bob's). Root keeps its own association."""
    for user in SITE_USERS:
        ensure_unix_user(user)
    state = Path(tempfile.mkdtemp(prefix="gpush-slurm-site-"))
    try:
        cluster = start(state, fresh=True, env=SITE_PORTS, accounting=True)
    except SlurmClusterError as exc:
        shutil.rmtree(state, ignore_errors=True)
        pytest.fail(f"the Slurm site cluster (slurmdbd on MariaDB) did not start in {state}:\n{exc}", pytrace=False)
    try:
        cluster.sacctmgr("add", "account", ",".join(sorted(set(SITE_USERS.values()))))
        for user, account in SITE_USERS.items():
            cluster.sacctmgr("add", "user", user, f"account={account}")
        yield cluster
    finally:
        cluster.stop(purge=True)


# -- newer Slurm versions, each in a Debian chroot (integration/slurm/chroot.sh) --------

# Debian releases whose Slurm the core suites also run on: trixie carries 24.11, sid the
# newest Debian has (26.05 when this was written). GPUSH_SLURM_SUITES narrows the list
# (a space-separated list; "none" for none, which make test counts as a failure: its
# GPUSH_CI=1 fails a skipped test, tests/skips.py).
SLURM_SUITES = [s for s in os.environ.get("GPUSH_SLURM_SUITES", "trixie sid").split() if s != "none"]
# Each its own ports, apart from the host's clusters (68xx, 78xx).
SUITE_PORTS = {
    suite: {
        "GPUSH_SLURMCTLD_PORT": str(base + 17),
        "GPUSH_SLURMDBD_PORT": str(base + 19),
        "GPUSH_SLURMRESTD_PORT": str(base + 20),
        "GPUSH_SLURMD_PORT": str(base + 21),
    }
    for suite, base in (("trixie", 8800), ("sid", 8900), ("forky", 9000))
}


@pytest.fixture(scope="session")
def slurm_chroots() -> Iterator[dict[str, Path]]:
    """Debian suite -> its Slurm chroot, built and mounted on first use (a minute or two
    the first time on a machine), unmounted when the session ends if this session mounted
    it (another test run's clusters may be using one it found mounted)."""
    roots: dict[str, Path] = {}
    try:
        yield roots
    finally:
        for suite, root in roots.items():
            if suite in _MOUNTED_HERE:
                unmount_chroot(root)


_MOUNTED_HERE: set[str] = set()  # suites whose chroot this session mounted


def own_cluster(
    prefix: str,
    ports: dict[str, str],
    what: str,
    *,
    accounting: bool = False,
    whole_nodes: int = 1,
    topology: str | None = None,
) -> Iterator[SlurmTestCluster]:
    """A host Slurm test cluster of a test module's own (a fixture's body): its own ``ports``
    and files, for tests that drain nodes or rewrite its config; started fresh, stopped and
    deleted after (kept with GPUSH_KEEP_SLURM_STATE=1, to read its logs). ``accounting``:
    with slurmdbd; ``whole_nodes``: its nodes of two whole A100s (two for multi-node jobs);
    ``topology``: ``tree`` or ``block``, a topology.conf and the NVLink node nvl01 (start.sh)."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        cluster = start(state, fresh=True, env=ports, accounting=accounting, whole_nodes=whole_nodes, topology=topology)
    except SlurmClusterError as exc:
        pytest.fail(f"the Slurm test cluster {what} did not start in {state}:\n{exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop(purge=not os.environ.get("GPUSH_KEEP_SLURM_STATE"))


def chroot_cluster(
    chroots: dict[str, Path],
    suite: str,
    *,
    accounting: bool,
    whole_nodes: int = 1,
    topology: str | None = None,
    ports: dict[str, str] | None = None,
) -> Iterator[SlurmTestCluster]:
    """A test cluster on ``suite``'s Slurm (a fixture's body): started fresh, stopped after.
    ``whole_nodes``: its nodes of two whole A100s (two for multi-node jobs); ``topology`` as
    :func:`own_cluster`'s; ``ports``: other than the suite's own (SUITE_PORTS)."""
    if suite not in SUITE_PORTS:
        pytest.fail(f"no ports set for Debian suite {suite!r} (integration/slurm_fixtures.py SUITE_PORTS)")
    for user in SITE_USERS:
        ensure_unix_user(user)
    try:
        if suite not in chroots:
            chroots[suite], mounted = chroot_of(suite, users=SITE_USERS)
            if mounted:
                _MOUNTED_HERE.add(suite)
        state = Path(tempfile.mkdtemp(prefix=f"gpush-slurm-{suite}-", dir="/tmp"))
        state.chmod(0o755)
        cluster = start(
            state,
            fresh=True,
            env=ports or SUITE_PORTS[suite],
            accounting=accounting,
            chroot=chroots[suite],
            whole_nodes=whole_nodes,
            topology=topology,
        )
    except SlurmClusterError as exc:
        pytest.fail(f"the Slurm test cluster on Debian {suite}'s Slurm did not start:\n{exc}", pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop(purge=True)
