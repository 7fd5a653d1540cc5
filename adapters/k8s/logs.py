"""A job's output on Kubernetes (LogReader): its Pods' logs, read through ``pods/log``.

Replica K is the K-th of the job's Pods (by completion index, then age). Kubernetes keeps stdout
and stderr as one log, so both streams answer it. A Pod that is gone took its log with it: the
answer says so (``readable`` False) and names the Pod; a Pod whose container has not started is
:class:`Rejected`. Offsets count characters; the API cannot start a log at an offset, so a read
takes the log from its start up to ``offset`` plus one chunk (bounded by ``limitBytes``), and a
``tail`` read counts the whole log (up to :data:`LOG_SCAN_BYTES`) to say where following it
continues.
"""

from __future__ import annotations

import codecs
from typing import Any

from adapters.k8s.client import NotFound
from adapters.k8s.context import KubeContext, parse_backend_id
from adapters.k8s.render import CONTAINER, job_id_of, object_name
from broker.core.adapter import MAX_LOG_CHUNK, AdapterError, JobOutput, Rejected

# The most of a log a ``tail`` read takes in to count where the log ends (``next_offset``); a
# longer log is tailed by the kubelet (``tailLines``) and its end is not known exactly.
LOG_SCAN_BYTES = 16 * MAX_LOG_CHUNK
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # Indexed Jobs' Pods carry it
BOTH_STREAMS = "Kubernetes keeps a container's stdout and stderr as one log: this is both, interleaved."


