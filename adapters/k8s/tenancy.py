"""Tenants on Kubernetes: which namespace a tenant's jobs go to, and the ResourceQuota that backs its GPU quota.

Pure functions over settings, owners and inventory records; adapters.k8s.namespaces creates
and applies what they render. What callers may assume:

- **A namespace per tenant** (``namespace_mode=per-tenant``). :meth:`TenantNamespaces.namespace_for`
  takes the job's :class:`broker.core.adapter.Owner` (the tenant of the token that submitted it,
  never the job spec): the tenant's namespace in ``tenant_namespaces`` if it names one, else
  ``namespace_pattern`` with ``{tenant}`` replaced by the tenant's name made a DNS label
  (:func:`dns_label`: lowercase, other characters ``-``). A tenant with neither, or whose
  name makes no valid namespace name, is refused (:class:`Rejected`, saying what to map) rather
  than run in some other tenant's namespace. A job without an owner goes to the default
  ``namespace``; with ``namespace_mode=shared`` (the default) every job does, as before tenants.
- **Namespaces gpush creates say so**: :func:`namespace_manifest` labels them
  ``app.kubernetes.io/managed-by=gpush`` and ``gpush.io/broker=<tag>``, and a tenant's
  ``gpush.io/tenant`` (label, made valid, and annotation, as typed). :func:`claimed_by` reads the
  annotation back, so two tenants whose names make the same namespace (``Vision`` and ``vision``)
  are told apart: the second is refused.
- **A ResourceQuota per tenant namespace** (:func:`plan_quotas`), named :data:`QUOTA_NAME`, from the
  tenant's GPU quota (``gpush tenant set NAME --gpu-quota Q``, physical GPU-equivalents). The
  broker's own ledger (broker.placement.tenants, broker.placement.fairshare) enforces each tenant's
  *combined* budget across every GPU kind on every cluster; a ResourceQuota can only cap each
  resource name on its own (and extended resources only as ``requests.<name>``). So the
  ResourceQuota is the cluster-side backstop, for Pods made outside gpush or a broker bug: for each
  GPU resource the cluster's nodes offer it holds the largest count that alone stays within Q
  (:func:`quota_counts`): ``nvidia.com/gpu`` on whole GPUs ``floor(Q)``, on GPUs time-sliced N
  ways ``floor(Q * N)`` (a replica is 1/N, as the ledger counts it), ``nvidia.com/mig-<profile>``
  ``floor(Q / fraction)`` (3g.20gb of an A100 is 3/7). One resource name can mean different
  amounts on different nodes (``nvidia.com/gpu`` on whole H100s and on T4s split 4 ways): its count
  is then taken by its smallest unit, so the backstop never refuses a Pod the ledger admitted,
  and the rendered YAML says how much further it lets the larger units go.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from adapters.k8s.render import (
    ANNOTATION_TENANT,
    GPU_RESOURCE,
    LABEL_BROKER,
    LABEL_TENANT,
    label_value,
)
from broker.core.adapter import CapacityUnit, Owner, Rejected, Sharing

QUOTA_NAME = "gpush-gpu-quota"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpush"
TENANT_PLACEHOLDER = "{tenant}"
SHARED, PER_TENANT = "shared", "per-tenant"
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?\Z")
_DNS_LABEL_MAX = 63
# ``Q / unit`` of 3/7 over 1/7 is 2.9999999999999996 in floating point: rounded to this many
# digits before it is floored, so that no count comes out one short.
_DIGITS = 6
_NAMESPACE_RULE = "at most 63 lowercase letters, digits and -, starting and ending with a letter or digit"


def dns_label(text: str) -> str:
    """``text`` as a DNS label: lowercase, every character but letters, digits and ``-``
    made ``-`` (``Team_A`` -> ``team-a``, ``alice@lab`` -> ``alice-lab``), ``-`` trimmed from
    both ends. Empty when nothing is left; the caller checks the length."""
    return re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-")


def reserved_namespace(name: str) -> str | None:
    """Why gpush must not put jobs in ``name`` (Kubernetes' own namespaces), or None."""
    if name.startswith("kube-") or name == "default":
        return f"{name} is one of Kubernetes' own namespaces (default, kube-*)"
    return None


def check_namespace(name: str, what: str) -> str:
    """A namespace named in the settings: a DNS label and not Kubernetes' own (ValueError)."""
    if not DNS_LABEL.match(name):
        raise ValueError(f"{what} {name!r} is not a namespace name: use {_NAMESPACE_RULE}")
    if name.startswith("kube-"):
        raise ValueError(f"{what} {name!r}: the kube- namespaces are Kubernetes' own; give gpush one of its own")
    return name


def check_pattern(pattern: str) -> str:
    """``namespace_pattern``: ``{tenant}`` once, no other braces, and a namespace name for a
    one-letter tenant (so that only the tenant's name can make it invalid)."""
    example = "e.g. gpush-{tenant}"
    rest = pattern.replace(TENANT_PLACEHOLDER, "", 1)
    if pattern.count(TENANT_PLACEHOLDER) != 1 or "{" in rest or "}" in rest:
        raise ValueError(
            f"namespace_pattern {pattern!r} must hold {TENANT_PLACEHOLDER} once and no other braces, {example}"
        )
    sample = pattern.replace(TENANT_PLACEHOLDER, "a")
    if not DNS_LABEL.match(sample):
        raise ValueError(
            f"namespace_pattern {pattern!r} does not make namespace names ({sample!r} for tenant a): "
            f"around {TENANT_PLACEHOLDER} use lowercase letters, digits and -, {example}"
        )
    return pattern


@dataclass(frozen=True)
class TenantNamespaces:
    """Where each tenant's jobs go on one cluster (see the module docstring)."""

    cluster: str  # for messages: "Kubernetes cluster k8s-a"
    default: str  # jobs without an owner, and every job with mode shared
    mode: str = SHARED
    mapping: Mapping[str, str] = field(default_factory=dict)
    pattern: str | None = None

    @property
    def per_tenant(self) -> bool:
        return self.mode == PER_TENANT

    def namespace_for(self, owner: Owner | None) -> tuple[str, str | None]:
        """The namespace of ``owner``'s job and the tenant it is that tenant's namespace for
        (None: the default namespace, no tenant's). :class:`Rejected` when the tenant has none."""
        if not self.per_tenant or owner is None:
            return self.default, None
        return self.tenant_namespace(owner.tenant), owner.tenant

    def tenant_namespace(self, tenant: str) -> str:
        """Tenant ``tenant``'s namespace (mode per-tenant), or :class:`Rejected` saying why it has none."""
        mapped = self.mapping.get(tenant)
        if mapped is not None:
            return mapped
        fix = f"map it: gpush cluster add ... --replace --config tenant_namespaces={tenant}=NAMESPACE"
        if self.pattern is None:
            raise Rejected(
                f"tenant {tenant} has no namespace on {self.cluster}: its tenant_namespaces name none and there "
                f"is no namespace_pattern; {fix}, or set namespace_pattern (e.g. gpush-{{tenant}})"
            )
        label = dns_label(tenant)
        name = self.pattern.replace(TENANT_PLACEHOLDER, label)
        problem = None
        if not label:
            problem = "has no letter or digit to make a namespace name of"
        elif len(name) > _DNS_LABEL_MAX or not DNS_LABEL.match(name):
            problem = (
                f"makes {name!r} under namespace_pattern={self.pattern}, which is not a namespace name "
                f"({_NAMESPACE_RULE})"
            )
        elif reserved_namespace(name):
            problem = f"makes {name!r} under namespace_pattern={self.pattern}: {reserved_namespace(name)}"
        elif name == self.default:
            problem = f"makes {name!r} under namespace_pattern={self.pattern}, the namespace of jobs without an owner"
        if problem:
            raise Rejected(f"tenant {tenant} {problem}; on {self.cluster}, {fix}")
        return name


def namespace_manifest(name: str, *, tag: str, tenant: str | None) -> dict[str, Any]:
    """The Namespace gpush creates: labelled as gpush's, and with its tenant when it is one's."""
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_BROKER: tag}
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if tenant is not None:
        labels[LABEL_TENANT] = label_value(tenant, "tenant")
        metadata["annotations"] = {ANNOTATION_TENANT: tenant}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": metadata}


