"""What each ``gpush`` command does, free of the argument parser.

Each function takes a client (or a database URL), plain arguments and an
:class:`~broker.cli.console.Output`, and returns the exit code. The click commands
(``broker.cli.main`` and the command-group modules beside it) only parse arguments and
call these; tests and other front ends call them directly.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from broker.cli import console
from broker.cli.console import Output
from broker.core.errors import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    Conflict,
    GpushError,
    InvalidRequest,
    NotFound,
    Unavailable,
)

if TYPE_CHECKING:  # imported where used: `gpush --help` need not load pydantic models
    from broker.client.sdk import GpushClient

ClientFactory = Callable[[], "GpushClient"]


def submit(client: GpushClient, out: Output, *, file: str | None, file_text: str | None, fields: dict[str, Any]) -> int:
    """Submit the job(s) of ``file`` (if any) with ``fields`` laid over them; print the ids."""
    from broker.intake.jobfile import build_specs, load_documents

    docs = load_documents(file_text, source=file or "-") if file_text is not None else None
    specs = build_specs(docs, fields, source=file or "")
    if len(specs) == 1:
        job = client.submit(specs[0])
        if out.json_mode:
            out.json(job)
        else:
            out.line(str(job.id))
        return EXIT_OK
    result = client.submit_batch(specs)
    if out.json_mode:
        out.json(result)
    else:
        for item in result["jobs"]:
            out.line(str(item["id"]))
    return EXIT_OK


def submit_ray_job(out: Output, address: str, command: list[str], *, submission_id: str | None = None) -> int:
    """Run ``command`` as a Ray job on the Ray cluster at ``address`` and follow it to its end."""
    import shlex

    from broker.ray.jobs import run_ray_job

    if not command:
        raise InvalidRequest("gpush submit --ray needs the job's entrypoint after --, such as -- python app.py")
    lines: list[str] = []
    try:
        status = run_ray_job(
            address,
            shlex.join(command),
            submission_id=submission_id,
            write=lines.append if out.json_mode else out.line,
        )
    except (RuntimeError, ConnectionError) as exc:  # Ray missing, or its job server unreachable
        raise Unavailable(
            f"{str(exc).rstrip('.')}: is the Ray head's dashboard at {address}? Check --ray / GPUSH_RAY_ADDRESS"
        ) from None
    if out.json_mode:
        out.json({"status": status, "logs": "\n".join(lines)})
    else:
        out.note(f"Ray job {status.lower()}")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_ERROR


def status(client: GpushClient, out: Output, job_id: int, *, watch: float | None = None) -> int:
    """A job's page: spec, state, reason, where it runs, its output's place, its latest
    events; ``watch``: redrawn when it changes, until the job ends (or Ctrl-C)."""
    from rich.console import Group

    job = client.get(job_id)
    if out.json_mode and watch is None:
        out.json(job)
        return EXIT_OK
    latest = [job]

    def view() -> Any:
        job = latest[0] = client.get(job_id)
        parts: list[Any] = [console.job_detail(job, output=_output_location(client, job))]
        events = client.events(job_id)
        if events:
            parts += ["", console.events_table(events[-5:])]
        return Group(*parts)

    if watch is not None:
        return _watch(out, view, watch, done=lambda: latest[0].state.value in console.FINAL_STATES)
    out.print(view())
    return EXIT_OK


def logs(
    client: GpushClient,
    out: Output,
    job_id: int,
    *,
    follow: bool = False,
    tail: int | None = None,
    replica: int | None = None,
    stream: str = "stdout",
    interval: float = 0.5,
) -> int:
    """Print a job's output (its last ``tail`` lines); with ``follow``, keep printing what
    it adds until it ends (waiting for it to start first)."""
    import time

    def read(offset: int, last: int | None) -> dict[str, Any] | None:
        try:
            return client.logs(job_id, stream=stream, replica=replica, offset=offset, tail=last)
        except Conflict:
            if not follow:
                raise
            return None  # not started yet: -f waits for it

    answer = read(0, tail)
    if out.json_mode:
        if answer is None:
            answer = client.logs(job_id, stream=stream, replica=replica, tail=tail)
        out.json(answer)
        return EXIT_OK if answer["readable"] else EXIT_ERROR
    waiting_said = False
    while answer is None:  # -f on a job that has not started
        if not waiting_said:
            out.note(f"job {job_id} has not started yet: waiting for its output (Ctrl-C stops waiting)")
            waiting_said = True
        time.sleep(interval)
        answer = read(0, tail)
    if not answer["readable"]:
        out.note(f"[yellow]gpush cannot read job {job_id}'s output from here:[/] {answer.get('note') or ''}")
        out.line(answer["location"])
        return EXIT_ERROR
    out.raw(answer["text"])
    offset = answer["next_offset"]
    if tail is None:  # everything: read on while chunks come
        while answer["text"]:
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            out.raw(answer["text"])
            offset = answer["next_offset"]
    while follow and not answer["final"]:
        time.sleep(interval)
        answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
        out.raw(answer["text"])
        offset = answer["next_offset"]
        while answer["text"] and not answer["final"]:  # a burst larger than one chunk
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            out.raw(answer["text"])
            offset = answer["next_offset"]
    if follow:  # the job ended: what it wrote last
        while True:
            answer = client.logs(job_id, stream=stream, replica=replica, offset=offset)
            if not answer["text"]:
                break
            out.raw(answer["text"])
            offset = answer["next_offset"]
        out.note(f"job {job_id} {answer['state']}")
    return EXIT_OK


def _output_location(client: GpushClient, job: Any) -> str:
    """Where a job's output is, for ``gpush status`` (a word on why when there is none)."""
    if not job.cluster:
        return "none yet (it has not reached a cluster)"
    try:
        answer = client.logs(job.id, tail=0)
    except Conflict as exc:  # not started
        return f"none yet: {exc.message}"
    except GpushError:
        return "- (the cluster does not answer now)"
    hint = f"  (gpush logs {job.id})" if answer["readable"] else f"  ({answer.get('note') or 'not readable here'})"
    return answer["location"] + hint


