"""Job statuses by watch: the status pages of the adapter protocol, and their cursor.

The cursor holds the resourceVersions of the Pod, Job and Deployment watches of this broker's
label (:func:`format_cursor`). :class:`StatusTracker` keeps the objects the server last sent per job
(adapters.k8s.states says what they mean), watches the three side by side for at most
``watch_seconds``, and reports the jobs whose state or reason moved; the first call of a process,
a cursor it did not hand out, and a 410 Gone re-list everything (and watch an old cursor once for
objects deleted meanwhile).
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adapters.k8s.client import Gone, WatchBatch
from adapters.k8s.context import KubeContext
from adapters.k8s.render import job_id_of, selector
from adapters.k8s.states import Observed, backend_job, condition
from broker.core.adapter import BackendJob, BackendState, Rejected, StatusPage

WATCHED = ("pods", "jobs", "deployments")
_CURSOR_VERSION = 1


def parse_cursor(cursor: str | None) -> dict[str, str] | None:
    """The resourceVersions a cursor holds, or None (no cursor, or not one of this adapter's)."""
    if not cursor:
        return None
    try:
        data = json.loads(cursor)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("k8s") != _CURSOR_VERSION:
        return None
    versions = {kind: str(data.get(kind) or "") for kind in WATCHED}
    return versions if all(versions.values()) else None


def format_cursor(versions: dict[str, str]) -> str:
    return json.dumps({"k8s": _CURSOR_VERSION, **{k: versions[k] for k in WATCHED}}, separators=(",", ":"))


class StatusTracker:
    """The watch state behind status pages (see the module docstring); one read at a time."""

    def __init__(self, ctx: KubeContext):
        self.ctx = ctx
        self._status_lock = threading.Lock()  # one status read at a time: it owns the watch state
        self._watchers = ThreadPoolExecutor(len(WATCHED), thread_name_prefix=f"k8s-watch-{ctx.name}")
        self._seen: dict[int, Observed] = {}
        self._versions: dict[str, str] | None = None  # what the last status page's cursor said
        self._reported: dict[int, tuple[BackendState, str | None]] = {}
        self._gone: set[int] = set()  # jobs whose object was deleted: their Pods' events are late news
        self._stopping: set[int] = set()  # gangs that lost a rank, whose objects this process deleted

    def statuses(self, cursor: str | None = None) -> StatusPage:
        with self._status_lock:
            asked = parse_cursor(cursor)
            if self._versions is None or asked != self._versions:
                changed = self._relist(since=asked)
                report_all = True
            else:
                try:
                    changed = self._watch()
                    report_all = False
                except Gone:
                    changed = self._relist(since=None)
                    report_all = True
            page = self._page(changed, report_all)
            return StatusPage(page, format_cursor(self._versions) if self._versions else cursor)

    def _observed(self, job_id: int) -> Observed:
        seen = self._seen.get(job_id)
        if seen is None:
            seen = self._seen[job_id] = Observed()
        return seen

    def _relist(self, since: dict[str, str] | None) -> set[int]:
        """Read this broker's objects afresh; returns every job id known (all are reported).
        With ``since`` (a cursor from before this process), objects deleted after it are
        looked for in a watch from there."""
        ctx = self.ctx
        wanted = selector(ctx.tag)
        listed: dict[str, list[dict[str, Any]]] = {}
        versions: dict[str, str] = {}
        for kind in WATCHED:
            listed[kind], versions[kind] = ctx.list_in(kind, ctx.scope, wanted)
        with ctx.lock:
            cancelled = set(ctx.cancelled)
        old = self._seen
        fresh: dict[int, Observed] = {}
        for kind in ("jobs", "deployments"):
            for obj in listed[kind]:
                job_id = job_id_of(obj, ctx.tag)
                if job_id is None:
                    continue
                seen = fresh.setdefault(job_id, Observed())
                setattr(seen, "job" if kind == "jobs" else "deployment", obj)
        for job_id, seen in fresh.items():
            seen.cancelled = job_id in cancelled
            if job_id in old:
                was = old[job_id]
                seen.started, seen.lost_rank, seen.lost_by_deletion = was.started, was.lost_rank, was.lost_by_deletion
                seen.pods = dict(old[job_id].pods)  # what changed since is told by note_pod
        for pod in listed["pods"]:
            job_id = job_id_of(pod, ctx.tag)
            if job_id in fresh:
                fresh[job_id].note_pod(pod)
        for seen in fresh.values():
            if seen.job is not None:
                seen.note_job(seen.job)
        listed_pods = {p["metadata"]["name"] for p in listed["pods"]}
        for seen in fresh.values():
            for name, pod in list(seen.pods.items()):
                if name not in listed_pods:  # deleted while the watch was away
                    seen.note_pod(pod, deleted=True)
        for seen in fresh.values():
            seen.note_started()
        changed = set(fresh)
        # Known to this process but gone from the cluster: deleted while the watch was away.
        for job_id, seen in old.items():
            if job_id not in fresh and not seen.deleted:
                seen.deleted, seen.cancelled = True, job_id in cancelled
                fresh[job_id] = seen
                changed.add(job_id)
        if since is not None:
            changed |= self._deleted_since(since, versions, fresh, cancelled)
        self._seen = fresh
        self._gone = {job_id for job_id, seen in fresh.items() if seen.deleted}
        self._versions = versions
        return changed

    def _deleted_since(
        self, since: dict[str, str], now: dict[str, str], fresh: dict[int, Observed], cancelled: set[int]
    ) -> set[int]:
        """Jobs whose object was deleted between an old cursor and the re-list (best effort:
        nothing when the server has compacted that history)."""
        ctx = self.ctx
        changed: set[int] = set()
        for kind in ("jobs", "deployments"):
            if since[kind] == now[kind]:
                continue
            try:
                batch = ctx.client.watch(
                    kind,
                    ctx.scope,
                    resource_version=since[kind],
                    label_selector=selector(ctx.tag),
                    seconds=ctx.settings.watch_seconds,
                )
            except (Gone, Rejected):
                continue
            for event in batch.events:
                job_id = job_id_of(event.object, ctx.tag)
                if event.type != "DELETED" or job_id is None or job_id in fresh:
                    continue
                seen = Observed(deleted=True, cancelled=job_id in cancelled)
                setattr(seen, "job" if kind == "jobs" else "deployment", event.object)
                status = event.object.get("status") or {}
                seen.started = bool(
                    status.get("succeeded")
                    or status.get("failed")
                    or status.get("ready")
                    or status.get("readyReplicas")
                )
                fresh[job_id] = seen
                changed.add(job_id)
        return changed

    def _watch(self) -> set[int]:
        """Events since the last page, from the three watches side by side."""
        ctx = self.ctx
        versions = dict(self._versions or {})
        futures = {kind: self._watchers.submit(self._watch_scoped, kind, versions[kind]) for kind in WATCHED}
        batches: dict[str, WatchBatch] = {}
        failure: BaseException | None = None
        for kind, future in futures.items():
            try:
                batches[kind] = future.result()
            except BaseException as exc:  # noqa: BLE001 - re-raised below, after the others finished
                failure = failure or exc
        if failure is not None:
            raise failure
        changed: set[int] = set()
        with ctx.lock:
            cancelled = set(ctx.cancelled)
        # Owners first, so a Pod event of a job created in this batch finds its Job.
        for kind in ("jobs", "deployments", "pods"):
            batch = batches[kind]
            for event in batch.events:
                job_id = job_id_of(event.object, ctx.tag)
                if job_id is None:
                    continue
                if kind == "pods":
                    if job_id in self._gone or job_id not in self._seen:
                        continue
                    seen = self._seen[job_id]
                    seen.cancelled = seen.cancelled or job_id in cancelled
                    seen.note_pod(event.object, deleted=event.type == "DELETED")
                else:
                    seen = self._observed(job_id)
                    attribute = "job" if kind == "jobs" else "deployment"
                    if event.type == "DELETED":
                        setattr(seen, attribute, event.object)
                        seen.deleted, seen.cancelled = True, job_id in cancelled
                        self._gone.add(job_id)
                    else:
                        if seen.deleted:  # submitted again (a lost job back from the queue)
                            seen = self._seen[job_id] = Observed()
                        if kind == "jobs":
                            seen.cancelled = seen.cancelled or job_id in cancelled
                            seen.note_job(event.object)
                        else:
                            seen.deployment = event.object
                        self._gone.discard(job_id)
                seen.note_started()
                changed.add(job_id)
            versions[kind] = batch.resource_version
        self._versions = versions
        return changed

    def _watch_scoped(self, kind: str, version: str) -> WatchBatch:
        ctx = self.ctx
        try:
            return ctx.client.watch(
                kind,
                ctx.scope,
                resource_version=version,
                label_selector=selector(ctx.tag),
                seconds=ctx.settings.watch_seconds,
            )
        except Rejected as exc:
            raise ctx.refused_everywhere(exc, kind, ctx.scope) from None

    def _page(self, changed: set[int], report_all: bool) -> list[BackendJob]:
        ctx = self.ctx
        out: list[BackendJob] = []
        for job_id in sorted(changed):
            seen = self._seen.get(job_id)
            if seen is None or (seen.owner is None and not seen.deleted):
                continue
            if seen.lost_rank and not seen.deleted and job_id not in self._stopping:
                self._stop_gang(job_id, seen)
            backend = backend_job(job_id, ctx.backend_id(job_id, seen), seen, ctx.name)
            key = (backend.state, backend.reason)
            if report_all or self._reported.get(job_id) != key:
                out.append(backend)
            self._reported[job_id] = key
            if seen.deleted:
                # Reported once; later Pod events of it are ignored (``_gone``).
                self._seen.pop(job_id, None)
                self._reported.pop(job_id, None)
                self._stopping.discard(job_id)
                with ctx.lock:
                    ctx.cancelled.discard(job_id)
        return out

    def _stop_gang(self, job_id: int, seen: Observed) -> None:
        """A gang lost a rank: delete its Job, Pods and Service, never leaving the other ranks
        running without it; its Job's deletion is then reported LOST (adapters.k8s.states).
        Its Job is read again first: one that finished meanwhile (the ranks deleted by the Job
        controller once it failed or completed) lost nothing, unless a rank was disrupted."""
        ctx = self.ctx
        job = seen.job or {}
        fresh = ctx.client.get("jobs", ctx.namespace_of(job), job["metadata"]["name"]) if job else None
        if fresh is not None:
            seen.job = fresh
            if seen.lost_by_deletion and any(condition(fresh, k) for k in ("Complete", "Failed", "FailureTarget")):
                seen.lost_rank, seen.lost_by_deletion = None, False
                seen.note_job(fresh)  # unless the Job says a rank was disrupted
                if seen.lost_rank is None:
                    return
        self._stopping.add(job_id)
        ctx.delete_objects(job_id, grace=None)
