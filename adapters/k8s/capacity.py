"""What a Kubernetes cluster offers gpush: its Nodes and the Pods that hold resources, and the
inventory read from them.

:class:`NodesAndPods` reads Nodes and bound Pods from watch-fed caches (adapters.k8s.informer:
one list, then a watch), or, with ``informers=false``, lists them (Nodes read within
``cache_seconds`` sharing one listing); the Pod watch also tells the scheduler when a Pod of
this broker's jobs changes (ChangeNotifier). Pods count cluster-wide when the broker may list
them everywhere, else from its namespace, which the records' labels say. :class:`Capacity` turns
them into inventory records (adapters.k8s.inventory) and keeps what the last read saw: the GPU
products per model (which jobs are pinned to) and the GPU resources (which tenants' quotas are
rendered for).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from adapters.k8s.client import NotFound
from adapters.k8s.context import KubeContext
from adapters.k8s.informer import Informer, trim_pod
from adapters.k8s.inventory import gpu_requests_by_node, node_units
from adapters.k8s.render import LABEL_BROKER, product_names
from adapters.k8s.tenancy import gpu_resources
from adapters.k8s.timeslice import read_timeslice
from broker.core.adapter import AdapterError, CapacityUnit, Placement, Rejected


class NodesAndPods:
    """The cluster's Nodes and bound Pods, cached by watch or listed (see the module docstring)."""

    def __init__(self, ctx: KubeContext):
        self.ctx = ctx
        name = ctx.name
        self._node_listing: tuple[float, list[dict[str, Any]]] | None = None
        self._node_cache = Informer(ctx.client, "nodes", name=f"{name}-nodes")
        # Cluster-wide; None once the cluster said this broker may not list Pods everywhere.
        self._pod_cache: Informer | None = Informer(
            ctx.client, "pods", trim=trim_pod, name=f"{name}-pods", on_event=self._pod_changed
        )
        self._on_change: Callable[[], None] | None = None

    def notify_changes(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` when the pod watch sees a Pod of this broker's jobs change
        (ChangeNotifier): the scheduler then reads statuses at once. The watch starts with
        the first inventory read."""
        self._on_change = callback

    def _pod_changed(self, pod: dict[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        callback = self._on_change
        if callback is not None and labels.get(LABEL_BROKER) == self.ctx.tag:
            callback()

    def close(self) -> None:
        """Stop the caches' watches (they are daemon threads; a process may also just exit)."""
        self._node_cache.stop()
        if self._pod_cache is not None:
            self._pod_cache.stop()

    def nodes(self) -> list[dict[str, Any]]:
        settings = self.ctx.settings
        if settings.informers:
            return self._node_cache.snapshot()
        with self.ctx.lock:
            now = time.monotonic()
            if self._node_listing is None or now - self._node_listing[0] > settings.cache_seconds:
                nodes, _ = self.ctx.client.list("nodes")
                self._node_listing = (now, nodes)
            return self._node_listing[1]

    def bound_pods(self) -> tuple[list[dict[str, Any]], str | None]:
        """Pods that hold resources, cluster-wide when allowed; and, when only this
        namespace could be read, a note saying so."""
        client, namespace = self.ctx.client, self.ctx.namespace
        if self.ctx.settings.informers and self._pod_cache is not None:
            try:
                return self._pod_cache.snapshot(), None
            except NotFound:
                pass
            except Rejected as exc:
                if "Forbidden" in str(exc) or "403" in str(exc):
                    self._pod_cache.stop()
                    self._pod_cache = None
                else:
                    raise
        unfinished = "status.phase!=Succeeded,status.phase!=Failed"
        try:
            pods, _ = client.list("pods", None, field_selector=unfinished)
            return pods, None
        except NotFound:
            pass
        except Rejected as exc:
            if "Forbidden" not in str(exc) and "403" not in str(exc):
                # A server that does not take this field selector: filter here instead.
                pods, _ = client.list("pods", None)
                return pods, None
        pods, _ = client.list("pods", namespace)
        return pods, f"counted from namespace {namespace} only (no permission to list Pods cluster-wide)"


class Capacity:
    """The cluster's GPUs as inventory records, and what the last read of them saw."""

    def __init__(self, ctx: KubeContext, cache: NodesAndPods):
        self.ctx = ctx
        self.cache = cache
        self._products: dict[str, set[str]] = {}  # GPU model -> product labels seen on nodes
        self._resources: dict[str, tuple[float, ...]] | None = None  # GPU resources of the last inventory

    def inventory(self) -> list[CapacityUnit]:
        ctx = self.ctx
        nodes = self.cache.nodes()
        pods, partial = self.cache.bound_pods()
        held = gpu_requests_by_node(pods)
        try:
            timeslice = read_timeslice(ctx.client, ctx.settings.timeslice_config)
        except AdapterError:
            timeslice = None  # no permission to read the operator's config: no drift findings
        units: list[CapacityUnit] = []
        products: dict[str, set[str]] = {}
        for node in nodes:
            labels = (node.get("metadata") or {}).get("labels") or {}
            expected, source = (None, "")
            if timeslice is not None:
                expected, source = timeslice.replicas_for(labels)
            found = node_units(
                ctx.name,
                node,
                held.get((node.get("metadata") or {}).get("name", ""), {}),
                gpu_types=ctx.gpu_types,
                expected_replicas=expected,
                expected_from=source,
                levels=ctx.settings.topology_levels,
            )
            for unit in found:
                if unit.labels.get("product"):
                    products.setdefault(unit.gpu_model, set()).add(unit.labels["product"])
            if partial:
                found = [_with_label(u, "allocation", partial) for u in found]
            units.extend(found)
        with ctx.lock:
            self._products = products
            self._resources = gpu_resources(units)
        return units

    def gpu_resources(self) -> dict[str, tuple[float, ...]] | None:
        """The GPU resources of the last inventory read; None before the first."""
        with self.ctx.lock:
            return self._resources

    def products_for(self, placement: Placement) -> list[str]:
        if not placement.gpu_model:
            return []
        with self.ctx.lock:
            seen = set(self._products.get(placement.gpu_model, ()))
        return product_names(placement.gpu_model, self.ctx.gpu_types, seen)


def _with_label(unit: CapacityUnit, key: str, value: str) -> CapacityUnit:
    return replace(unit, labels={**unit.labels, key: value})
