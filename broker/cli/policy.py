"""``gpush policy``: the routing policy's commands (validate, apply, show, history, diff,
rollback, explain, schema)."""

from __future__ import annotations

import sys

import click

from broker.cli import commands
from broker.cli.settings import CONTEXT, Settings, json_option, output


@click.group(context_settings=CONTEXT)
def policy() -> None:
    """The routing policy: validate, apply, show, history, diff, rollback, explain, schema."""


def _policy_file(path: str) -> str:
    return commands.read_job_file(path, lambda: sys.stdin.read(), what="policy file")


@policy.command("validate", context_settings=CONTEXT)
@click.argument("file")
@json_option
@click.pass_obj
def policy_validate(settings: Settings, file: str, json_mode: bool) -> int:
    """Check FILE against the registered clusters (exit 2 if it would be refused)."""
    return commands.policy_validate(settings.client(), output(json_mode), text=_policy_file(file), source=file)


@policy.command("apply", context_settings=CONTEXT)
@click.argument("file")
@click.option("-m", "--message", "comment", required=True, help="Why: kept in the policy's history.")
@click.option("--base", type=int, help="The version you edited against (default: the active one, read now).")
@json_option
@click.pass_obj
def policy_apply(settings: Settings, file: str, comment: str, base: int | None, json_mode: bool) -> int:
    """Validate FILE and make it the active policy (admins). Refused: the active one stays."""
    return commands.policy_apply(
        settings.client(), output(json_mode), text=_policy_file(file), source=file, comment=comment, base=base
    )


@policy.command("show", context_settings=CONTEXT)
@click.option("--version", type=int, help="A stored version (default: the active one).")
@json_option
@click.pass_obj
def policy_show(settings: Settings, version: int | None, json_mode: bool) -> int:
    """Print the active policy (or a version) as YAML."""
    return commands.policy_show(settings.client(), output(json_mode), version=version)


@policy.command("history", context_settings=CONTEXT)
@json_option
@click.pass_obj
def policy_history(settings: Settings, json_mode: bool) -> int:
    """Every version: who, when, why; * marks the active one."""
    return commands.policy_history(settings.client(), output(json_mode))


@policy.command("diff", context_settings=CONTEXT)
@click.argument("a", type=int)
@click.argument("b", type=int)
@json_option
@click.pass_obj
def policy_diff(settings: Settings, a: int, b: int, json_mode: bool) -> int:
    """Unified diff from version A to version B."""
    return commands.policy_diff(settings.client(), output(json_mode), a, b)


@policy.command("rollback", context_settings=CONTEXT)
@click.argument("version", type=int)
@click.option("-m", "--message", "comment", default="", help="Why.")
@json_option
@click.pass_obj
def policy_rollback(settings: Settings, version: int, comment: str, json_mode: bool) -> int:
    """Make VERSION's text active again, as a new version (admins)."""
    return commands.policy_rollback(settings.client(), output(json_mode), version=version, comment=comment)


@policy.command("explain", context_settings=CONTEXT)
@click.argument("job_id", type=int, required=False)
@click.option(
    "-f",
    "--file",
    "file",
    metavar="FILE",
    help="Explain the job(s) of a job file instead of a queued job: each of its documents, in order.",
)
@click.option("--version", type=int, help="Against a stored version (default: the active one).")
@json_option
@click.pass_obj
def policy_explain(
    settings: Settings, job_id: int | None, file: str | None, version: int | None, json_mode: bool
) -> int:
    """Every rule tried for a job, in order, and why; then where it would be placed now.
    With -f, each job of the file in turn (--json: one result, or a list for several)."""
    from broker.intake.jobfile import build_specs, load_documents

    if (job_id is None) == (file is None):
        raise click.UsageError("give a JOB_ID or -f FILE")
    specs = None
    if file:
        text = commands.read_job_file(file, lambda: sys.stdin.read())
        specs = build_specs(load_documents(text, source=file), {}, source=file)
    return commands.policy_explain(
        settings.client(), output(json_mode), job_id=job_id, specs=specs, version=version, source=file
    )


@policy.command("schema", context_settings=CONTEXT)
@click.pass_obj
def policy_schema(settings: Settings) -> int:
    """Print the JSON Schema of policy files (for editor completion)."""
    import json

    from broker.routing.policy import policy_json_schema

    click.echo(json.dumps(policy_json_schema(), indent=2))
    return 0


# Registered on the root group by broker.cli.main.
COMMANDS = (policy,)
