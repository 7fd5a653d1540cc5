"""Kubernetes objects as gpush states: a Job or Deployment and its Pods -> a BackendJob.

The adapter keeps, per gpush job, the objects the API server last sent
(:class:`Observed`) and asks :func:`backend_job` what they mean. The mapping:

============================================  ==========  ==========================================
Kubernetes                                    gpush       reason
============================================  ==========  ==========================================
no Pod yet                                    PENDING     waiting for Kubernetes to create its Pod
Pod Pending, PodScheduled=False Unschedulable PENDING     ``Unschedulable: Insufficient nvidia.com/…``
Pod Pending, container waiting (image pull…)  PENDING     ``ErrImagePull: …`` (the kubelet's words)
Pod Pending on a node, containers creating    PENDING     starting on <node>
a Pod Running (or Succeeded, Job not done)    RUNNING
Job condition Complete                        SUCCEEDED   (exit code 0)
Job condition Failed, DeadlineExceeded        FAILED      reached its time limit (…s)
Job Failed / Pod failed, OOMKilled            FAILED      ``OOMKilled: the job used more GPU or host
                                                          memory than its limit`` (exit code 137)
Job Failed / Pod failed, exit code N          FAILED      exited with code N
Pod evicted                                   FAILED      evicted by Kubernetes: <message>
Deployment readyReplicas > 0                  RUNNING     k of n replicas ready, when k < n
Deployment scaled to 0                        RUNNING     scaled to 0 replicas
Deployment, no replica ready                  PENDING     the first Pod's reason, as for a Job
object deleted by gpush (cancel)              CANCELLED   cancelled by gpush
object deleted by someone else, had started   CANCELLED   deleted in Kubernetes, not by gpush
object deleted by someone else, never started LOST        (the broker queues it again)
a gang's started rank lost (Pod deleted, or   RUNNING     rank 1 lost …: stopping the whole gang
failed with DisruptionTarget), Job not done               (the adapter deletes the Job, its Pods and
                                                          Service: :attr:`Observed.lost_rank`)
... then its Job deleted                      LOST        rank 1 lost …: the whole gang was stopped
                                                          and queued again
============================================  ==========  ==========================================

A gang (a multi-node job: an Indexed Job of several completions) runs all of its ranks or
none: a rank that exits non-zero fails the Job (``backoffLimit`` 0, reported FAILED as
above) and the Job controller stops the others; a rank lost to its node (deleted with it,
or failed with a ``DisruptionTarget`` condition, as the Pod garbage collector marks Pods of
a node that went, which the Job's Pod failure policy turns into a ``PodFailurePolicy``
failure naming it) is never replaced alone: the adapter stops the whole gang and reports
it LOST once its Job is gone, so the broker places it again.

A Job's Pods fail the Job at once (``backoffLimit`` 0), so a failed Pod is reported
failed before the Job controller writes its condition; a Job created by someone else
with retries left stays running.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from adapters.k8s.render import COMPLETION_INDEX
from broker.core.adapter import BackendJob, BackendState

OOM_REASON = "OOMKilled: the job used more GPU or host memory than its limit"
_WAITING = {
    "ErrImagePull": "cannot pull the image",
    "ImagePullBackOff": "cannot pull the image (backing off)",
    "InvalidImageName": "the image name is invalid",
    "CreateContainerConfigError": "the container's configuration is invalid",
    "CreateContainerError": "the container could not be created",
    "CrashLoopBackOff": "the container keeps crashing",
    "RunContainerError": "the container could not start",
}
_NODES_AVAILABLE = re.compile(r"^\s*\d+/\d+ nodes are available:\s*")


@dataclass
class Observed:
    """What the adapter last saw of one gpush job's objects."""

    job: dict[str, Any] | None = None
    deployment: dict[str, Any] | None = None
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: bool = False  # its Job or Deployment was deleted
    cancelled: bool = False  # ... by gpush
    started: bool = False  # a container of it ever ran
    # A gang whose started rank was lost: why (the adapter stops the gang, then reports it LOST);
    # and whether only by its Pod's deletion (which the Job controller also does to a gang that ended).
    lost_rank: str | None = None
    lost_by_deletion: bool = False

    @property
    def owner(self) -> dict[str, Any] | None:
        return self.job or self.deployment

    @property
    def gang(self) -> bool:
        spec = (self.job or {}).get("spec") or {}
        return spec.get("completionMode") == "Indexed" and int(spec.get("completions") or 1) > 1

    def note_job(self, job: dict[str, Any]) -> None:
        """Record the Job's new state, and whether its Pod failure policy says a rank was disrupted
        (seen before, or without, that rank's Pod: the Pod may be gone already)."""
        self.job = job
        if self.lost_rank is not None or self.cancelled or not self.gang:
            return
        for kind in ("FailureTarget", "Failed"):
            cond = condition(job, kind)
            message = str((cond or {}).get("message") or "")
            found = _DISRUPTED.match(message) if cond and cond.get("reason") == "PodFailurePolicy" else None
            if found:
                pod = self.pods.get(found.group(1))
                name = (job.get("metadata") or {}).get("name", "")
                rank = _index_in_name(found.group(1), name)
                where = _rank_where(pod) if pod else f"rank {rank if rank is not None else '?'} lost"
                self.lost_rank = f"{where} ({message})"
                return

    def note_pod(self, pod: dict[str, Any], deleted: bool = False) -> None:
        """Record a Pod's new state (``deleted``: it is gone), and whether it cost a gang a rank."""
        name = (pod.get("metadata") or {}).get("name", "")
        if deleted:
            self.pods.pop(name, None)
        else:
            self.pods[name] = pod
        if self.lost_rank is not None or self.cancelled or not self.gang:
            return
        if disrupted := rank_disrupted(pod):
            self.lost_rank = disrupted  # whatever the Job made of it (backoffLimit 0 fails it)
        elif deleted and not _finished(self.job):
            # A rank that failed on its own fails the gang, whose other ranks the Job
            # controller then deletes: those deletions are not losses.
            if not any(failure(p) is not None and not condition(p, "DisruptionTarget") for p in self.pods.values()):
                self.lost_rank = rank_deleted(pod)
                self.lost_by_deletion = self.lost_rank is not None

    def note_started(self) -> None:
        if any(pod_started(p) for p in self.pods.values()):
            self.started = True
        if self.deployment and int((self.deployment.get("status") or {}).get("readyReplicas") or 0) > 0:
            self.started = True


