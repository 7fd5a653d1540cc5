"""The namespaces gpush's jobs go to, as the cluster holds them, and the tenants' ResourceQuotas in them.

:class:`Namespaces` makes a job's namespace ready before its first object: there (created with
``create_namespace=true``) and, for a tenant's, not another tenant's; checked once per namespace
and process (:class:`adapters.k8s.context.KubeContext` keeps which). :class:`TenantQuotas`
(TenantQuotaKeeper) writes each tenant namespace's ResourceQuota from the plan
adapters.k8s.tenancy renders, and deletes gpush's own where the tenant's quota went.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

from adapters.k8s.capacity import Capacity
from adapters.k8s.client import AlreadyExists, NotFound
from adapters.k8s.context import KubeContext
from adapters.k8s.render import selector
from adapters.k8s.tenancy import QUOTA_NAME, TenantQuota, TenantQuotaPlan, claimed_by, namespace_manifest, plan_quotas
from broker.core.adapter import AdapterError, Rejected

log = logging.getLogger("gpush.k8s")

# After the API refused a tenant's ResourceQuota, or a tenant's namespace was not there, how
# long before trying again: the scheduler hands the quotas over every cycle.
QUOTA_RETRY_SECONDS = 60.0


class TenantQuotas:
    """The tenants' ResourceQuotas on one cluster (TenantQuotaKeeper); one writer at a time."""

    def __init__(self, ctx: KubeContext, capacity: Capacity):
        self.ctx = ctx
        self.capacity = capacity
        self._quota_lock = threading.RLock()
        self._quota_plan: dict[str, TenantQuota] = {}  # namespace -> what the last plan wants there
        self._quotas_applied: dict[str, dict[str, str]] | None = None  # namespace -> spec.hard; None: not read
        self._quota_absent: dict[str, float] = {}  # tenant namespaces not there yet -> when looked (monotonic)
        self._quota_retry_at = 0.0

    def tenant_quotas(self, quotas: Mapping[str, float | None]) -> TenantQuotaPlan:
        """The tenants' namespaces and ResourceQuotas (TenantQuotaKeeper; adapters.k8s.tenancy),
        not applied. The GPU resources are those of the last inventory read (read now if none was)."""
        ctx = self.ctx
        resources = self.capacity.gpu_resources()
        if resources is None and ctx.tenancy.per_tenant:
            self.capacity.inventory()
            resources = self.capacity.gpu_resources()
        return plan_quotas(quotas, ctx.tenancy, resources or {}, tag=ctx.tag)

    def apply_tenant_quotas(self, plan: TenantQuotaPlan) -> list[str]:
        """Bring the tenants' ResourceQuotas in line with ``plan`` (from :meth:`tenant_quotas`):
        create or replace those that differ, in the tenant namespaces that exist (a namespace
        gpush creates later gets its quota then), and delete gpush's own in namespaces whose
        tenant has no quota now. Returns what changed; nothing when the plan is off or knows no
        GPU resources. After a failure it tries again only after QUOTA_RETRY_SECONDS, so an API
        that refuses it is reported once a minute, not every cycle."""
        if plan.off or not plan.resources:
            return []
        with self._quota_lock:
            now = time.monotonic()
            if now < self._quota_retry_at:
                return []
            try:
                return self._apply_quotas(plan, now)
            except AdapterError:
                self._quota_retry_at = now + QUOTA_RETRY_SECONDS
                raise

    def _apply_quotas(self, plan: TenantQuotaPlan, now: float) -> list[str]:
        ctx = self.ctx
        wanted = plan.by_namespace()
        self._quota_plan = wanted
        if self._quotas_applied is None:
            # What an earlier process left: written again only where it differs, deleted where
            # the tenant's quota went while no broker was looking.
            found, _ = ctx.list_in("resourcequotas", None, selector(ctx.tag))
            self._quotas_applied = {
                ctx.namespace_of(q): dict((q.get("spec") or {}).get("hard") or {})
                for q in found
                if q["metadata"]["name"] == QUOTA_NAME
            }
        applied = self._quotas_applied
        done: list[str] = []
        for namespace, entry in wanted.items():
            if applied.get(namespace) == dict(entry.hard):
                continue
            if namespace not in applied and not ctx.namespace_known(namespace):
                looked = self._quota_absent.get(namespace)
                if looked is not None and now - looked < QUOTA_RETRY_SECONDS:
                    continue
                if ctx.client.get("namespaces", None, namespace) is None:
                    self._quota_absent[namespace] = now  # its tenant has not run here yet
                    continue
            self._quota_absent.pop(namespace, None)
            said = self._write_quota(entry)
            if said:
                done.append(said)
        for namespace in sorted(set(applied) - set(wanted)):
            ctx.client.delete("resourcequotas", namespace, QUOTA_NAME)
            del applied[namespace]
            done.append(f"deleted ResourceQuota {namespace}/{QUOTA_NAME}: its tenant has no GPU quota here now")
        return done

    def _write_quota(self, entry: TenantQuota) -> str | None:
        """Create or replace one tenant's ResourceQuota (``_quota_lock`` held); what changed,
        or None when its namespace has gone meanwhile."""
        client = self.ctx.client
        namespace = entry.namespace
        applied = self._quotas_applied if self._quotas_applied is not None else {}
        try:
            if namespace in applied:
                try:
                    client.replace("resourcequotas", namespace, QUOTA_NAME, entry.quota_body)
                    verb = "updated"
                except NotFound:
                    client.create("resourcequotas", namespace, entry.quota_body)
                    verb = "created"
            else:
                try:
                    client.create("resourcequotas", namespace, entry.quota_body)
                    verb = "created"
                except AlreadyExists:
                    client.replace("resourcequotas", namespace, QUOTA_NAME, entry.quota_body)
                    verb = "updated"
        except NotFound:  # the namespace itself is gone
            applied.pop(namespace, None)
            self.ctx.forget_namespace(namespace)
            return None
        applied[namespace] = dict(entry.hard)
        limits = ", ".join(f"{key.removeprefix('requests.')} {value}" for key, value in entry.hard.items())
        return (
            f"{verb} ResourceQuota {namespace}/{QUOTA_NAME} of tenant {entry.tenant} "
            f"({entry.gpu_quota:g} GPU-equivalents): {limits}"
        )

    def quota_for_new_namespace(self, namespace: str) -> None:
        """A tenant namespace this process just created or checked gets the quota the last plan
        wants there at once, not at the next apply. A failure is the next apply's to report."""
        with self._quota_lock:
            entry = self._quota_plan.get(namespace)
            applied = self._quotas_applied
            if entry is None or applied is None or applied.get(namespace) == dict(entry.hard):
                return
            self._quota_absent.pop(namespace, None)
            try:
                self._write_quota(entry)
            except AdapterError as exc:
                log.warning(
                    "%s: the ResourceQuota of namespace %s is not written yet: %s", self.ctx.name, namespace, exc
                )