def claimed_by(namespace: Mapping[str, Any], tag: str) -> str | None:
    """The tenant a namespace holds the jobs of, as gpush (this ``tag``) marked it; None when
    it is not marked so (an admin's own namespace, or the default one)."""
    metadata = namespace.get("metadata") or {}
    if (metadata.get("labels") or {}).get(LABEL_BROKER) != tag:
        return None
    return (metadata.get("annotations") or {}).get(ANNOTATION_TENANT)


# -- quotas ----------------------------------------------------------------------------


def resource_of(unit: CapacityUnit) -> str:
    """The extended resource a Pod asks for to get ``unit``: ``nvidia.com/mig-<profile>`` for
    a slice under the mixed strategy (the inventory names it), ``nvidia.com/gpu`` otherwise
    (whole GPUs, time-slice replicas, and slices under the single strategy)."""
    if unit.sharing == Sharing.K8S_MIG and unit.labels.get("resource"):
        return str(unit.labels["resource"])
    return GPU_RESOURCE


def gpu_resources(units: Iterable[CapacityUnit]) -> dict[str, tuple[float, ...]]:
    """Each GPU resource the nodes offer -> the GPU-equivalents one unit of it is worth, each
    distinct amount once, smallest first (``nvidia.com/gpu`` -> ``(0.25, 1.0)`` on a cluster of
    T4s split 4 ways and whole H100s)."""
    found: dict[str, set[float]] = {}
    for unit in units:
        if unit.gpu_equivalent > 0:
            found.setdefault(resource_of(unit), set()).add(round(unit.gpu_equivalent, 9))
    return {name: tuple(sorted(amounts)) for name, amounts in sorted(found.items())}