def timestamp(text: Any) -> datetime | None:
    if not text or not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None


def condition(obj: Mapping[str, Any] | None, kind: str) -> dict[str, Any] | None:
    """A status condition of ``kind`` whose status is True, or None."""
    for cond in ((obj or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == kind and str(cond.get("status")) == "True":
            return cond
    return None


# The Job controller's message for a Pod failure policy rule on a Pod condition (pod_failure_policy.go).
_DISRUPTED = re.compile(r"^Pod [^/\s]+/(\S+) has condition DisruptionTarget matching FailJob rule")


def _index_in_name(pod_name: str, job_name: str) -> int | None:
    """The completion index in an Indexed Job's Pod name, ``<job>-<index>-<suffix>``."""
    middle = pod_name.removeprefix(f"{job_name}-").rsplit("-", 1)[0]
    return int(middle) if middle.isdigit() else None


def _finished(job: Mapping[str, Any] | None) -> bool:
    return any(condition(job, kind) for kind in ("Complete", "Failed", "FailureTarget"))


def _rank_where(pod: Mapping[str, Any]) -> str:
    rank = ((pod.get("metadata") or {}).get("annotations") or {}).get(COMPLETION_INDEX, "?")
    node = (pod.get("spec") or {}).get("nodeName")
    return f"rank {rank} lost" + (f" on node {node}" if node else "")


def rank_disrupted(pod: Mapping[str, Any]) -> str | None:
    """Why a gang's rank is lost when its Pod failed by a disruption (its node went, an eviction
    by the API), which Kubernetes marks with a ``DisruptionTarget`` condition; else None (a rank
    that exits non-zero fails the Job: that is the job's failure, not a loss)."""
    disrupted = condition(pod, "DisruptionTarget")
    if disrupted is None or (pod.get("status") or {}).get("phase") != "Failed":
        return None
    return f"{_rank_where(pod)} ({disrupted.get('message') or disrupted.get('reason') or 'a disruption'})"


def rank_deleted(pod: Mapping[str, Any]) -> str | None:
    """Why a gang's rank is lost when its Pod was deleted: it had started and not succeeded."""
    if not pod_started(pod) or (pod.get("status") or {}).get("phase") == "Succeeded":
        return None
    return f"{_rank_where(pod)} (its Pod {(pod.get('metadata') or {}).get('name')} was deleted)"


def _containers(pod: Mapping[str, Any]) -> list[dict[str, Any]]:
    return list((pod.get("status") or {}).get("containerStatuses") or [])


def pod_started(pod: Mapping[str, Any]) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    if phase in ("Running", "Succeeded"):
        return True
    for status in _containers(pod):
        state = status.get("state") or {}
        last = status.get("lastState") or {}
        if "running" in state or "terminated" in state or "terminated" in last:
            return True
    return False


def shorten_unschedulable(message: str) -> str:
    """The scheduler's message in a user's terms: ``0/5 nodes are available: 3 Insufficient
    nvidia.com/mig-3g.20gb, 2 node(s) didn't match Pod's node affinity/selector. preemption:
    ...`` -> ``Unschedulable: Insufficient nvidia.com/mig-3g.20gb``."""
    text = message.split(" preemption:", 1)[0].strip().rstrip(".")
    text = _NODES_AVAILABLE.sub("", text)
    parts = [p.strip() for p in text.split(",") if p.strip()]
    counted: list[tuple[int, str]] = []
    for part in parts:
        match = re.match(r"^(\d+)\s+(.*)$", part)
        counted.append((int(match.group(1)), match.group(2)) if match else (0, part))
    insufficient = list(dict.fromkeys(what for _, what in counted if what.startswith("Insufficient ")))
    if insufficient:
        return "Unschedulable: " + ", ".join(insufficient)
    if counted:
        return "Unschedulable: " + max(counted, key=lambda c: c[0])[1]
    return "Unschedulable: " + (message.strip() or "no node fits")


def pending_reason(pod: Mapping[str, Any]) -> str:
    """Why a Pod that has not started waits, in the user's terms."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and str(cond.get("status")) == "False":
            if cond.get("reason") == "Unschedulable":
                return shorten_unschedulable(str(cond.get("message") or ""))
            if cond.get("message"):
                return f"{cond.get('reason') or 'not scheduled'}: {cond['message']}"
    for container in _containers(pod):
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in ("ContainerCreating", "PodInitializing"):
            said = _WAITING.get(reason, reason)
            message = str(waiting.get("message") or "").strip()
            return f"{reason}: {said}" + (f" ({message[:200]})" if message else "")
    node = (pod.get("spec") or {}).get("nodeName")
    if node:
        return f"starting on {node}"
    return "waiting for the Kubernetes scheduler"


def failure(pod: Mapping[str, Any]) -> tuple[str, int | None] | None:
    """(reason, exit code) of a Pod that failed, or None if it did not."""
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return f"evicted by Kubernetes: {status.get('message') or 'the node ran short of resources'}", None
    if status.get("reason") == "DeadlineExceeded":
        return "reached its time limit (activeDeadlineSeconds)", None
    terminated = None
    for container in _containers(pod):
        done = (container.get("state") or {}).get("terminated")
        if done and (int(done.get("exitCode") or 0) != 0 or done.get("reason") == "OOMKilled"):
            terminated = done
            break
    if terminated is None:
        if status.get("phase") != "Failed":
            return None
        return f"failed: {status.get('message') or status.get('reason') or 'Pod phase Failed'}", None
    code = terminated.get("exitCode")
    code = int(code) if code is not None else None
    if terminated.get("reason") == "OOMKilled":
        return OOM_REASON, code if code is not None else 137
    why = f"exited with code {code}"
    if terminated.get("reason") not in (None, "", "Error", "Completed"):
        why += f" ({terminated['reason']})"
    message = str(terminated.get("message") or "").strip()
    if message:
        why += f": {message.splitlines()[-1][:200]}"
    return why, code


def _last_oom(pod: Mapping[str, Any]) -> int:
    """Restarts of a Pod whose last container termination was an OOM kill (0: none)."""
    for container in _containers(pod):
        last = (container.get("lastState") or {}).get("terminated") or {}
        if last.get("reason") == "OOMKilled":
            return int(container.get("restartCount") or 1)
    return 0


def _running_pod(pods: list[dict[str, Any]]) -> dict[str, Any] | None:
    for pod in pods:
        if (pod.get("status") or {}).get("phase") == "Running":
            return pod
    return None


def _started_at(pod: Mapping[str, Any]) -> datetime | None:
    for container in _containers(pod):
        running = (container.get("state") or {}).get("running") or {}
        if running.get("startedAt"):
            return timestamp(running["startedAt"])
    return timestamp((pod.get("status") or {}).get("startTime"))


def _by_age(pods: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        pods.values(),
        key=lambda p: ((p.get("metadata") or {}).get("creationTimestamp") or "", (p.get("metadata") or {}).get("name")),
    )


def backend_job(job_id: int, backend_id: str, seen: Observed, cluster: str = "Kubernetes") -> BackendJob:
    """What ``seen`` means for the gpush job (the table in the module docstring)."""
    pods = [p for p in _by_age(seen.pods) if not (p.get("metadata") or {}).get("deletionTimestamp")] or _by_age(
        seen.pods
    )
    if seen.deleted:
        if seen.cancelled:
            return BackendJob(job_id, backend_id, BackendState.CANCELLED, reason="cancelled by gpush")
        if seen.lost_rank:
            why = f"{seen.lost_rank}: the whole gang was stopped and queued again"
            return BackendJob(job_id, backend_id, BackendState.LOST, reason=why)
        if seen.started:
            return BackendJob(job_id, backend_id, BackendState.CANCELLED, reason=f"deleted in {cluster}, not by gpush")
        return BackendJob(
            job_id,
            backend_id,
            BackendState.LOST,
            reason=f"deleted in {cluster} before it started (not by gpush): queued again",
        )
    if seen.deployment is not None:
        return _deployment_state(job_id, backend_id, seen.deployment, pods)
    job = seen.job or {}
    status = job.get("status") or {}
    if seen.lost_rank:
        # Whatever its Job says by now (a lost rank may fail it), the adapter is stopping it.
        why = f"{seen.lost_rank}: stopping the whole gang to queue it again"
        return BackendJob(job_id, backend_id, BackendState.RUNNING, reason=why)
    done = condition(job, "Complete")
    if done is not None:
        node = next(((p.get("spec") or {}).get("nodeName") for p in pods), None)
        at = timestamp(status.get("completionTime")) or timestamp(done.get("lastTransitionTime"))
        return BackendJob(job_id, backend_id, BackendState.SUCCEEDED, node=node, exit_code=0, at=at)
    failed = condition(job, "Failed") or condition(job, "FailureTarget")
    backoff = int((job.get("spec") or {}).get("backoffLimit") or 0)
    failed_pods = [(p, f) for p in pods if (f := failure(p)) is not None]
    if failed is not None or (failed_pods and len(failed_pods) > backoff):
        node = next(((p.get("spec") or {}).get("nodeName") for p, _ in failed_pods), None)
        at = timestamp((failed or {}).get("lastTransitionTime"))
        if failed is not None and failed.get("reason") == "DeadlineExceeded":
            limit = (job.get("spec") or {}).get("activeDeadlineSeconds")
            why = f"reached its time limit ({limit} s)" if limit else "reached its time limit"
            return BackendJob(job_id, backend_id, BackendState.FAILED, reason=why, node=node, at=at)
        if failed_pods:
            # An OOM kill says more than an exit code: report it when any Pod had one.
            oom = [f for _, f in failed_pods if f[0] == OOM_REASON]
            why, code = oom[0] if oom else failed_pods[-1][1]
            return BackendJob(job_id, backend_id, BackendState.FAILED, reason=why, node=node, exit_code=code, at=at)
        message = (failed or {}).get("message") or (failed or {}).get("reason") or "the Job failed"
        return BackendJob(job_id, backend_id, BackendState.FAILED, reason=f"failed in {cluster}: {message}", at=at)
    running = _running_pod(pods) or next((p for p in pods if (p.get("status") or {}).get("phase") == "Succeeded"), None)
    if running is not None:
        node = (running.get("spec") or {}).get("nodeName")
        return BackendJob(job_id, backend_id, BackendState.RUNNING, node=node, at=_started_at(running))
    if not pods:
        return BackendJob(job_id, backend_id, BackendState.PENDING, reason=f"waiting for {cluster} to create its Pod")
    return BackendJob(job_id, backend_id, BackendState.PENDING, reason=pending_reason(pods[0]))


def _deployment_state(
    job_id: int, backend_id: str, deployment: Mapping[str, Any], pods: list[dict[str, Any]]
) -> BackendJob:
    spec = deployment.get("spec") or {}
    status = deployment.get("status") or {}
    wanted = int(spec.get("replicas") if spec.get("replicas") is not None else 1)
    ready = int(status.get("readyReplicas") or 0)
    running = _running_pod(pods)
    node = (running.get("spec") or {}).get("nodeName") if running else None
    if wanted == 0:
        return BackendJob(job_id, backend_id, BackendState.RUNNING, reason="scaled to 0 replicas")
    waiting = [p for p in pods if (p.get("status") or {}).get("phase") == "Pending"]
    oom = max((_last_oom(p) for p in pods), default=0)
    if ready > 0:
        reason = None
        if ready < wanted:
            reason = f"{ready} of {wanted} replicas ready"
            if waiting:
                reason += f"; {pending_reason(waiting[0])}"
            elif oom:
                reason += f"; {OOM_REASON} (restarted {oom} times)"
        at = _started_at(running) if running else None
        return BackendJob(job_id, backend_id, BackendState.RUNNING, reason=reason, node=node, at=at)
    if oom:
        return BackendJob(
            job_id,
            backend_id,
            BackendState.RUNNING if running else BackendState.PENDING,
            reason=f"{OOM_REASON} (Kubernetes restarted it {oom} times)",
            node=node,
        )
    if running is not None:
        # Running but not ready yet (a readiness probe): it holds its GPUs.
        return BackendJob(job_id, backend_id, BackendState.RUNNING, reason="started, not ready yet", node=node)
    if not pods:
        return BackendJob(job_id, backend_id, BackendState.PENDING, reason="waiting for its Pods to be created")
    return BackendJob(
        job_id, backend_id, BackendState.PENDING, reason=pending_reason(waiting[0] if waiting else pods[0])
    )