class Namespaces:
    """The namespaces jobs are created in, made ready on first use (see the module docstring)."""

    def __init__(self, ctx: KubeContext, quotas: TenantQuotas):
        self.ctx = ctx
        self.quotas = quotas

    def ensure(self, namespace: str, tenant: str | None) -> None:
        """``namespace`` is there (created with ``create_namespace=true``) and, for a tenant's,
        not another tenant's (two whose names make the same namespace): checked once per
        namespace and process. A tenant's namespace gets its ResourceQuota here when the
        scheduler has handed the quotas over already."""
        ctx = self.ctx
        key = (namespace, tenant)
        if key in ctx.ready:
            return
        with ctx.namespace_lock:
            if key in ctx.ready:
                return
            existing = ctx.client.get("namespaces", None, namespace)
            if existing is None:
                if not ctx.settings.create_namespace:
                    raise Rejected(self.missing(namespace, tenant))
                body = namespace_manifest(namespace, tag=ctx.tag, tenant=tenant)
                if not ctx.client.create_namespace(namespace, body):  # made meanwhile by another
                    existing = ctx.client.get("namespaces", None, namespace)
            holder = claimed_by(existing, ctx.tag) if existing is not None and tenant is not None else None
            if holder is not None and holder != tenant:
                raise Rejected(
                    f"namespace {namespace} holds tenant {holder}'s jobs on {ctx.name}, and tenant {tenant} "
                    "maps to it too: give one of them a namespace of its own "
                    f"(--config tenant_namespaces={tenant}=NAMESPACE)"
                )
            ctx.ready.add(key)
        if tenant is not None:
            self.quotas.quota_for_new_namespace(namespace)

    def missing(self, namespace: str, tenant: str | None) -> str:
        """What to say of ``namespace`` (``tenant``'s, when one's) when it does not exist."""
        whose = f" (tenant {tenant}'s)" if tenant is not None else ""
        return (
            f"namespace {namespace}{whose} does not exist in {self.ctx.name}: create it "
            f"(kubectl create namespace {namespace}) or set create_namespace=true"
        )
