"""Whose job a Slurm job is: the Unix user it runs as and the account it is charged to.

A site's users own their Slurm jobs: the job's processes, its output files, its
accounting record and the account limits it counts against are theirs, not the
broker's. With ``run_as=owner`` the Slurm adapter takes the job's
:class:`broker.core.adapter.Owner` (the user and tenant of the token that submitted it,
never anything in the job spec) and maps it here:

- the gpush user to a Unix user: ``unix_users`` first (``alice=asmith``), else, with
  ``same_name_users`` (the default), the Unix user of the same name; otherwise the job is
  refused (:class:`Rejected`, saying how to map the user), never run as someone else;
- the tenant to a Slurm account (``tenant_accounts``), QOS (``tenant_qos``) and partition
  (``tenant_partitions``), each falling back to the cluster's ``account``/``qos``/
  ``partition``, and with none of them to the user's default account in Slurm.

How the job then runs as that user is the backend's part (adapters.slurm.client): REST
with a JWT for that user, minted with the site's ``jwt_key_file`` (:func:`mint_token`,
what ``scontrol token username=...`` gives), or the service token of root/SlurmUser
naming the user in ``X-SLURM-USER-NAME`` (proxy mode); the command line runs sbatch
through ``runuser`` (a broker running as root) or ``sudo -n -u``.

With ``run_as=service`` (the default, for a broker that owns its jobs, such as a
single-user test cluster) every job runs as the cluster's ``user`` / the broker's own
user, and only the account mapping applies.

The same answer tells gpush's jobs from impostors (adapters.slurm.context): any Slurm user
may name a job ``gpush-<id>``, but only a job that runs as a user gpush submits as
(:func:`runs_jobs_as`) can be gpush's.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from broker.core.adapter import Owner, Rejected, Unreachable

# What Slurm and the system take as a user name (useradd's NAME_REGEX, with dots and
# capitals as sites use them); anything else is refused rather than passed to runuser.
_UNIX_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")


@dataclass(frozen=True)
class SlurmIdentity:
    """What a job runs as: ``user`` None means the cluster's service identity."""

    user: str | None
    account: str | None
    qos: str | None
    partition: str | None


def resolve(
    owner: Owner | None,
    *,
    cluster: str,
    run_as: str,
    unix_users: dict[str, str],
    same_name_users: bool,
    tenant_accounts: dict[str, str],
    tenant_qos: dict[str, str],
    tenant_partitions: dict[str, str],
    account: str | None,
    qos: str | None,
    partition: str | None,
) -> SlurmIdentity:
    """``owner``'s Unix user (``run_as=owner``) and its tenant's account, QOS and partition."""
    tenant = owner.tenant if owner else None
    charged = SlurmIdentity(
        user=None,
        account=tenant_accounts.get(tenant, account) if tenant else account,
        qos=tenant_qos.get(tenant, qos) if tenant else qos,
        partition=tenant_partitions.get(tenant, partition) if tenant else partition,
    )
    if run_as != "owner":
        return charged
    if owner is None:
        raise Rejected(f"Slurm cluster {cluster} runs jobs as their owners (run_as=owner): this job has no owner")
    user = unix_users.get(owner.user)
    if user is None and same_name_users:
        user = owner.user
    if user is None:
        raise Rejected(
            f"gpush user {owner.user} has no Unix user on Slurm cluster {cluster}: an admin maps it "
            f"(gpush cluster add {cluster} ... --config unix_users={owner.user}=UNIXNAME); "
            "gpush never runs a job as someone else"
        )
    if not _UNIX_NAME.match(user) or user == "root":
        raise Rejected(
            f"gpush user {owner.user} maps to {user!r} on Slurm cluster {cluster}, which is not a user "
            "jobs may run as (a Unix name of letters, digits, '_', '.', '-', and never root)"
        )
    return SlurmIdentity(user, charged.account, charged.qos, charged.partition)


def runs_jobs_as(
    user: str, *, run_as: str, unix_users: dict[str, str], same_name_users: bool, service_user: str
) -> bool:
    """Whether gpush may have submitted a job that runs as Slurm user ``user``: the service
    user (``run_as=service``), or a user :func:`resolve` may map a gpush user to
    (``run_as=owner``: one of ``unix_users``, or with ``same_name_users`` any Unix name
    but root's)."""
    if not user:
        return False
    if run_as != "owner":
        return user == service_user
    if user in unix_users.values():
        return True
    return same_name_users and bool(_UNIX_NAME.match(user)) and user != "root"


def mint_token(key_file: str, user: str, lifetime: int) -> str:
    """A Slurm JWT for ``user`` signed with the site's HS256 key (``jwt_hs256.key``), as
    ``scontrol token username=USER lifespan=LIFETIME`` makes one: claims ``sun`` (the
    Slurm user name), ``iat`` and ``exp``."""
    import jwt  # PyJWT, only where a site lets the broker mint tokens

    try:
        key = Path(key_file).read_bytes()
    except OSError as exc:
        raise Unreachable(f"cannot read the Slurm JWT key {key_file}: {exc}") from None
    now = int(time.time())
    return jwt.encode({"sun": user, "iat": now, "exp": now + lifetime}, key, algorithm="HS256")


class TokenCache:
    """Minted tokens per user, renewed when less than a third of their life is left."""

    def __init__(self, key_file: str, lifetime: int):
        self.key_file = key_file
        self.lifetime = lifetime
        self._tokens: dict[str, tuple[float, str]] = {}

    def token(self, user: str) -> str:
        now = time.monotonic()
        held = self._tokens.get(user)
        if held is None or now > held[0]:
            token = mint_token(self.key_file, user, self.lifetime)
            self._tokens[user] = (now + self.lifetime * 2 / 3, token)
            return token
        return held[1]


# Slurm's words when an association check refuses a job, and what the site does about it.
_ASSOCIATION_REFUSALS = (
    ("Invalid account", "account"),
    ("Invalid qos", "qos"),
    ("Job's account not permitted to use this partition", "partition"),
    # Slurm 25.x and later, for a token naming a user the controller's machine lacks
    ("Rejecting authentication of user", "user"),
)


def explain_refusal(message: str, identity: SlurmIdentity, *, cluster: str, service_user: str) -> str:
    """Slurm's refusal of a submission, with what it means for this job's identity: an
    association that is missing is the site's to add (``sacctmgr``), and a user Slurm does
    not know at all may have no Unix account on the cluster."""
    user = identity.user or service_user
    for words, what in _ASSOCIATION_REFUSALS:
        if words.lower() not in message.lower():
            continue
        if what == "user":
            hint = (
                f"user {user} is not a Unix user Slurm knows on {cluster}: add {user} to the cluster's "
                "machines (or map this gpush user to one with unix_users)"
            )
        elif what == "qos":
            hint = (
                f"user {user} may not use QOS {identity.qos or '(the default)'} on {cluster}: an admin allows it "
                f"(sacctmgr modify user {user} set qos+={identity.qos or 'QOS'}) or maps the tenant to another "
                "(tenant_qos)"
            )
        else:
            account = identity.account or "(the user's default account)"
            hint = (
                f"user {user} has no Slurm association with account {account} on {cluster}"
                + (f" and partition {identity.partition}" if what == "partition" and identity.partition else "")
                + f": an admin adds one (sacctmgr add user {user} account={identity.account or 'ACCOUNT'})"
            )
            if identity.user:
                hint += f", and {user} must be a Unix user on the cluster's nodes"
        return f"{message}; {hint}"
    return message
