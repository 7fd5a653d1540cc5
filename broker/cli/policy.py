"""``gpush policy``: the routing policy's commands (validate, apply, show, history, diff,
rollback, explain, schema)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import click

from broker.cli import console
from broker.cli.console import Output
from broker.cli.input_files import read_job_file
from broker.cli.settings import CONTEXT, Settings, json_option, output
from broker.core.errors import EXIT_OK, EXIT_USAGE, NotFound

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient


@click.group(context_settings=CONTEXT)
def policy() -> None:
    """The routing policy: validate, apply, show, history, diff, rollback, explain, schema."""


def _policy_file(path: str) -> str:
    return read_job_file(path, lambda: sys.stdin.read(), what="policy file")


@policy.command("validate", context_settings=CONTEXT)
@click.argument("file")
@json_option
@click.pass_obj
def policy_validate_command(settings: Settings, file: str, json_mode: bool) -> int:
    """Check FILE against the registered clusters (exit 2 if it would be refused)."""
    return policy_validate(settings.client(), output(json_mode), text=_policy_file(file), source=file)


def policy_validate(client: GpushClient, out: Output, *, text: str, source: str) -> int:
    report = client.validate_policy(text, source=source)
    if out.json_mode:
        out.json(report)
    else:
        out.line(report["describe"])
    return EXIT_OK if report["ok"] else EXIT_USAGE


@policy.command("apply", context_settings=CONTEXT)
@click.argument("file")
@click.option("-m", "--message", "comment", required=True, help="Why: kept in the policy's history.")
@click.option("--base", type=int, help="The version you edited against (default: the active one, read now).")
@json_option
@click.pass_obj
def policy_apply_command(settings: Settings, file: str, comment: str, base: int | None, json_mode: bool) -> int:
    """Validate FILE and make it the active policy (admins). Refused: the active one stays."""
    return policy_apply(
        settings.client(), output(json_mode), text=_policy_file(file), source=file, comment=comment, base=base
    )


def policy_apply(client: GpushClient, out: Output, *, text: str, source: str, comment: str, base: int | None) -> int:
    if base is None:
        # Apply on top of the version active now: if another admin applies between this
        # read and our write, the broker refuses ours instead of silently replacing theirs.
        try:
            base = client.show_policy()["version"]
        except NotFound:
            base = None
    result = client.apply_policy(text, comment=comment, base_version=base, source=source)
    if out.json_mode:
        out.json(result)
        return EXIT_OK
    if result.get("changed", True):
        out.line(f"policy version {result['version']} is active ({comment})")
    else:
        # No new version was stored, so the comment given now is nowhere: say so.
        out.line(
            f"policy unchanged: {source} is the active version {result['version']} already; no new version was "
            f"stored, so the comment {comment!r} was not recorded (version {result['version']} keeps "
            f"{result['comment']!r})"
        )
    for warning in result["warnings"]:
        out.note(f"[yellow]warning:[/] {warning['message']}")
    return EXIT_OK


@policy.command("show", context_settings=CONTEXT)
@click.option("--version", type=int, help="A stored version (default: the active one).")
@json_option
@click.pass_obj
def policy_show_command(settings: Settings, version: int | None, json_mode: bool) -> int:
    """Print the active policy (or a version) as YAML."""
    return policy_show(settings.client(), output(json_mode), version=version)


def policy_show(client: GpushClient, out: Output, *, version: int | None) -> int:
    shown = client.show_policy(version)
    if out.json_mode:
        out.json(shown)
    else:
        state = "active" if shown["active"] else "not active"
        out.note(
            f"# version {shown['version']} ({state}) by {shown['author']} at {shown['created_at']}: {shown['comment']}"
        )
        out.stdout.write(shown["text"] if shown["text"].endswith("\n") else shown["text"] + "\n")
    return EXIT_OK


@policy.command("history", context_settings=CONTEXT)
@json_option
@click.pass_obj
def policy_history_command(settings: Settings, json_mode: bool) -> int:
    """Every version: who, when, why; * marks the active one."""
    return policy_history(settings.client(), output(json_mode))


def policy_history(client: GpushClient, out: Output) -> int:
    rows = client.policy_history()
    if out.json_mode:
        out.json(rows)
    elif not rows:
        out.note("no policy applied yet: `gpush policy apply policies/default.yaml -m 'first policy'`")
    else:
        out.print(console.policy_history_table(rows))
    return EXIT_OK


@policy.command("diff", context_settings=CONTEXT)
@click.argument("a", type=int)
@click.argument("b", type=int)
@json_option
@click.pass_obj
def policy_diff_command(settings: Settings, a: int, b: int, json_mode: bool) -> int:
    """Unified diff from version A to version B."""
    return policy_diff(settings.client(), output(json_mode), a, b)


def policy_diff(client: GpushClient, out: Output, a: int, b: int) -> int:
    text = client.policy_diff(a, b)
    if out.json_mode:
        out.json({"a": a, "b": b, "diff": text})
    else:
        out.stdout.write(text)
    return EXIT_OK


@policy.command("rollback", context_settings=CONTEXT)
@click.argument("version", type=int)
@click.option("-m", "--message", "comment", default="", help="Why.")
@json_option
@click.pass_obj
def policy_rollback_command(settings: Settings, version: int, comment: str, json_mode: bool) -> int:
    """Make VERSION's text active again, as a new version (admins)."""
    return policy_rollback(settings.client(), output(json_mode), version=version, comment=comment)