def list_jobs(
    client: GpushClient,
    out: Output,
    *,
    states: list[str],
    tenant: str | None,
    user: str | None,
    kind: str | None,
    limit: int,
    cursor: str | None,
    all_pages: bool,
    labels: dict[str, str] | None = None,
    finished: bool = False,
    me: bool = False,
    watch: float | None = None,
) -> int:
    """Jobs, newest first: the active ones unless ``finished`` or ``states`` say otherwise
    (as squeue shows); ``me``: the caller's own; ``watch``: redraw every so many seconds
    when something changed, until Ctrl-C."""
    if me:
        user = client.whoami().user
    if not states and not finished:
        states = list(console.ACTIVE_STATES)
    filters = {"states": states, "tenant": tenant, "user": user, "kind": kind, "labels": labels}

    def page() -> tuple[list[Any], str | None]:
        if all_pages:
            return list(client.iter_jobs(limit=min(max(limit, 1), 1000), **filters)), None
        got = client.list(limit=limit, cursor=cursor, **filters)
        return got.jobs, got.next_cursor

    filtered = bool(filters_given(filters))
    if watch is not None:
        return _watch(out, lambda: _jobs_view(out, *page(), finished=finished, filtered=filtered, hints=True), watch)
    jobs, next_cursor = page()
    if out.json_mode:
        out.json({"jobs": jobs, "next_cursor": next_cursor})
        return EXIT_OK
    if out.fmt == "name":
        for job in jobs:
            out.line(str(job.id))
        return EXIT_OK
    if jobs:
        out.print(_jobs_view(out, jobs, next_cursor, finished=finished, filtered=filtered))
    else:
        out.note(_no_jobs(finished=finished, filtered=filtered))
    if next_cursor:
        out.note(f"more jobs: gpush list --cursor {next_cursor}  (or --all-pages)")
    return EXIT_OK


def filters_given(filters: dict[str, Any]) -> list[str]:
    return [k for k, v in filters.items() if v and k != "states"]


def _no_jobs(*, finished: bool, filtered: bool) -> str:
    if filtered:
        return "no jobs match"
    if not finished:
        return "no active jobs (`gpush list --all` adds finished ones; `gpush submit --help` adds one)"
    return "no jobs yet: `gpush submit --help` shows how to add one"


def _jobs_view(
    out: Output, jobs: list[Any], next_cursor: str | None, *, finished: bool, filtered: bool, hints: bool = False
) -> Any:
    """The table of ``jobs`` (a renderable); with ``hints`` (--watch), what the notes on
    stderr would say goes under it."""
    from rich.console import Group
    from rich.text import Text

    if not jobs:
        return Text(_no_jobs(finished=finished, filtered=filtered), style="dim")
    parts: list[Any] = [console.jobs_table(jobs, wide=out.wide, width=out.console.width)]
    if next_cursor and hints:
        parts.append(Text(f"and more: this view shows the first {len(jobs)}", style="dim"))
    return Group(*parts)


def _watch(out: Output, view: Callable[[], Any], interval: float, *, done: Callable[[], bool] | None = None) -> int:
    """Redraw ``view()`` when it changes, every ``interval`` seconds, until Ctrl-C (or
    until ``done()``): in place on a terminal (as ``watch``), one copy per change when piped."""
    import time

    from rich.live import Live

    if out.json_mode:
        raise InvalidRequest("--watch draws tables: leave out --json / -o json|yaml, or poll without --watch")
    last = None
    live = Live(console=out.console, auto_refresh=False, transient=False) if out.console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            shown = view()
            with out.console.capture() as captured:
                out.console.print(shown)
            text = captured.get()
            if text != last:
                stamp = time.strftime("%H:%M:%S")
                if live is not None:
                    from rich.console import Group
                    from rich.text import Text

                    live.update(Group(Text(f"every {interval:g}s, {stamp} (Ctrl-C stops)", style="dim"), shown))
                    live.refresh()
                else:
                    out.raw(f"--- {stamp}\n{text}")
                last = text
            if done is not None and done():
                return EXIT_OK
            time.sleep(interval)
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        if live is not None:
            live.stop()


