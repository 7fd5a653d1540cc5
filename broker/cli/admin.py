"""``gpush`` administration commands: API tokens (admin token) and tenants' fair-share
weights and quotas (tenant)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from broker.cli import console
from broker.cli.console import Output
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.errors import EXIT_OK

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


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
def token_create_command(settings: Settings, json_mode: bool, **fields: Any) -> int:
    """Create a token and print it (shown once)."""
    return token_create(settings.client(), output(json_mode), **fields)


def token_create(
    client: GpushClient,
    out: Output,
    *,
    user: str,
    tenant: str,
    role: str,
    description: str | None,
    nodes: str | None = None,
) -> int:
    patterns = [n.strip() for n in nodes.split(",") if n.strip()] if nodes is not None else None
    created = client.create_token(user=user, tenant=tenant, role=role, description=description, nodes=patterns)
    if out.json_mode:
        out.json(created)
    else:
        out.line(created.token)
        bound = f", nodes {', '.join(created.nodes)}" if created.nodes is not None else ""
        out.note(
            f"token {created.id} for {created.user} (tenant {created.tenant}, role {created.role.value}{bound}); "
            "it is shown only now: give it to its user, who sets GPUSH_TOKEN"
        )
    return EXIT_OK


@token.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def token_list_command(settings: Settings, json_mode: bool) -> int:
    """List tokens (their prefixes; secrets are never stored)."""
    return token_list(settings.client(), output(json_mode))


def token_list(client: GpushClient, out: Output) -> int:
    tokens = client.list_tokens()
    if out.json_mode:
        out.json(tokens)
    else:
        out.print(console.tokens_table(tokens))
    return EXIT_OK


@token.command("revoke", context_settings=CONTEXT)
@click.argument("token_ids", type=int, nargs=-1, required=True)
@json_option
@click.pass_obj
def token_revoke_command(settings: Settings, token_ids: tuple[int, ...], json_mode: bool) -> int:
    """Revoke tokens by id (effective on every broker within 5 seconds)."""
    return token_revoke(settings.client(), output(json_mode), list(token_ids))


def token_revoke(client: GpushClient, out: Output, token_ids: list[int]) -> int:
    revoked = [client.revoke_token(token_id) for token_id in token_ids]
    if out.json_mode:
        out.json(revoked)
    else:
        for t in revoked:
            out.line(f"token {t.id} ({t.user}, tenant {t.tenant}) revoked")
    return EXIT_OK


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
def tenant_set_command(settings: Settings, name: str, weight, gpu_quota, clear_quota, json_mode) -> int:
    """Set tenant NAME's weight and quota (admins)."""
    return tenant_set(
        settings.client(), output(json_mode), name, weight=weight, gpu_quota=gpu_quota, clear_quota=clear_quota
    )


def tenant_set(client: GpushClient, out: Output, name: str, **fields: Any) -> int:
    row = client.set_tenant(name, **fields)
    if out.json_mode:
        out.json(row)
    else:
        quota = "no quota" if row["gpu_quota"] is None else f"quota {row['gpu_quota']:g} GPU"
        out.line(f"tenant {name}: weight {row['weight']:g}, {quota}")
    return EXIT_OK


@tenant.command("list", context_settings=CONTEXT)
@json_option
@click.pass_obj
def tenant_list_command(settings: Settings, json_mode: bool) -> int:
    """Tenants with weight, quota and GPU-equivalents in use."""
    return tenant_list(settings.client(), output(json_mode))


def tenant_list(client: GpushClient, out: Output) -> int:
    rows = client.list_tenants()
    if out.json_mode:
        out.json(rows)
    else:
        out.print(console.tenants_table(rows))
    return EXIT_OK


@tenant.command("quota-yaml", context_settings=CONTEXT)
@click.argument("cluster")
@json_option
@click.pass_obj
def tenant_quota_yaml_command(settings: Settings, cluster: str, json_mode: bool) -> int:
    """The ResourceQuotas of Kubernetes cluster CLUSTER's tenants, as YAML (admins).

    \b
    With namespace_mode=per-tenant each tenant's jobs run in a namespace of its own, and its
    quota becomes a ResourceQuota there: per GPU resource the cluster offers, the largest
    count that alone stays within the quota. The broker's ledger holds each tenant to its
    combined budget; the ResourceQuota is the cluster-side backstop. The scheduler applies
    them itself; `kubectl apply -f -` takes what this prints, for a broker that may not.
    """
    return tenant_quota_yaml(settings.client(), output(json_mode), cluster)


def tenant_quota_yaml(client: GpushClient, out: Output, cluster: str) -> int:
    """The cluster's ResourceQuotas for the tenants' GPU quotas, as YAML kubectl applies."""
    result = client.tenant_quotas(cluster)
    if out.json_mode:
        out.json(result)
    else:
        out.raw(result["rendered"])
    return EXIT_OK


# Registered on the root group by broker.cli.main.
COMMANDS = (admin, tenant)