class JobLogs:
    """Jobs' output read from their Pods' logs (see the module docstring)."""

    def __init__(self, ctx: KubeContext):
        self.ctx = ctx

    def read(
        self, job_id: int, backend_id: str, stream: str, replica: int | None, offset: int, tail: int | None
    ) -> JobOutput:
        """Job ``job_id``'s output: the log of its Pod for replica ``replica`` (the first when
        None), from character ``offset`` on (at most MAX_LOG_CHUNK), or its last ``tail`` lines.
        ``stream`` ``stderr`` answers the same log, with a note that it holds both."""
        if stream not in ("stdout", "stderr"):
            raise Rejected(f"stream must be stdout or stderr, not {stream!r}")
        if offset < 0 or (tail is not None and tail < 0) or (replica is not None and replica < 0):
            raise Rejected(f"offset, tail and replica count from 0: got {offset}, {tail}, {replica}")
        index = replica or 0
        namespace, kind, owner_name = parse_backend_id(backend_id, self.ctx.namespace)
        pods = self._replica_pods(job_id, namespace)
        if index >= len(pods):
            return self._no_pod(job_id, (namespace, kind, owner_name), index, pods, offset)
        pod = pods[index]
        name = pod["metadata"]["name"]
        location = f"pod {name} (namespace {namespace})"
        container = _log_container(pod)
        waiting = _not_started(pod, container)
        if waiting:
            raise Rejected(f"job {job_id} has no output yet: {location} {waiting}")
        log_of = (name, namespace, container)
        try:
            if tail is not None:
                text, next_offset, note = self._tail(log_of, tail)
            else:
                text, next_offset, note = self._from(log_of, offset)
        except NotFound:
            return JobOutput(location, next_offset=offset, readable=False, note=_gone_note(name))
        except Rejected as exc:
            if "waiting to start" in str(exc):  # the pod listing was a moment old
                raise Rejected(f"job {job_id} has no output yet: {location} is waiting to start ({exc})") from None
            raise
        if stream == "stderr":
            note = f"{note} {BOTH_STREAMS}" if note else BOTH_STREAMS
        return JobOutput(location, text, next_offset, note=note)

    def _replica_pods(self, job_id: int, namespace: str) -> list[dict[str, Any]]:
        """The job's Pods (in ``namespace``, its own) in replica order: completion index
        (Indexed Jobs), then age, then name, so that replica K names the same Pod from one
        call to the next."""
        try:
            pods = self.ctx.owned("pods", job_id, namespace)
        except NotFound:  # the namespace is gone, and everything in it
            return []
        return sorted(pods, key=_replica_order)

    def _no_pod(
        self, job_id: int, owner_at: tuple[str, str, str], index: int, pods: list[dict[str, Any]], offset: int
    ) -> JobOutput:
        """No Pod for replica ``index``: not started yet, not a replica, or deleted with its log.
        ``owner_at``: the namespace, kind and name of the job's Job or Deployment."""
        namespace, kind, name = owner_at
        if pods:
            names = ", ".join(p["metadata"]["name"] for p in pods)
            raise Rejected(
                f"job {job_id} has {len(pods)} replica pod(s) in namespace {namespace} ({names}): "
                f"replica {index} is not one of them; use 0 to {len(pods) - 1}"
            )
        tag = self.ctx.tag
        name = name or object_name(tag, job_id)
        owner = self.ctx.client.get(kind, namespace, name)
        if owner is not None and job_id_of(owner, tag) == job_id and not _finished(owner):
            what = "Job" if kind == "jobs" else "Deployment"
            raise Rejected(f"job {job_id} has no output yet: its {what} {name} (namespace {namespace}) has no pod yet")
        pod = self._created_pods(namespace, kind, name)[index : index + 1]
        if pod:
            location = f"pod {pod[0]} (namespace {namespace})"
        else:
            location = f"the pods of {kind.removesuffix('s')}/{name} (namespace {namespace})"
        return JobOutput(location, next_offset=offset, readable=False, note=_gone_note(pod[0] if pod else None))

    def _created_pods(self, namespace: str, kind: str, name: str) -> list[str]:
        """The Pods a Job's controller said it created (its SuccessfulCreate events, which
        outlive the Pods for a while), oldest first; none known for a Deployment."""
        if kind != "jobs":
            return []
        try:
            events = self.ctx.client.events_for(namespace, "Job", name)
        except AdapterError:
            return []
        prefix = "Created pod: "
        return [
            e["message"].removeprefix(prefix)
            for e in events
            if e.get("reason") == "SuccessfulCreate" and str(e.get("message") or "").startswith(prefix)
        ]

    def _read_log(self, log_of: tuple[str, str, str], **options: Any) -> bytes:
        pod, namespace, container = log_of
        return self.ctx.client.read_namespaced_pod_log(pod, namespace, container=container, **options)

    def _from(self, log_of: tuple[str, str, str], offset: int) -> tuple[str, int, str | None]:
        """The log (of ``log_of``: pod, namespace, container) from character ``offset`` on, at
        most MAX_LOG_CHUNK of it; the next offset; a note when the log is shorter than
        ``offset`` (a new container run starts a new log)."""
        pod = log_of[0]
        wanted = offset + MAX_LOG_CHUNK
        limit = wanted  # bytes: enough for ASCII, the common case
        while True:
            data = self._read_log(log_of, limit_bytes=limit)
            cut = len(data) >= limit
            text = _decode(data, final=not cut)
            if not cut or len(text) >= wanted or limit >= 4 * wanted:
                break
            limit = 4 * wanted  # UTF-8 takes at most 4 bytes a character
        chunk = text[offset:wanted]
        note = None
        if not cut and len(text) < offset:
            note = (
                f"the log of pod {pod} holds {len(text)} characters, fewer than the {offset} read before: "
                "its container has restarted (a new run starts a new log), or the log was rotated"
            )
        return chunk, offset + len(chunk), note

    def _tail(self, log_of: tuple[str, str, str], lines: int) -> tuple[str, int, str | None]:
        """The last ``lines`` lines (at most MAX_LOG_CHUNK characters of them) and the offset of the
        log's end. The API cannot say where a log ends without sending it, so the log is read up
        to LOG_SCAN_BYTES and tailed here (one request: its end is where the tail ends); a longer
        log is tailed by the kubelet (``tailLines``), and following it resumes at the scan's end."""
        pod = log_of[0]
        data = self._read_log(log_of, limit_bytes=LOG_SCAN_BYTES)
        if len(data) < LOG_SCAN_BYTES:
            whole = _decode(data, final=True)
            return _last_lines(whole, lines)[-MAX_LOG_CHUNK:], len(whole), None
        scanned = len(_decode(data, final=False))
        tailed = self._read_log(log_of, tail_lines=lines, limit_bytes=4 * MAX_LOG_CHUNK)
        text = _decode(tailed, final=len(tailed) < 4 * MAX_LOG_CHUNK)[-MAX_LOG_CHUNK:]
        note = (
            f"the log of pod {pod} is longer than {LOG_SCAN_BYTES >> 20} MiB: gpush counted that much of it, "
            "so following it from here starts at that point, not at its end"
        )
        return text, scanned, note