def fleet_events(client: GpushClient, out: Output, *, limit: int, since: str | None, node: str | None) -> int:
    """The fleet's events: MIG change and node move steps, oldest first."""
    from broker.core.clock import utcnow

    items = client.fleet_events(limit=limit, since=console.parse_when(since, utcnow(), "--since"), node=node)
    if out.json_mode:
        out.json(items)
    elif not items:
        where = " ".join(filter(None, [f"of node {node}" if node else "", f"since {since}" if since else ""]))
        out.note(
            f"no MIG change or node move {where}".rstrip()
            if where
            else "no MIG change or node move yet: gpush mig apply changes MIG layouts, and a policy's "
            "lending pools move nodes"
        )
    else:
        out.print(console.fleet_events_table(items))
    return EXIT_OK


def events(client: GpushClient, out: Output, job_id: int) -> int:
    items = client.events(job_id)
    if out.json_mode:
        out.json(items)
    else:
        out.print(console.events_table(items))
    return EXIT_OK


def cancel(client: GpushClient, out: Output, job_ids: list[int]) -> int:
    """Cancel every job given; go on past one that is missing and exit 3 at the end."""
    results: list[dict[str, Any]] = []
    code = EXIT_OK
    for job_id in job_ids:
        try:
            result = client.cancel(job_id)
        except NotFound as exc:
            code = EXIT_NOT_FOUND
            results.append({"id": job_id, "outcome": "not_found", "error": exc.message})
            if not out.json_mode:
                # As every other error reads (broker.cli.main); the message is text, not markup.
                out.note(f"[red]gpush: error:[/] {escape(exc.message)}")
            continue
        job = result["job"]
        results.append({"id": job_id, "outcome": result["outcome"], "state": job.state.value})
        if not out.json_mode:
            out.line(_cancel_message(job_id, result["outcome"], job.state.value))
    if out.json_mode:
        out.json(results)
    return code


MAX_BULK_CANCEL = 10_000


def cancel_matching(
    client: GpushClient,
    out: Output,
    *,
    states: list[str],
    user: str | None,
    labels: dict[str, str] | None,
    mine: bool,
    confirm: Callable[[str], bool] | None,
) -> int:
    """Cancel every active job the filters select (the caller's own with ``mine``; a
    user's token sees only its tenant's jobs anyway). ``confirm(question)`` is asked first
    unless None (``--yes``); exit 1 when the answer is no."""
    if mine:
        user = client.whoami().user
    active = list(console.ACTIVE_STATES)
    wanted = [s for s in states if s in active] if states else active
    if states and not wanted:
        raise InvalidRequest(f"{', '.join(states)}: finished jobs cannot be cancelled; pick active states")
    jobs = []
    for job in client.iter_jobs(states=wanted, user=user, labels=labels, limit=1000):
        jobs.append(job)
        if len(jobs) > MAX_BULK_CANCEL:
            raise InvalidRequest(
                f"more than {MAX_BULK_CANCEL:,} jobs match: narrow the filters (--state, --label, --user)"
            )
    if not jobs:
        if out.json_mode:
            out.json([])
        else:
            out.note("no active job matches: nothing to cancel")
        return EXIT_OK
    if confirm is not None and not out.json_mode:
        shown = ", ".join(str(j.id) for j in jobs[:10]) + (f" and {len(jobs) - 10} more" if len(jobs) > 10 else "")
        counts: dict[str, int] = {}
        for job in jobs:
            counts[job.state.value] = counts.get(job.state.value, 0) + 1
        by_state = ", ".join(f"{n} {state}" for state, n in counts.items())
        if not confirm(f"cancel {len(jobs)} job(s) ({by_state}): {shown}?"):
            out.note("nothing cancelled")
            return EXIT_ERROR
    return cancel(client, out, [j.id for j in jobs])


def _cancel_message(job_id: int, outcome: str, state: str) -> str:
    return {
        "cancelled": f"job {job_id} cancelled",
        "cancel_requested": (
            f"job {job_id} is {state} on a cluster: cancel requested, it stops when the cluster confirms"
        ),
        "already_requested": f"job {job_id}: cancel already requested, waiting for the cluster",
        "already_finished": f"job {job_id} had already ended ({state}); nothing to cancel",
    }[outcome]


def whoami(client: GpushClient, out: Output) -> int:
    me = client.whoami()
    if out.json_mode:
        out.json(me)
    else:
        out.line(f"{me.user} (tenant {me.tenant}, role {me.role.value}) at {client.url}")
    return EXIT_OK