def policy_rollback(client: GpushClient, out: Output, *, version: int, comment: str) -> int:
    result = client.rollback_policy(version, comment=comment)
    if out.json_mode:
        out.json(result)
    elif result.get("changed", True):
        out.line(f"policy version {result['version']} is active: {result['comment']}")
    else:
        now = result["version"]
        active = f"version {version}" if now == version else f"version {version}'s text (as version {now})"
        unrecorded = f"; the comment {comment!r} was not recorded" if comment.strip() else ""
        out.line(f"policy unchanged: {active} is active already{unrecorded}")
    return EXIT_OK


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
def policy_explain_command(
    settings: Settings, job_id: int | None, file: str | None, version: int | None, json_mode: bool
) -> int:
    """Every rule tried for a job, in order, and why; then where it would be placed now.
    With -f, each job of the file in turn (--json: one result, or a list for several)."""
    from broker.intake.jobfile import build_specs, load_documents

    if (job_id is None) == (file is None):
        raise click.UsageError("give a JOB_ID or -f FILE")
    specs = None
    if file:
        text = read_job_file(file, lambda: sys.stdin.read())
        specs = build_specs(load_documents(text, source=file), {}, source=file)
    return policy_explain(
        settings.client(), output(json_mode), job_id=job_id, specs=specs, version=version, source=file
    )


def policy_explain(
    client: GpushClient,
    out: Output,
    *,
    job_id: int | None,
    specs: list[Any] | None,
    version: int | None,
    source: str | None = None,
) -> int:
    """Explain a queued job, or each job of a job file (``specs``, in the file's order):
    with several, each is headed by its place in the file, and ``--json`` prints a list."""
    if job_id is not None:
        results = [client.explain(job_id=job_id, version=version)]
    else:
        results = [client.explain(spec=spec, version=version) for spec in specs or []]
    if out.json_mode:
        out.json(results[0] if len(results) == 1 else results)
        return EXIT_OK
    for index, result in enumerate(results):
        if len(results) > 1:
            if index:
                out.line("")
            name = specs[index].name if specs else None
            out.line(f"== {source} job {index + 1} of {len(results)}" + (f" ({name})" if name else ""))
        _explain_lines(out, result)
    return EXIT_OK


def _explain_lines(out: Output, result: dict[str, Any]) -> None:
    out.line(f"policy version {result['policy_version']}")
    out.line(result["explain"])
    for step in result["placement"]:
        if step["fits"]:
            p = step["placement"]
            where = f" on node {p['node']}" if p.get("node") else ""
            profile = f" {p['mig_profile']}" if p.get("mig_profile") else ""
            out.line(
                f"placement: {step['route']}{profile}{where}: fits now ({p['gpu_equivalents']:.3g} GPU-equivalents)"
            )
        else:
            out.line(f"placement: {step['route']}: {step['reason']}")


@policy.command("schema", context_settings=CONTEXT)
@click.pass_obj
def policy_schema_command(settings: Settings) -> int:
    """Print the JSON Schema of policy files (for editor completion)."""
    import json

    from broker.routing.policy import policy_json_schema

    click.echo(json.dumps(policy_json_schema(), indent=2))
    return 0


# Registered on the root group by broker.cli.main.
COMMANDS = (policy,)