def quota_counts(gpu_quota: float, resources: Mapping[str, Iterable[float]]) -> dict[str, int]:
    """Per resource, the largest count that alone stays within ``gpu_quota`` GPU-equivalents,
    counted by its smallest unit (see the module docstring for why)."""
    if gpu_quota < 0:
        raise ValueError(f"a GPU quota of {gpu_quota:g}: quotas are 0 or more GPU-equivalents")
    counts = {}
    for name, amounts in resources.items():
        smallest = min(amounts)
        counts[name] = math.floor(round(gpu_quota / smallest, _DIGITS))
    return counts


def hard_limits(counts: Mapping[str, int]) -> dict[str, str]:
    """``spec.hard`` of the ResourceQuota: extended resources are quota'd as ``requests.<name>`` only."""
    return {f"requests.{name}": str(count) for name, count in sorted(counts.items())}


def resource_quota(namespace: str, *, tenant: str, tag: str, gpu_quota: float, hard: Mapping[str, str]) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": QUOTA_NAME,
            "namespace": namespace,
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_BROKER: tag, LABEL_TENANT: label_value(tenant, "tenant")},
            "annotations": {ANNOTATION_TENANT: tenant, "gpush.io/gpu-quota": f"{gpu_quota:g}"},
        },
        "spec": {"hard": dict(hard)},
    }


@dataclass(frozen=True)
class TenantQuota:
    """One tenant's namespace and the ResourceQuota that backs its GPU quota there."""

    tenant: str
    namespace: str
    gpu_quota: float
    hard: Mapping[str, str]
    namespace_body: Mapping[str, Any]
    quota_body: Mapping[str, Any]