def dashboard(client: GpushClient, out: Output, *, open_browser: bool = False) -> int:
    from broker.client.sdk import EMBEDDED_URL

    me = client.whoami()  # the token works, or this says why
    if client.url == EMBEDDED_URL:
        raise InvalidRequest(
            "gpush talks to this database in-process, with no server to open in a browser: start one with "
            "`gpush server` (or pass --url of a running broker) and run `gpush dashboard` again"
        )
    address = client.url + "/"
    link = f"{address}#token={client.token}" if client.token else address
    if out.json_mode:
        out.json({"address": address, "login_link": link, "user": me.user, "tenant": me.tenant, "role": me.role})
    else:
        out.line(f"dashboard: {address}")
        out.line(f"sign in:   {link}")
        out.line(f"           (as {me.user}, tenant {me.tenant}, role {me.role.value}; the link holds your token)")
    if open_browser:
        import webbrowser

        webbrowser.open(link)
    return EXIT_OK


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


def token_list(client: GpushClient, out: Output) -> int:
    tokens = client.list_tokens()
    if out.json_mode:
        out.json(tokens)
    else:
        out.print(console.tokens_table(tokens))
    return EXIT_OK


def token_revoke(client: GpushClient, out: Output, token_ids: list[int]) -> int:
    revoked = [client.revoke_token(token_id) for token_id in token_ids]
    if out.json_mode:
        out.json(revoked)
    else:
        for t in revoked:
            out.line(f"token {t.id} ({t.user}, tenant {t.tenant}) revoked")
    return EXIT_OK


def db_upgrade(database_url: str, out: Output) -> int:
    from broker.core.db import current_revision, head_revision, make_engine, upgrade

    engine = make_engine(database_url)
    before = current_revision(engine)
    upgrade(engine)
    after = current_revision(engine)
    shown = engine.url.render_as_string(hide_password=True)
    if out.json_mode:
        out.json({"database": shown, "from": before, "to": after, "head": head_revision()})
    elif before == after:
        out.line(f"{shown}: already at {after} (head)")
    else:
        out.line(f"{shown}: upgraded from {before or 'empty'} to {after}")
    return EXIT_OK


def db_current(database_url: str, out: Output) -> int:
    from sqlalchemy.engine import make_url

    from broker.core.db import current_revision, head_revision, make_engine

    parsed = make_url(database_url)
    if parsed.get_backend_name() == "sqlite" and parsed.database and not Path(parsed.database).exists():
        # Reading the version of a database that does not exist must not create it.
        current, head, shown = None, head_revision(), database_url
        if out.json_mode:
            out.json({"database": shown, "current": None, "head": head, "up_to_date": False})
        else:
            out.line(f"{shown}: does not exist yet; the first gpush command creates it")
        return EXIT_OK
    engine = make_engine(database_url)
    current, head = current_revision(engine), head_revision()
    shown = engine.url.render_as_string(hide_password=True)
    if out.json_mode:
        out.json({"database": shown, "current": current, "head": head, "up_to_date": current == head})
    else:
        state = "up to date" if current == head else "behind: run `gpush db upgrade`"
        out.line(f"{shown}: at {current or 'empty'}, head is {head} ({state})")
    return EXIT_OK


def cluster_add(
    client: GpushClient, out: Output, *, name: str, kind: str, config: dict[str, Any], replace: bool
) -> int:
    summary = client.add_cluster(name, kind, config, replace=replace)
    if out.json_mode:
        out.json(summary)
    else:
        out.line(f"cluster {name} ({kind}) registered: {_capacity_line(summary)}")
    return EXIT_OK


def cluster_list(client: GpushClient, out: Output) -> int:
    summaries = client.list_clusters()
    if out.json_mode:
        out.json(summaries)
        return EXIT_OK
    if out.fmt == "name":
        for c in summaries:
            out.line(c["name"])
        return EXIT_OK
    if not summaries:
        out.note("no clusters: an admin adds one with `gpush cluster add NAME --kind sim|slurm|k8s ...`")
        return EXIT_OK
    out.print(console.clusters_table(summaries, width=out.console.width))
    return EXIT_OK


def _capacity_line(summary: dict[str, Any]) -> str:
    health = summary["health"]
    state = "healthy" if health["ok"] else f"UNHEALTHY ({health['detail']})"
    return f"{state}, {summary['nodes']} nodes, {summary['gpu_free']:.1f} of {summary['gpu_total']:.1f} GPUs free"


def tenant_set(client: GpushClient, out: Output, name: str, **fields: Any) -> int:
    row = client.set_tenant(name, **fields)
    if out.json_mode:
        out.json(row)
    else:
        quota = "no quota" if row["gpu_quota"] is None else f"quota {row['gpu_quota']:g} GPU"
        out.line(f"tenant {name}: weight {row['weight']:g}, {quota}")
    return EXIT_OK


def usage(
    client: GpushClient,
    out: Output,
    *,
    since: str | None,
    until: str | None,
    by: str,
    tenant: str | None,
    csv_mode: bool = False,
) -> int:
    from broker.accounting.usage import to_csv
    from broker.core.clock import utcnow

    now = utcnow()
    answer = client.usage(
        since=console.parse_when(since, now, "--since"),
        until=console.parse_when(until, now, "--until"),
        by=by,
        tenant=tenant,
    )
    groups = answer["by"]
    if out.json_mode:
        out.json(answer)
    elif csv_mode:
        out.raw(to_csv(answer["rows"], groups))
    else:
        out.line(console.usage_window(answer))
        out.print(console.usage_table(answer))
    return EXIT_OK


