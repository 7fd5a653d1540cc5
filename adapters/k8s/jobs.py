"""gpush jobs as Kubernetes objects: submit, cancel, preempt, find and scale them.

A job becomes a Job or Deployment (adapters.k8s.render) in its namespace (adapters.k8s.namespaces
makes it ready), named ``<tag>-<id>`` and labelled with this broker's tag and the job's id, so
that :meth:`Jobs.find`, cancel and scale find it by label after a crash. A create that meets an
object of its name already counts as done when the labels prove it is this job's. A multi-node
job (a gang) is an Indexed Job with a headless Service of its name and labels, owned by the Job
(Kubernetes deletes it with the Job); cancel deletes both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from adapters.k8s.capacity import Capacity
from adapters.k8s.client import AlreadyExists, NotFound
from adapters.k8s.context import KubeContext
from adapters.k8s.namespaces import Namespaces
from adapters.k8s.render import Manifest, job_id_of, render
from adapters.k8s.states import Observed, backend_job
from broker.core.adapter import (
    PREEMPT_SIGNALS,
    AdapterError,
    BackendJob,
    Owner,
    Placement,
    Rejected,
    SubmitItem,
    submit_each,
)
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec


class Jobs:
    """This broker's jobs on one cluster, as Kubernetes objects (see the module docstring)."""

    def __init__(self, ctx: KubeContext, namespaces: Namespaces, capacity: Capacity):
        self.ctx = ctx
        self.namespaces = namespaces
        self.capacity = capacity

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        ctx = self.ctx
        namespace, tenant = ctx.tenancy.namespace_for(owner)
        if owner is not None:
            # Whose job it is, in its labels and environment too, is its owner's word, not the spec's.
            spec = spec.model_copy(update={"tenant": owner.tenant, "user": owner.user})
        options = ctx.options if namespace == ctx.options.namespace else replace(ctx.options, namespace=namespace)
        manifest = render(
            job_id,
            spec,
            placement,
            options,
            gpu_memory_gb=_model_memory(placement.gpu_model),
            products=self.capacity.products_for(placement),
        )
        self.namespaces.ensure(namespace, tenant)
        try:
            self._create(job_id, manifest, namespace)
        except NotFound:
            # The namespace went after this process saw it: made again where that is allowed.
            ctx.forget_namespace(namespace)
            if not ctx.settings.create_namespace:
                raise Rejected(self.namespaces.missing(namespace, tenant)) from None
            self.namespaces.ensure(namespace, tenant)
            try:
                self._create(job_id, manifest, namespace)
            except NotFound as exc:
                raise Rejected(f"{self.namespaces.missing(namespace, tenant)} ({exc})") from None
        backend_id = ctx.id_in(namespace, manifest.backend_id)
        with ctx.lock:
            ctx.ids[job_id] = backend_id
            ctx.cancelled.discard(job_id)
        return backend_id

    def _create(self, job_id: int, manifest: Manifest, namespace: str) -> None:
        """Create the job's object; an object of its name that is this job's already (a broker
        killed between this create and its database write) counts as created."""
        job = self._create_once(job_id, manifest.kind, manifest.body, namespace, manifest.backend_id)
        if manifest.service is not None:
            # Owned by the Job, so Kubernetes' garbage collector deletes it with the Job
            # whoever deletes that; its ranks' names resolve once it is there.
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": manifest.name, "uid": job["metadata"]["uid"]}
            service = {**manifest.service, "metadata": {**manifest.service["metadata"], "ownerReferences": [owner]}}
            self._create_once(job_id, "services", service, namespace, f"service/{manifest.name}")

    def _create_once(self, job_id: int, kind: str, body: dict, namespace: str, what: str) -> dict:
        """The object created, or the one of its name that is this job's already."""
        client = self.ctx.client
        try:
            return client.create(kind, namespace, body)
        except AlreadyExists:
            existing = client.get(kind, namespace, body["metadata"]["name"])
            if existing is None:  # deleted in between: this create is the one
                return client.create(kind, namespace, body)
            if job_id_of(existing, self.ctx.tag) != job_id:
                raise Rejected(
                    f"{what} exists in namespace {namespace} of {self.ctx.name} but is not "
                    f"gpush job {job_id} of this broker (labels {(existing['metadata'].get('labels') or {})}): "
                    "delete it, or give this cluster another tag"
                ) from None
            return existing

    def submit_many(self, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
        """Create a batch on several threads; per item the backend id or the AdapterError."""
        refused: dict[int, AdapterError] = {}
        if len(items) > 1:
            # Each namespace once, before the threads, which would race to create it; a
            # namespace that is refused refuses its items without asking again for each.
            checked: dict[tuple[str, str | None], AdapterError | None] = {}
            for index, item in enumerate(items):
                try:
                    key = self.ctx.tenancy.namespace_for(item[3] if len(item) > 3 else None)  # type: ignore[misc]
                except Rejected:
                    continue  # submit says so for this item
                if key not in checked:
                    try:
                        self.namespaces.ensure(*key)
                        checked[key] = None
                    except AdapterError as exc:
                        checked[key] = exc
                failure = checked[key]
                if failure is not None:
                    refused[index] = failure
        left = [item for index, item in enumerate(items) if index not in refused]
        results = iter(submit_each(self, left, threads=self.ctx.settings.submit_threads))
        return [refused[i] if i in refused else next(results) for i in range(len(items))]

    def cancel(self, job_id: int) -> None:
        self._delete(job_id, grace=None)

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """Kubernetes tells a container to stop only with its stop signal (SIGTERM unless the
        image sets another), so ``signal`` is not sent: the job's Job or Deployment and its
        Pods are deleted with ``grace_seconds`` as the Pods' grace period, in which the
        kubelet waits for the container to exit before it kills it."""
        if signal not in PREEMPT_SIGNALS:
            raise Rejected(f"signal {signal!r} is not one a job may be told of a preemption with: {PREEMPT_SIGNALS}")
        self._delete(job_id, grace=grace_seconds)

    def _delete(self, job_id: int, grace: int | None) -> None:
        ctx = self.ctx
        with ctx.lock:
            ctx.cancelled.add(job_id)
        ctx.delete_objects(job_id, grace)

    def find(self, job_id: int) -> BackendJob | None:
        ctx = self.ctx
        seen = Observed()
        for kind in ("jobs", "deployments"):
            for obj in ctx.owned(kind, job_id):
                setattr(seen, "job" if kind == "jobs" else "deployment", obj)
        if seen.owner is None:
            return None
        seen.pods = {p["metadata"]["name"]: p for p in ctx.owned("pods", job_id, ctx.namespace_of(seen.owner))}
        seen.note_started()
        return backend_job(job_id, ctx.backend_id(job_id, seen), seen, ctx.name)

    def scale(self, job_id: int, replicas: int) -> int:
        """Set an elastic job's replicas (its Deployment's scale subresource); returns them."""
        ctx = self.ctx
        if replicas < 0:
            raise Rejected(f"replicas must be 0 or more, not {replicas}")
        deployments = ctx.owned("deployments", job_id)
        if not deployments:
            if ctx.owned("jobs", job_id):
                raise Rejected(
                    f"job {job_id} runs as a Kubernetes Job, which does not scale: only elastic inference does"
                )
            where = f"namespace {ctx.namespace}" if ctx.scope else "any namespace"
            raise Rejected(f"{ctx.name} has no Deployment for job {job_id} ({where})")
        deployment = deployments[0]
        answer = ctx.client.scale(ctx.namespace_of(deployment), deployment["metadata"]["name"], replicas)
        return int((answer.get("spec") or {}).get("replicas", replicas))


def _model_memory(name: str | None) -> float | None:
    if not name:
        return None
    try:
        return float(gpu_model(name).memory_gb)
    except ValueError:
        return None