@dataclass(frozen=True)
class TenantQuotaPlan:
    """What ``gpush tenant quota-yaml CLUSTER`` prints and the scheduler applies each cycle
    (only what changed): per tenant with a quota, its namespace and ResourceQuota.

    ``resources``: the GPU resources the cluster's nodes offer (see :func:`gpu_resources`); none
    known means nothing is applied (a cluster whose GPU nodes are all gone keeps its quotas).
    ``skipped``: tenants with a quota but no namespace of their own here, and why (in words
    that name the tenant). ``off``: why the cluster
    keeps no quotas per tenant (its tenants share one namespace), or None."""

    cluster: str
    entries: tuple[TenantQuota, ...] = ()
    skipped: tuple[tuple[str, str], ...] = ()
    resources: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    off: str | None = None

    def by_namespace(self) -> dict[str, TenantQuota]:
        return {entry.namespace: entry for entry in self.entries}

    def mixed(self) -> list[str]:
        """Lines saying which resources mean more than one amount, and how far their count lets the larger go."""
        lines = []
        for name, amounts in self.resources.items():
            if len(amounts) > 1:
                smallest, largest = amounts[0], amounts[-1]
                lines.append(
                    f"{name} is {_amounts(amounts)} GPU-equivalents on different nodes: counted by the smallest, "
                    f"so the quota never refuses a Pod the broker admitted; Pods made outside gpush could hold "
                    f"up to {largest / smallest:g}x the quota in the larger units"
                )
        return lines

    def to_yaml(self) -> str:
        """What ``kubectl apply -f -`` takes: per tenant its Namespace and ResourceQuota, and
        comments saying what the counts mean and which tenants have none."""
        header = [f"# GPU quotas of the tenants of {self.cluster}, as ResourceQuotas in their namespaces."]
        if self.off:
            return "\n".join([*header, f"# {self.off}"]) + "\n"
        header += [
            "# The broker's own ledger holds each tenant to its combined budget across every GPU kind;",
            "# a ResourceQuota caps each resource name on its own, so each count below is the largest that",
            "# alone stays within the tenant's quota: the cluster-side backstop (Pods made outside gpush).",
            "# gpush applies these itself (the scheduler, when a quota or the cluster's GPUs change);",
            "# apply them with `kubectl apply -f -` where it may not.",
        ]
        if not self.resources:
            header.append("# No GPU resource is known on the cluster's nodes: there is nothing to quota yet.")
        header += [f"# {line}" for line in self.mixed()]
        header += [f"# no ResourceQuota: {why}" for _tenant, why in self.skipped]
        if not self.entries:
            header.append("# No tenant has a GPU quota (gpush tenant set NAME --gpu-quota Q sets one).")
        parts = ["\n".join(header)]
        for entry in self.entries if self.resources else ():
            parts.append(
                f"# tenant {entry.tenant}: {entry.gpu_quota:g} GPU-equivalents, namespace {entry.namespace}\n"
                + yaml.safe_dump(dict(entry.namespace_body), sort_keys=False).rstrip()
            )
            parts.append(yaml.safe_dump(dict(entry.quota_body), sort_keys=False).rstrip())
        return "\n---\n".join(parts) + "\n"


def _amounts(amounts: Iterable[float]) -> str:
    return " or ".join(_fraction(a) for a in amounts)


def _fraction(amount: float) -> str:
    """1/4 rather than 0.25 where a small denominator says it exactly (as people count GPU shares)."""
    for denominator in range(1, 65):
        numerator = round(amount * denominator)
        if numerator and abs(numerator / denominator - amount) < 1e-6:
            return str(numerator) if denominator == 1 else f"{numerator}/{denominator}"
    return f"{amount:g}"


def plan_quotas(
    quotas: Mapping[str, float | None],
    namespaces: TenantNamespaces,
    resources: Mapping[str, tuple[float, ...]],
    *,
    tag: str,
) -> TenantQuotaPlan:
    """The namespaces and ResourceQuotas of the tenants with a quota in ``quotas`` (tenant ->
    GPU-equivalents; None or absent: no quota) on a cluster offering ``resources``."""
    if not namespaces.per_tenant:
        return TenantQuotaPlan(
            namespaces.cluster,
            off=(
                f"{namespaces.cluster} runs every tenant's jobs in namespace {namespaces.default} "
                "(namespace_mode=shared): the broker's ledger alone holds tenants to their quotas there. "
                "namespace_mode=per-tenant gives each tenant a namespace and a ResourceQuota."
            ),
        )
    entries: list[TenantQuota] = []
    skipped: list[tuple[str, str]] = []
    claimed: dict[str, str] = {}
    for tenant, gpu_quota in sorted(quotas.items()):
        if gpu_quota is None:
            continue
        try:
            namespace = namespaces.tenant_namespace(tenant)
        except Rejected as exc:
            skipped.append((tenant, str(exc)))
            continue
        if namespace in claimed:
            skipped.append((tenant, f"tenant {tenant}'s namespace {namespace} is tenant {claimed[namespace]}'s"))
            continue
        claimed[namespace] = tenant
        hard = hard_limits(quota_counts(gpu_quota, resources))
        entries.append(
            TenantQuota(
                tenant=tenant,
                namespace=namespace,
                gpu_quota=gpu_quota,
                hard=hard,
                namespace_body=namespace_manifest(namespace, tag=tag, tenant=tenant),
                quota_body=resource_quota(namespace, tenant=tenant, tag=tag, gpu_quota=gpu_quota, hard=hard),
            )
        )
    return TenantQuotaPlan(namespaces.cluster, tuple(entries), tuple(skipped), dict(resources))