def tenant_list(client: GpushClient, out: Output) -> int:
    rows = client.list_tenants()
    if out.json_mode:
        out.json(rows)
    else:
        out.print(console.tenants_table(rows))
    return EXIT_OK


def tenant_quota_yaml(client: GpushClient, out: Output, cluster: str) -> int:
    """The cluster's ResourceQuotas for the tenants' GPU quotas, as YAML kubectl applies."""
    result = client.tenant_quotas(cluster)
    if out.json_mode:
        out.json(result)
    else:
        out.raw(result["rendered"])
    return EXIT_OK


def policy_validate(client: GpushClient, out: Output, *, text: str, source: str) -> int:
    report = client.validate_policy(text, source=source)
    if out.json_mode:
        out.json(report)
    else:
        out.line(report["describe"])
    return EXIT_OK if report["ok"] else EXIT_USAGE


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


def policy_history(client: GpushClient, out: Output) -> int:
    rows = client.policy_history()
    if out.json_mode:
        out.json(rows)
    elif not rows:
        out.note("no policy applied yet: `gpush policy apply policies/default.yaml -m 'first policy'`")
    else:
        out.print(console.policy_history_table(rows))
    return EXIT_OK


def policy_diff(client: GpushClient, out: Output, a: int, b: int) -> int:
    text = client.policy_diff(a, b)
    if out.json_mode:
        out.json({"a": a, "b": b, "diff": text})
    else:
        out.stdout.write(text)
    return EXIT_OK


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


def scheduler_run(
    database_url: str, out: Output, *, cycles: int | None, interval: float, metrics_port: int | None = None
) -> int:
    """Run cycles in this process while it leads; report each cycle that did something."""
    import time

    from broker.client.embedded import open_database
    from broker.core.clock import utcnow
    from broker.core.clusters import AdapterPool
    from broker.core.errors import Conflict
    from broker.scheduling.cycle import Scheduler
    from broker.scheduling.leader import Leadership

    engine = open_database(database_url)
    leadership = Leadership(engine)
    if not leadership.try_acquire():
        raise Conflict("another broker process is the scheduler now: this one would only wait (stop it, or let it be)")
    scheduler = Scheduler(engine, AdapterPool(utcnow), clock=utcnow)
    if metrics_port is not None:
        from broker.core.metrics import serve

        serve(engine, metrics_port)
        out.note(f"metrics on http://127.0.0.1:{metrics_port}/metrics")
    done = 0
    try:
        while cycles is None or done < cycles:
            if done:
                time.sleep(interval)
            if not leadership.still_held():
                raise Conflict("lost scheduler leadership (the database connection broke)")
            report = scheduler.run_cycle()
            done += 1
            if out.json_mode:
                out.json({"cycle": done, **report.__dict__})
            elif any((report.placed, report.held, report.synced, report.recovered, report.failed, report.errors)):
                out.line(
                    f"cycle {done}: placed {report.placed}, held {report.held}, waiting {report.waiting}, "
                    f"status changes {report.synced}, recovered {report.recovered}, failed {report.failed}"
                )
                for error in report.errors:
                    out.note(f"[yellow]warning:[/] {error}")
    finally:
        leadership.release()
    return EXIT_OK


def simulate(
    out: Output,
    *,
    fleet: str | None,
    workload: str | None,
    trace: str | None,
    policy: str | None,
    compare: str | None,
    report: str,
    seed: int,
    placement: str,
    preemption: bool = False,
    layouts: bool = False,
) -> int:
    """Replay a workload or a trace in virtual time and write the report (no broker needed).
    A run longer than a couple of seconds shows its progress on stderr (stdout keeps the
    summary, or only the JSON)."""
    from broker.simulation.progress import Progress
    from broker.simulation.report import run_simulation, summary_lines

    if layouts:
        return _simulate_layouts(out, fleet=fleet, workload=workload, policy=policy, report=report)

    with Progress(out.stderr) as progress:
        result = run_simulation(
            fleet,
            workload,
            trace,
            policy,
            compare,
            report,
            seed,
            placement=placement,
            progress=progress,
            preemption=preemption,
        )
    if out.json_mode:
        out.json(result)
        return EXIT_OK
    for line in summary_lines(result):
        out.line(line)
    out.line(f"report: {Path(report) / 'report.md'} (with results.json and PNG plots)")
    return EXIT_OK


