"""What every part of the Kubernetes adapter shares: one cluster's settings and client, where
this broker's objects are, and how they are found again.

:class:`KubeContext` is built once per adapter and handed to each of its concerns (jobs,
statuses, logs, nodes, MIG, capacity, namespaces). It owns the bookkeeping more than one of
them reads: the backend ids this process handed out and the jobs it deleted (``lock`` guards
both, and what the capacity keeps), and the namespaces checked ready. Backend ids are
:func:`parse_backend_id`'s; a 403 is told apart by :func:`forbidden`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from adapters.k8s.client import KubeClient
from adapters.k8s.render import RenderOptions, default_gpu_types, job_id_of, object_name, selector
from adapters.k8s.settings import KubernetesSettings
from adapters.k8s.states import Observed
from adapters.k8s.tenancy import TenantNamespaces
from broker.core.adapter import Rejected

RBAC_FILE = "deploy/k8s/gpush-broker-rbac.yaml"


def parse_backend_id(backend_id: str, default_namespace: str) -> tuple[str, str, str]:
    """(namespace, ``jobs`` or ``deployments``, name) of a backend id: ``<namespace>/job/<name>``
    (a namespace per tenant), ``job/<name>`` or ``deployment/<name>`` in ``default_namespace``
    (shared, and every id of earlier versions), or a bare ``<name>`` (a Job there); the name is
    empty when the id holds none."""
    parts = backend_id.split("/")
    if len(parts) >= 3:
        namespace, kind, name = parts[0], parts[1], "/".join(parts[2:])
    elif len(parts) == 2:
        namespace, (kind, name) = default_namespace, parts
    else:
        namespace, kind, name = default_namespace, "job", parts[0]
    return namespace or default_namespace, "deployments" if kind == "deployment" else "jobs", name


class KubeContext:
    """One Kubernetes cluster as the adapter's concerns see it (see the module docstring)."""

    def __init__(self, name: str, settings: KubernetesSettings, client: KubeClient | None = None):
        self.name = name
        self.settings = s = settings
        self.client = client or KubeClient(
            kubeconfig=s.kubeconfig, context=s.context, timeout=s.timeout, pool_size=s.submit_threads + 4
        )
        self.namespace = s.namespace
        self.tag = s.tag
        self.tenancy = TenantNamespaces(
            cluster=f"Kubernetes cluster {name}",
            default=s.namespace,
            mode=s.namespace_mode,
            mapping=dict(s.tenant_namespaces),
            pattern=s.namespace_pattern,
        )
        # Where this broker's objects are listed and watched: its namespace, or every
        # namespace (by label) when each tenant has its own.
        self.scope: str | None = None if self.tenancy.per_tenant else s.namespace
        self.gpu_types = {**default_gpu_types(), **s.gpu_types}
        self.options = RenderOptions(
            tag=s.tag,
            namespace=s.namespace,
            image=s.image,
            service_account=s.service_account,
            run_as_user=s.run_as_user,
            priority_class=s.priority_class,
            node_selector=dict(s.node_selector),
            gpu_types=self.gpu_types,
        )
        self.lock = threading.RLock()
        self.ids: dict[int, str] = {}  # gpush id -> backend id
        self.cancelled: set[int] = set()
        self.namespace_lock = threading.Lock()
        self.ready: set[tuple[str, str | None]] = set()  # (namespace, tenant) there and checked

    # -- namespaces checked ready ----------------------------------------------------------

    def forget_namespace(self, namespace: str) -> None:
        with self.namespace_lock:
            self.ready = {key for key in self.ready if key[0] != namespace}

    def namespace_known(self, namespace: str) -> bool:
        return any(key[0] == namespace for key in self.ready)

    # -- finding this broker's objects -------------------------------------------------------

    def namespace_of(self, obj: Mapping[str, Any] | None) -> str:
        return ((obj or {}).get("metadata") or {}).get("namespace") or self.namespace

    def id_in(self, namespace: str, backend_id: str) -> str:
        """A backend id (``job/<name>``) as this cluster hands it out: with its namespace in
        front when each tenant has its own (see :func:`parse_backend_id`)."""
        return f"{namespace}/{backend_id}" if self.tenancy.per_tenant else backend_id

    def backend_id(self, job_id: int, seen: Observed) -> str:
        owner = seen.owner
        if owner is not None:
            kind = "job" if seen.job is not None else "deployment"
            return self.id_in(self.namespace_of(owner), f"{kind}/{owner['metadata']['name']}")
        return self.ids.get(job_id) or f"job/{object_name(self.tag, job_id)}"

    def list_in(self, kind: str, namespace: str | None, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Objects of ``kind`` with ``label_selector`` in ``namespace`` (None: every namespace,
        where a refusal says what grants it)."""
        try:
            return self.client.list(kind, namespace, label_selector=label_selector)
        except Rejected as exc:
            raise self.refused_everywhere(exc, kind, namespace) from None

    def refused_everywhere(self, exc: Rejected, kind: str, where: str | None) -> Rejected:
        if where is not None or not forbidden(exc):
            return exc
        return Rejected(
            f"{self.name} keeps each tenant's jobs in its own namespace, so the broker lists and watches its "
            f"{kind} in every namespace, and Kubernetes refused it: {exc}{rbac_hint(exc)}"
        )

    def owned(self, kind: str, job_id: int, namespace: str | None = None) -> list[dict[str, Any]]:
        """Job ``job_id``'s objects of ``kind`` (in ``namespace``, else where this broker keeps them)."""
        where = namespace if namespace is not None else self.scope
        items, _ = self.list_in(kind, where, selector(self.tag, job_id))
        return [obj for obj in items if job_id_of(obj, self.tag) == job_id]

    def delete_objects(self, job_id: int, grace: int | None) -> None:
        """Delete a job's Job or Deployment, its Pods and a gang's Service (found by label)."""
        for kind in ("services", "jobs", "deployments", "pods"):
            # The Service first: owned by its Job, it would go with it, but in the garbage
            # collector's own time, or never when the Job was deleted orphaning it. Pods too:
            # a Job's are removed by the garbage collector in its own time, and they hold their
            # GPUs until then.
            for obj in self.owned(kind, job_id):
                self.client.delete(kind, self.namespace_of(obj), obj["metadata"]["name"], grace=grace)

    def node(self, node: str) -> dict[str, Any]:
        found = self.client.get("nodes", None, node)
        if found is None:
            raise Rejected(f"Kubernetes cluster {self.name} has no node {node} (kubectl get nodes lists them)")
        return found


def forbidden(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, Rejected) and ("HTTP 403" in text or "Forbidden" in text)


def rbac_hint(exc: BaseException) -> str:
    """What grants the broker what Kubernetes refused it (a 403), else nothing."""
    return f" (grant the broker what it needs with {RBAC_FILE})" if forbidden(exc) else ""
