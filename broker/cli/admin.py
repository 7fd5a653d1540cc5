"""``gpush`` administration commands: API tokens (admin token) and tenants' fair-share
weights and quotas (tenant)."""

from __future__ import annotations

from typing import Any

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, Settings, json_option, output


@click.group(context_settings=CONTEXT)
def admin() -> None:
    """Administration (needs an admin token)."""


@admin.group(context_settings=CONTEXT)
def token() -> None:
    """API tokens: create, list, revoke."""


@token.command("create", context_settings=CONTEXT)
@click.option("--user", required=True, help="Who the token is for.")
@click.option("--tenant", required=True, help="The tenant whose jobs the token sees.")
@click.option(
    "--role",
    type=click.Choice(["user", "admin", "agent"]),
    default="user",
    show_default=True,
    help="agent: a node agent's token (gpush agent), which may only report its node's GPUs.",
)
@click.option(
    "--nodes",
    metavar="NAMES",
    help="Required with --role agent: the nodes the token may report for, comma-separated names or globs "
    "(gpu-01,gpu-*); '*' for any node.",
)
@click.option("--description", help="A note, such as what the token is for.")
@json_option
@click.pass_obj
def token_create(settings: Settings, json_mode: bool, **fields: Any) -> int:
    """Create a token and print it (shown once)."""
    return commands.token_create(settings.client(), output(json_mode), **fields)


@token.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def token_list(settings: Settings, json_mode: bool) -> int:
    """List tokens (their prefixes; secrets are never stored)."""
    return commands.token_list(settings.client(), output(json_mode))


@token.command("revoke", context_settings=CONTEXT)
@click.argument("token_ids", type=int, nargs=-1, required=True)
@json_option
@click.pass_obj
def token_revoke(settings: Settings, token_ids: tuple[int, ...], json_mode: bool) -> int:
    """Revoke tokens by id (effective on every broker within 5 seconds)."""
    return commands.token_revoke(settings.client(), output(json_mode), list(token_ids))


@click.group(context_settings=CONTEXT)
def tenant() -> None:
    """Tenants: fair-share weights and GPU quotas."""


@tenant.command("set", context_settings=CONTEXT)
@click.argument("name")
@click.option("--weight", type=float, help="Fair-share weight (default 1): shares under contention are proportional.")
@click.option("--gpu-quota", type=float, help="Most physical GPU-equivalents the tenant holds at once.")
@click.option("--no-quota", "clear_quota", is_flag=True, help="Remove the tenant's quota.")
@json_option
@click.pass_obj
def tenant_set(settings: Settings, name: str, weight, gpu_quota, clear_quota, json_mode) -> int:
    """Set tenant NAME's weight and quota (admins)."""
    return commands.tenant_set(
        settings.client(), output(json_mode), name, weight=weight, gpu_quota=gpu_quota, clear_quota=clear_quota
    )


@tenant.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def tenant_list(settings: Settings, json_mode: bool) -> int:
    """Tenants with weight, quota and GPU-equivalents in use."""
    return commands.tenant_list(settings.client(), output(json_mode))


@tenant.command("quota-yaml", context_settings=CONTEXT)
@click.argument("cluster")
@json_option
@click.pass_obj
def tenant_quota_yaml(settings: Settings, cluster: str, json_mode: bool) -> int:
    """The ResourceQuotas of Kubernetes cluster CLUSTER's tenants, as YAML (admins).

    \b
    With namespace_mode=per-tenant each tenant's jobs run in a namespace of its own, and its
    quota becomes a ResourceQuota there: per GPU resource the cluster offers, the largest
    count that alone stays within the quota. The broker's ledger holds each tenant to its
    combined budget; the ResourceQuota is the cluster-side backstop. The scheduler applies
    them itself; `kubectl apply -f -` takes what this prints, for a broker that may not.
    """
    return commands.tenant_quota_yaml(settings.client(), output(json_mode), cluster)


# Registered on the root group by broker.cli.main.
COMMANDS = (admin, tenant)