def _replica_order(pod: dict[str, Any]) -> tuple[bool, int, str, str]:
    metadata = pod.get("metadata") or {}
    raw = (metadata.get("labels") or {}).get(COMPLETION_INDEX) or (metadata.get("annotations") or {}).get(
        COMPLETION_INDEX
    )
    try:
        index = int(raw)
    except (TypeError, ValueError):
        index = None
    return (index is None, index or 0, metadata.get("creationTimestamp") or "", metadata.get("name") or "")


def _log_container(pod: dict[str, Any]) -> str:
    """The container whose log is the job's output: gpush's own, else the Pod's first."""
    names = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or ()]
    return CONTAINER if CONTAINER in names or not names else names[0]


def _not_started(pod: dict[str, Any], container: str) -> str | None:
    """Why ``container`` has no log yet (the end of a sentence about the Pod), or None when it
    has run (running now, ended, or ended before a restart)."""
    status = pod.get("status") or {}
    for entry in status.get("containerStatuses") or ():
        if entry.get("name") != container:
            continue
        state = entry.get("state") or {}
        if state.get("running") or state.get("terminated") or (entry.get("lastState") or {}).get("terminated"):
            return None
        waiting = state.get("waiting") or {}
        reason = waiting.get("reason") or "ContainerCreating"
        return f"is waiting to start: {reason}" + (f" ({waiting['message']})" if waiting.get("message") else "")
    phase = status.get("phase") or "Pending"
    if not (pod.get("spec") or {}).get("nodeName"):
        scheduled = next((c for c in status.get("conditions") or () if c.get("type") == "PodScheduled"), {})
        why = ": ".join(str(scheduled[k]) for k in ("reason", "message") if scheduled.get(k))
        return f"is {phase}, on no node yet" + (f" ({why})" if why else "")
    if phase in ("Failed", "Succeeded"):
        why = ": ".join(str(status[k]) for k in ("reason", "message") if status.get(k))
        return f"ended ({phase}) before its container started" + (f": {why}" if why else "")
    return "is waiting to start: ContainerCreating"


def _finished(owner: dict[str, Any]) -> bool:
    conditions = (owner.get("status") or {}).get("conditions") or ()
    return any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True" for c in conditions)


def _gone_note(pod: str | None) -> str:
    which = f"pod {pod}" if pod else "the job's pod"
    return (
        f"{which} was deleted (the job was cancelled or cleaned up, or its node went), and Kubernetes "
        "deleted its log with it: gpush cannot read this output any more"
    )


def _decode(data: bytes, *, final: bool) -> str:
    """UTF-8 text of a log; ``final`` False when ``data`` was cut short, so that a character cut
    in two at the end is left out rather than turned into a replacement character."""
    return codecs.getincrementaldecoder("utf-8")(errors="replace").decode(data, final=final)


def _last_lines(text: str, lines: int) -> str:
    if lines <= 0:
        return ""
    return "".join(text.splitlines(keepends=True)[-lines:])