def _simulate_layouts(out: Output, *, fleet: str, workload: str, policy: str, report: str) -> int:
    """``gpush simulate --layouts``: static layouts, dynamic MIG, and lending, compared."""
    from broker.simulation import layouts as layout_runs
    from broker.simulation.fleet import load_fleet_file
    from broker.simulation.progress import Progress
    from broker.simulation.report import load_policy_file
    from broker.simulation.workload import load_workload

    loaded = load_workload(workload)
    with Progress(out.stderr) as progress:

        def started(label: str):
            progress.step(f"replaying {label}", len(loaded.arrivals), "jobs")
            return progress.update

        runs = layout_runs.replay_layouts(
            load_fleet_file(fleet), load_policy_file(policy), loaded.arrivals, tenants=loaded.tenants, progress=started
        )
        inputs = {"fleet": fleet, "workload": workload, "policy": policy, "jobs": len(loaded.arrivals)}
        files = layout_runs.write_report(Path(report), runs, inputs)
    if out.json_mode:
        out.json({"runs": [r.summary() for r in runs], "verdict": layout_runs.verdict(runs), "files": files})
        return EXIT_OK
    for line in layout_runs.table(runs):
        out.line(line)
    out.line("")
    for line in textwrap.wrap(layout_runs.verdict(runs), 80):
        out.line(line)
    note = layout_runs.no_lending_note(runs)
    if note:
        out.note(f"note: {note}")
    out.line(f"report: {Path(report) / 'report.md'} (with results.json and PNG plots)")
    return EXIT_OK


def read_job_file(path: str, stdin_text: Callable[[], str], *, what: str = "job file") -> str:
    """The text of ``path`` (``-``: stdin); ``what`` names the file in errors (policy file, fleet file)."""
    if path == "-":
        return stdin_text()
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise InvalidRequest(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"cannot read {what} {path}: {exc}") from None


__all__ = ["GpushError"]


# -- inventory, drift, gres.conf, MIG plan -------------------------------------------------

SEVERITIES = ("critical", "warning", "info")


def inventory(client: GpushClient, out: Output, *, cluster: str | None, gpus: bool) -> int:
    """The reconciled inventory: per cluster and sharing mode, then per node (and GPU)."""
    view = client.inventory(cluster)
    if out.json_mode:
        out.json(view)
        return EXIT_OK
    if out.fmt == "name":
        for c in view["clusters"]:
            for n in c["nodes"]:
                out.line(f"{c['name']}/{n['name']}")
        return EXIT_OK
    if not view["clusters"] and not view.get("unscheduled"):
        out.note("no clusters and no agent reports: add a cluster (gpush cluster add) or run `gpush agent` on a node")
        return EXIT_OK
    out.print(console.inventory_clusters_table(view, width=out.console.width))
    out.line("")
    out.print(console.inventory_nodes_table(view, gpus=gpus, width=out.console.width))
    counts = view.get("findings_by_severity", {})
    if any(counts.values()):
        summary = ", ".join(f"{counts[s]} {s}" for s in SEVERITIES if counts.get(s))
        out.note(f"drift: {summary}; `gpush inventory drift` says what is wrong and how to fix it")
    return EXIT_OK


def drift(client: GpushClient, out: Output, *, cluster: str | None, severity: str, fail_on: str | None) -> int:
    """Drift findings at ``severity`` or worse, worst first. With ``fail_on``, exit 1 when
    a finding of that severity or worse exists (for monitoring scripts)."""
    keep = SEVERITIES[: SEVERITIES.index(severity) + 1]
    findings = [f for f in client.drift(cluster) if f["severity"] in keep]
    if out.json_mode:
        out.json(findings)
    elif not findings:
        out.note("no drift: the clusters and the GPUs agree" + ("" if severity == "info" else f" (at {severity})"))
    else:
        for i, finding in enumerate(findings):
            if i:
                out.line("")
            out.print(console.finding_text(finding))
    if fail_on is not None:
        worst = SEVERITIES[: SEVERITIES.index(fail_on) + 1]
        if any(f["severity"] in worst for f in findings):
            return EXIT_ERROR
    return EXIT_OK


def gres_conf(client: GpushClient, out: Output, *, node: str, style: str) -> int:
    """The gres.conf block and slurm.conf Gres= field matching what the node's agent sees."""
    conf = client.gres_conf(node, style)
    if out.json_mode:
        out.json(conf)
        return EXIT_OK
    out.line(f"# gres.conf for {node}, from what its agent sees (gpush slurm gres-conf {node})")
    out.line(conf["text"].rstrip("\n"))
    out.line("")
    out.line(f"# slurm.conf: on the NodeName={node} line")
    out.line(f"Gres={conf['gres']}")
    out.note(
        "then make Slurm read it: scontrol reconfigure from Slurm 23.11; on 22.05 restart slurmctld and the "
        "node's slurmd (a reconfigure keeps a node's old GRES counts there)"
    )
    return EXIT_OK


