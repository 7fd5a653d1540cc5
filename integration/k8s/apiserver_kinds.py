"""The resource types the test API server serves: the built-in kinds and those a CRD adds.

A :class:`ResourceType` carries what the registry and discovery need about one resource: its group,
served versions, Kind and plural, scope, subresources, whether writes bump ``metadata.generation``,
which fields a field selector may name, and the default propagation policy of a delete.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Not-string fields and the few every kind supports are handled in apiserver_selectors.
_POD_FIELDS = frozenset(
    {
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    }
)
_EVENT_FIELDS = frozenset(
    {
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")


@dataclass(eq=False)
class ResourceType:
    group: str
    versions: tuple[str, ...]  # served versions, preferred first
    kind: str
    plural: str
    singular: str
    namespaced: bool
    short_names: tuple[str, ...] = ()
    status: bool = False  # has the status subresource
    scale: bool = False  # has the autoscaling/v1 Scale subresource
    generation: bool = False  # spec changes bump metadata.generation
    builtin: bool = True  # built-in lists omit kind/apiVersion on items; custom resources refuse strategic merge
    name_rule: str = "subdomain"  # "subdomain", "label" (RFC 1123) or "dns1035"
    field_labels: frozenset[str] = field(default_factory=frozenset)
    default_propagation: str = "Background"
    categories: tuple[str, ...] = ()
    # Custom resources: each served version's openAPIV3Schema, by which their fields are pruned.
    schemas: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """``pods``, ``jobs.batch``, ``clusterpolicies.nvidia.com``: the name kubectl takes."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def version(self) -> str:
        return self.versions[0]

    def api_version(self, version: str | None = None) -> str:
        version = version or self.version
        return f"{self.group}/{version}" if self.group else version

    def selectable(self, label: str) -> bool:
        return label in ("metadata.name", "metadata.namespace") or label in self.field_labels


def _core(kind: str, plural: str, namespaced: bool = True, **kw: Any) -> ResourceType:
    return ResourceType("", ("v1",), kind, plural, kind.lower(), namespaced, **kw)


def _workload(group: str, kind: str, plural: str, short_names: tuple[str, ...], **kw: Any) -> ResourceType:
    return ResourceType(
        group,
        ("v1",),
        kind,
        plural,
        kind.lower(),
        True,
        short_names,
        status=True,
        generation=True,
        categories=("all",),
        **kw,
    )


BUILTINS: tuple[ResourceType, ...] = (
    _core(
        "Namespace",
        "namespaces",
        namespaced=False,
        short_names=("ns",),
        status=True,
        name_rule="label",
        field_labels=frozenset({"status.phase"}),
    ),
    _core(
        "Pod", "pods", short_names=("po",), status=True, generation=True, field_labels=_POD_FIELDS, categories=("all",)
    ),
    _core(
        "Node",
        "nodes",
        namespaced=False,
        short_names=("no",),
        status=True,
        field_labels=frozenset({"spec.unschedulable"}),
    ),
    _core("ConfigMap", "configmaps", short_names=("cm",)),
    # Stored with their quantities canonical; the quota and LimitRanger admission plugins are not played.
    _core("ResourceQuota", "resourcequotas", short_names=("quota",), status=True),
    _core("LimitRange", "limitranges", short_names=("limits",)),
    _core("Secret", "secrets", field_labels=frozenset({"type"})),
    _core("Service", "services", short_names=("svc",), status=True, name_rule="dns1035", categories=("all",)),
    _core("ServiceAccount", "serviceaccounts", short_names=("sa",)),
    _core("Event", "events", short_names=("ev",), field_labels=_EVENT_FIELDS),
    _workload("apps", "Deployment", "deployments", ("deploy",), scale=True),
    _workload("apps", "ReplicaSet", "replicasets", ("rs",), scale=True, field_labels=frozenset({"status.replicas"})),
    _workload("apps", "StatefulSet", "statefulsets", ("sts",), scale=True),
    _workload("apps", "DaemonSet", "daemonsets", ("ds",)),
    # batch/v1 keeps the old default: deleting a Job through the API orphans its Pods.
    _workload("batch", "Job", "jobs", (), field_labels=frozenset({"status.successful"}), default_propagation="Orphan"),
    _workload("batch", "CronJob", "cronjobs", ("cj",)),
    ResourceType("coordination.k8s.io", ("v1",), "Lease", "leases", "lease", True),
    ResourceType(
        "apiextensions.k8s.io",
        ("v1",),
        "CustomResourceDefinition",
        "customresourcedefinitions",
        "customresourcedefinition",
        namespaced=False,
        short_names=("crd", "crds"),
        status=True,
        generation=True,
    ),
)

CRD_KEY = "customresourcedefinitions.apiextensions.k8s.io"
NAMESPACES_KEY = "namespaces"

_VERSION = re.compile(r"^v(\d+)(?:(alpha|beta)(\d+))?$")


def version_priority(version: str) -> tuple[int, int, int]:
    """Kubernetes' version order: GA before beta before alpha, higher numbers first; others last."""
    m = _VERSION.match(version)
    if not m:
        return (3, 0, 0)
    stage = {None: 0, "beta": 1, "alpha": 2}[m.group(2)]
    return (stage, -int(m.group(1)), -int(m.group(3) or 0))


def from_crd(crd: dict[str, Any]) -> ResourceType:
    """The resource a (validated) CustomResourceDefinition serves."""
    spec = crd["spec"]
    names = spec["names"]
    served = [v for v in spec["versions"] if v.get("served", True)]
    versions = tuple(sorted((v["name"] for v in served), key=version_priority))
    fields = {
        sf["jsonPath"].lstrip(".") for v in served for sf in v.get("selectableFields") or () if sf.get("jsonPath")
    }
    return ResourceType(
        group=spec["group"],
        versions=versions or ("v1",),
        kind=names["kind"],
        plural=names["plural"],
        singular=names.get("singular") or names["kind"].lower(),
        namespaced=spec.get("scope") == "Namespaced",
        short_names=tuple(names.get("shortNames") or ()),
        status=any("status" in (v.get("subresources") or {}) for v in served),
        generation=True,
        builtin=False,
        field_labels=frozenset(fields),
        categories=tuple(names.get("categories") or ()),
        schemas={v["name"]: (v.get("schema") or {}).get("openAPIV3Schema") for v in served},
    )
