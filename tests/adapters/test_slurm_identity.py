"""Jobs as their users on Slurm (adapters/slurm/identity.py): who a job runs as and the
account it is charged to come from its owner (the submitting token), never the spec;
each backend carries that identity to Slurm. The real thing runs in
integration/test_slurm_identity.py."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import httpx
import jwt
import pytest

from adapters.slurm.client import CliBackend, RestBackend
from adapters.slurm.identity import resolve
from broker.core.adapter import Owner, Rejected, Unreachable
from broker.core.errors import InvalidRequest
from tests.adapters.test_slurm_adapter import _workdir, adapter, mig, recorded_2205, spec

_workdir = _workdir  # autouse: jobs are submitted into the test's own directory

ALICE = Owner("alice", "vision")


def test_owner_runs_as_its_unix_user_and_is_charged_to_its_tenants_account():
    slurm = recorded_2205()
    a = adapter(slurm, run_as="owner", tenant_accounts="vision=cv,nlp=lang", tenant_qos="vision=high", qos="normal")
    a.submit(101, spec(), mig(), ALICE)
    a.submit(102, spec(), mig(), Owner("bob", "nlp"))
    a.submit(103, spec(), mig(), Owner("carol", "other"))
    alice, bob, carol = slurm.submitted
    assert (alice.user, alice.account, alice.qos) == ("alice", "cv", "high")
    assert (bob.user, bob.account, bob.qos) == ("bob", "lang", "normal")
    assert (carol.user, carol.account, carol.qos) == ("carol", None, "normal")  # the user's default account


def test_the_spec_cannot_choose_the_user():
    slurm = recorded_2205()
    a = adapter(slurm, run_as="owner")
    a.submit(101, spec(env={"USER": "bob", "SLURM_JOB_USER": "bob"}, user="bob", tenant="nlp"), mig(), ALICE)
    assert slurm.submitted[0].user == "alice"


def test_a_mapped_user_runs_as_the_mapped_name_and_an_unmapped_one_is_refused():
    slurm = recorded_2205()
    a = adapter(slurm, run_as="owner", unix_users="alice=asmith", same_name_users=False)
    a.submit(101, spec(), mig(), ALICE)
    assert slurm.submitted[0].user == "asmith"
    with pytest.raises(Rejected, match="gpush user bob has no Unix user on Slurm cluster slurm-a.*unix_users=bob="):
        a.submit(102, spec(), mig(), Owner("bob", "nlp"))
    assert len(slurm.submitted) == 1  # nothing ran as anyone else


@pytest.mark.parametrize("name", ["root", "-x", "a b", "x;rm", ""])
def test_a_user_that_is_no_unix_name_or_root_is_refused(name):
    with pytest.raises(Rejected, match="not a user jobs may run as"):
        resolve(
            Owner("u", "t"),
            cluster="c",
            run_as="owner",
            unix_users={"u": name},
            same_name_users=True,
            tenant_accounts={},
            tenant_qos={},
            tenant_partitions={},
            account=None,
            qos=None,
            partition=None,
        )


def test_a_job_without_owner_is_refused_where_jobs_run_as_owners():
    with pytest.raises(Rejected, match="has no owner"):
        adapter(recorded_2205(), run_as="owner").submit(101, spec(), mig())


def test_service_mode_runs_as_the_service_but_charges_the_tenant():
    slurm = recorded_2205()
    adapter(slurm, tenant_accounts="vision=cv").submit(101, spec(), mig(), ALICE)
    assert (slurm.submitted[0].user, slurm.submitted[0].account) == (None, "cv")


def test_settings_refuse_a_bad_mapping():
    with pytest.raises(InvalidRequest, match="unix_users is USER=UNIXNAME"):
        adapter(recorded_2205(), run_as="owner", unix_users="alice")
    with pytest.raises(InvalidRequest, match="run_as"):
        adapter(recorded_2205(), run_as="someone")


# -- the command line: runuser or sudo, under a prefix -------------------------------------


@pytest.fixture
def bin_dir(tmp_path) -> str:
    """A bin directory with sbatch and scancel in it (the machine running the unit tests
    may have no Slurm; subprocess.run is replaced, so they never run)."""
    for name in ("sbatch", "scancel"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    return str(tmp_path)


def cli_argv(monkeypatch, backend: CliBackend, job) -> list[str]:
    seen: list[list[str]] = []

    def run(argv, **kwargs: Any):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, "42\n", "")

    monkeypatch.setattr(subprocess, "run", run)
    assert backend.submit(job) == "42"
    return seen[0]


def rendered(user: str | None):
    from adapters.slurm.render import render

    return render(1, spec(), mig(), tag="gpush", gres_type="1g.5gb", user=user)


def test_sbatch_runs_through_runuser_as_the_user(monkeypatch, bin_dir):
    argv = cli_argv(monkeypatch, CliBackend(bin_dir=bin_dir, switch_user="runuser"), rendered("alice"))
    assert argv[:4] == ["runuser", "-u", "alice", "--"]
    sbatch = f"{bin_dir}/sbatch"
    assert argv[4] == "env" and sbatch in argv and argv.index(sbatch) > 4


def test_sbatch_runs_through_sudo_without_a_password(monkeypatch, bin_dir):
    argv = cli_argv(monkeypatch, CliBackend(bin_dir=bin_dir, switch_user="sudo"), rendered("bob"))
    assert argv[:5] == ["sudo", "-n", "-u", "bob", "--"]


def test_a_command_prefix_wraps_everything_and_looks_commands_up_there(monkeypatch):
    backend = CliBackend(command_prefix=["chroot", "/srv/slurm"], switch_user="runuser")
    argv = cli_argv(monkeypatch, backend, rendered("alice"))
    assert argv[:6] == ["chroot", "/srv/slurm", "runuser", "-u", "alice", "--"]
    assert "sbatch" in argv  # by name, inside the chroot
    assert cli_argv(monkeypatch, backend, rendered(None))[:3] == ["chroot", "/srv/slurm", "sbatch"]


def test_a_user_runuser_does_not_know_is_a_refusal_not_an_outage(monkeypatch, bin_dir):
    def run(argv, **kwargs: Any):
        return subprocess.CompletedProcess(argv, 1, "", "runuser: user carol does not exist or the user entry ...")

    monkeypatch.setattr(subprocess, "run", run)
    with pytest.raises(Rejected, match="cannot run sbatch as carol"):
        CliBackend(bin_dir=bin_dir, switch_user="runuser").submit(rendered("carol"))


# -- REST: a minted token, or the service token by proxy ------------------------------------


def rest(handler, **kwargs: Any) -> RestBackend:
    return RestBackend(
        url="http://slurm", user="root", token="service-token", api_version="v0.0.38",
        transport=httpx.MockTransport(handler), **kwargs,
    )  # fmt: skip


def test_rest_mints_a_token_for_the_user_with_the_sites_key(tmp_path):
    key = tmp_path / "jwt_hs256.key"
    key.write_bytes(b"k" * 32)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"job_id": 7, "errors": []})

    assert rest(handler, jwt_key_file=str(key)).submit(rendered("alice")) == "7"
    headers = seen[0].headers
    assert headers["X-SLURM-USER-NAME"] == "alice"
    claims = jwt.decode(headers["X-SLURM-USER-TOKEN"], b"k" * 32, algorithms=["HS256"])
    assert claims["sun"] == "alice" and claims["exp"] - claims["iat"] == 600
    assert "service-token" not in headers.values()


def test_rest_without_a_key_names_the_user_with_the_service_token(tmp_path):
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json={"job_id": 8})

    rest(handler).submit(rendered("bob"))
    assert (seen[0].headers["X-SLURM-USER-NAME"], seen[0].headers["X-SLURM-USER-TOKEN"]) == ("bob", "service-token")
    assert json.loads(seen[0].content)["job"]["name"] == "gpush-1"


def test_rest_refusing_a_user_is_a_refusal_while_the_service_is_accepted():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers["X-SLURM-USER-NAME"] == "root":
            return httpx.Response(200, json={"pings": [{"ping": "UP"}]})
        return httpx.Response(401, text="Authentication failure")

    with pytest.raises(Rejected, match="did not accept the token of root by proxy for user carol"):
        rest(handler).submit(rendered("carol"))

    def down(request: httpx.Request) -> httpx.Response:
        return httpx.Response(401, text="Authentication failure")

    with pytest.raises(Unreachable, match="renew it"):  # the service token itself: an outage
        rest(down).submit(rendered("carol"))


def test_a_missing_association_is_explained_with_what_the_site_does():
    from adapters.slurm.identity import SlurmIdentity, explain_refusal

    identity = SlurmIdentity(user="mallory", account="vision", qos=None, partition=None)
    text = explain_refusal(
        "Slurm refused the job: Invalid account or account/partition combination specified",
        identity,
        cluster="slurm-a",
        service_user="gpush",
    )
    assert text.startswith("Slurm refused the job: Invalid account")
    assert "user mallory has no Slurm association with account vision on slurm-a" in text
    assert "sacctmgr add user mallory account=vision" in text
    assert "mallory must be a Unix user" in text

    qos = SlurmIdentity(user=None, account=None, qos="high", partition=None)
    text = explain_refusal("Invalid qos specification", qos, cluster="slurm-a", service_user="gpush")
    assert "user gpush may not use QOS high" in text and "tenant_qos" in text
    assert explain_refusal("Requested node configuration is not available", qos, cluster="c", service_user="u") == (
        "Requested node configuration is not available"
    )


def test_a_user_the_controller_does_not_know_is_explained():
    from adapters.slurm.identity import SlurmIdentity, explain_refusal

    identity = SlurmIdentity(user="mallory", account="vision", qos=None, partition=None)
    text = explain_refusal(
        "Slurm refused the job: Rejecting authentication of user nobody or group nobody",  # Slurm 26.05
        identity,
        cluster="slurm-a",
        service_user="gpush",
    )
    assert "user mallory is not a Unix user Slurm knows on slurm-a" in text and "unix_users" in text