def mig_plan(
    client: GpushClient, out: Output, *, cluster: str | None, repartition_busy: bool, enable_mig: bool, show: str
) -> int:
    """MIG layouts per GPU for the waiting MIG work: the summary, mig-parted config, gres.conf."""
    plan = client.mig_plan(cluster, repartition_busy=repartition_busy, enable_mig=enable_mig)
    if out.json_mode:
        out.json(plan)
        return EXIT_OK
    if not plan["nodes"]:
        where = f"cluster {cluster}" if cluster else "any node"
        out.note(f"no agent reports GPUs of {where}: run `gpush agent` on the GPU nodes, then plan again")
        return EXIT_NOT_FOUND
    if show in ("all", "summary"):
        for line in plan["summary"]:
            out.line(line)
        if plan["missing_agents"]:
            out.note(f"not planned (no agent reports them): {', '.join(plan['missing_agents'])}")
    if show in ("all", "mig-parted"):
        if show == "all":
            out.line("")
        out.line(plan["mig_parted"].rstrip("\n"))
    if show in ("all", "gres"):
        changed = {g["node"] for g in plan["gpus"] if g["action"] != "keep"}
        for node, text in plan["gres_conf"].items():
            if text and node in changed:
                out.line("")
                out.line(f"# gres.conf for {node} after the plan")
                out.line(text.rstrip("\n"))
    return EXIT_OK


def mig_apply(
    client: GpushClient,
    out: Output,
    *,
    cluster: str | None,
    node: str | None,
    dry_run: bool,
    repartition_busy: bool,
) -> int:
    """The plan's MIG changes, recorded (or, with ``dry_run``, only shown)."""
    result = client.mig_apply(cluster=cluster, node=node, dry_run=dry_run, repartition_busy=repartition_busy)
    if out.json_mode:
        out.json(result)
        return EXIT_OK
    gpus = result["gpus"]
    if not gpus:
        if not result.get("nodes"):
            missing = ", ".join(result.get("missing_agents") or []) or "none"
            out.note(
                "nothing to change: no node agent reports a GPU here, so gpush does not know the GPUs "
                f"(nodes without an agent: {missing}); run `gpush agent` on the nodes"
            )
        else:
            out.note("nothing to change: the MIG layouts serve the waiting work as well as any (gpush mig plan)")
        return EXIT_OK
    for g in gpus:
        layouts = f"{_layout(g['today'])} -> {_layout(g['planned'])}"
        if g["refused"]:
            out.line(f"{g['node']} GPU {g['gpu']}: not changed: {g['refused']}")
        elif dry_run:
            out.line(f"{g['node']} GPU {g['gpu']} ({g['cluster']}): would change {layouts}")
        else:
            out.line(f"{g['node']} GPU {g['gpu']} ({g['cluster']}): change {g['change']}: {layouts}")
    started = [g for g in gpus if g["change"] is not None]
    if dry_run:
        out.note("dry run: nothing changed (run it again without --dry-run)")
    elif started:
        out.note("each node is fenced, emptied, re-cut and confirmed in turn: `gpush mig changes` follows them")
    return EXIT_OK if started or dry_run else EXIT_ERROR


def mig_changes(client: GpushClient, out: Output, *, change_id: int | None, show_all: bool, clear: bool = False) -> int:
    """The MIG changes under way, or one change with its steps (``clear``: a failed one cleared)."""
    if change_id is not None:
        change = client.mig_clear(change_id) if clear else client.mig_change(change_id)
        if out.json_mode:
            out.json(change)
            return EXIT_OK
        _print_change(out, change)
        _print_events(out, change["events"])
        return EXIT_OK
    changes = client.mig_changes(all=show_all)
    if out.json_mode:
        out.json(changes)
        return EXIT_OK
    if not changes:
        out.note("no MIG change yet" if show_all else "no MIG change under way (--all also lists those that ended)")
        return EXIT_OK
    for change in changes:
        _print_change(out, change)
        if change["events"]:
            last = change["events"][-1]
            for line in textwrap.wrap(
                f"last: {last['step']}: {last['note']}", 78, initial_indent="  ", subsequent_indent="    "
            ):
                out.line(line)
    return EXIT_OK


def lending_moves(client: GpushClient, out: Output, *, show_all: bool) -> int:
    """The node moves under way (or all), each with its steps."""
    moves = client.lending_moves(all=show_all)
    if out.json_mode:
        out.json(moves)
        return EXIT_OK
    if not moves:
        out.note("no node moved yet" if show_all else "no node is moving (--all also lists the moves that ended)")
        return EXIT_OK
    for move in moves:
        out.line(f"move {move['id']}  {move['node']}: {move['source']} -> {move['target']}  {move['step']}")
        for line in textwrap.wrap(move["reason"], 78, initial_indent="  ", subsequent_indent="    "):
            out.line(line)
        _print_events(out, move["events"])
    return EXIT_OK


def _print_events(out: Output, events: list[dict[str, Any]]) -> None:
    """A change's or a move's steps, one a line (wrapped at 80 columns under its note)."""
    for event in events:
        at = console.local_time(datetime.fromisoformat(event["at"]))
        head = f"  {at}  {event['step']:<11} "
        for line in textwrap.wrap(event["note"], 80, initial_indent=head, subsequent_indent=" " * len(head)):
            out.line(line)


def _layout(slots: list[str]) -> str:
    """A GPU's instances for people: ``7 x 1g.5gb`` for a run of four or more of a profile,
    each with its slot otherwise (``3g.20gb@0, 2g.10gb@4``); ``--json`` has every slot."""
    if not slots:
        return "no instance"
    runs: list[list[str]] = []
    for slot in slots:
        if runs and runs[-1][0].partition("@")[0] == slot.partition("@")[0]:
            runs[-1].append(slot)
        else:
            runs.append([slot])
    return ", ".join(f"{len(r)} x {r[0].partition('@')[0]}" if len(r) >= 4 else ", ".join(r) for r in runs)


def _print_change(out: Output, change: dict[str, Any]) -> None:
    layouts = f"{_layout(change['from'])} -> {_layout(change['to'])}"
    back = " (rolling back)" if change["rolling_back"] and not change["ended_at"] else ""
    out.line(f"change {change['id']}  {change['cluster']}/{change['node']} GPU {change['gpu']}  {change['step']}{back}")
    for line in textwrap.wrap(layouts, 78, initial_indent="  ", subsequent_indent="    "):
        out.line(line)
    if change["deadline"] and not change["ended_at"]:
        at = console.local_time(datetime.fromisoformat(change["deadline"]))
        then = "cancelled, nothing changed" if change["step"] == "emptying" else "rolls back"
        if change["rolling_back"]:
            then = "fails, its node stays fenced"
        out.line(f"  this step runs out at {at}: then the change {then}")


def agent(
    settings: Any,
    out: Output,
    *,
    node: str | None,
    interval: float,
    once: bool,
    recording: str | None,
    allow_mig_changes: bool = False,
) -> int:
    """``gpush agent``: report this node's GPUs to the broker until stopped (or once).

    With ``--url`` it posts to that broker with ``--token`` (an agent token); without, into
    the embedded broker's database (a one-machine setup, the demo, tests)."""
    import socket

    from broker.nodeagent.agent import run_agent
    from broker.nodeagent.nvml import RecordedLibrary

    node = node or socket.gethostname().split(".")[0]
    if recording and allow_mig_changes:
        raise InvalidRequest(
            "--allow-mig-changes needs real GPUs: a recording replays what NVML said and cannot change them; "
            "leave out --allow-mig-changes to replay it, or run the agent on the node without --recording"
        )
    library = RecordedLibrary(Path(recording)) if recording else None
    if settings.url:
        if not settings.token:
            raise InvalidRequest(
                "gpush agent needs a token to report to the broker: an admin creates one with "
                "`gpush admin token create --role agent --user <node> --tenant agents --nodes <node>`; "
                "set it as GPUSH_TOKEN"
            )
        delivered = run_agent(
            settings.url, settings.token, node, interval, library, once, allow_mig_changes=allow_mig_changes
        )
    else:
        client = settings.client()
        delivered = run_agent(
            client.url,
            client.token,
            node,
            interval,
            library,
            once,
            client=client.http,
            allow_mig_changes=allow_mig_changes,
        )
    if once:
        if not delivered:
            out.note(f"node {node}: the broker did not take the report (see the messages above)")
            return EXIT_ERROR
        out.note(f"node {node}: report taken by the broker")
    return EXIT_OK


def local_server_status(database: str, out: Output) -> int:
    """The local server of ``database``: running (pid, URL, log, uptime) or not (exit 1)."""
    from broker.client import local

    server = local.find(database)
    if out.json_mode:
        out.json({"running": server is not None, **(server.public() if server else {"database": database})})
    elif server is None:
        out.line(f"no local server for {database}: the next gpush command starts one (or: gpush server start)")
    else:
        shown = server.public()
        out.line(f"running: pid {server.pid} at {server.url}, up {_duration(shown['uptime_seconds'])}")
        out.line(f"database: {server.database}")
        out.line(f"log:      {server.log}  (gpush server logs -f)")
    return EXIT_OK if server is not None else EXIT_ERROR


def local_server_start(database: str, out: Output) -> int:
    from broker.client import local

    running = local.find(database)
    server = running or local.ensure(database)
    if out.json_mode:
        out.json({"started": running is None, **server.public()})
    else:
        verb = "already running" if running else "started"
        out.line(f"{verb}: pid {server.pid} at {server.url}, log {server.log}")
    return EXIT_OK


def local_server_stop(database: str, out: Output) -> int:
    from broker.client import local

    server = local.stop(database)
    if out.json_mode:
        out.json({"stopped": server is not None, "database": database, "pid": server.pid if server else None})
    elif server is None:
        out.line(f"no local server was running for {database}")
    else:
        out.line(f"stopped the local server (pid {server.pid}); queued jobs wait until the next command starts it")
    return EXIT_OK


def local_server_logs(database: str, out: Output, *, lines: int, follow: bool) -> int:
    import time

    from broker.client import local

    path = local.log_path(database)
    if not path.exists():
        raise NotFound(f"no local server log yet ({path}): the first gpush command that needs the broker starts one")
    out.raw(local.tail(path, lines))
    if follow:
        with open(path, "rb") as fh:
            fh.seek(0, 2)
            while True:  # until Ctrl-C
                chunk = fh.read(1 << 16)
                if chunk:
                    out.raw(chunk.decode(errors="replace"))
                else:
                    time.sleep(0.3)
    return EXIT_OK


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
