"""The Kubernetes adapter: gpush's adapter protocol (broker.core.adapter) over a Kubernetes API.

It turns placements into Jobs and Deployments (adapters.k8s.render), follows them by
watch (adapters.k8s.states says what each object state means), reads the node pool's
GPUs as inventory (adapters.k8s.inventory) and configures time-slicing
(adapters.k8s.timeslice). Only adapters.k8s.client talks to the API server. What a
caller may assume beyond the protocol's own guarantees:

- **Where jobs go.** With ``namespace_mode=shared`` (the default) every job goes to the
  cluster's ``namespace``. With ``namespace_mode=per-tenant`` each tenant's go to its own
  namespace (adapters.k8s.tenancy: ``tenant_namespaces``, ``namespace_pattern``), taken from
  the job's owner (the submitting token's tenant), never from the job spec; a job without an
  owner goes to ``namespace``. Namespaces are created on first use with
  ``create_namespace=true`` (labelled as gpush's and, a tenant's, with its tenant), else must
  exist: a job for one that does not is refused, naming ``kubectl create namespace``.
- **Finding its jobs.** Every object is named ``<tag>-<gpush id>`` and labelled
  ``gpush.io/broker=<tag>``, ``gpush.io/job-id=<id>``; ``find``, ``cancel``, ``scale`` and
  the status watches select by label, in the cluster's namespace or, with a namespace per
  tenant, in every namespace (so they work after a crash, whichever tenant a job is of).
  ``submit`` of a job whose object exists already in its namespace (a broker killed between
  the create and its database write) returns that object's id once its labels prove it is
  this job's; an object of that name that is not refuses the submission.
- **Backend ids** are ``job/<name>`` or ``deployment/<name>`` in the cluster's namespace
  (``namespace_mode=shared``), and ``<namespace>/job/<name>`` with a namespace per tenant;
  ids without a namespace (all those of earlier versions) mean the cluster's ``namespace``.
- **Tenants' quotas** (:class:`broker.core.adapter.TenantQuotaKeeper`, with a namespace per
  tenant): each tenant namespace holds a ResourceQuota ``gpush-gpu-quota`` rendered from the
  tenant's GPU quota (adapters.k8s.tenancy says how); it is written when gpush creates or first
  uses the namespace and whenever the quota or the cluster's GPU resources change, and deleted
  when the tenant's quota is removed. The broker's ledger is what holds tenants to their
  budgets; the ResourceQuota is the cluster-side backstop.
- **StatusTracker by watch.** The cursor holds the resourceVersions of the Pod, Job and
  Deployment watches of this broker's label. Each call watches the three side by
  side for at most ``watch_seconds`` (0.02 s: events not read yet wait for the next
  call, which the pod watch's wake-up (``notify_changes``) brings at once, so a longer
  wait only slows the scheduling cycle) and reports the jobs whose state or reason
  moved. The first call of a process, a cursor this process did not hand out, and a
  410 Gone (a resourceVersion the server has compacted) re-list everything and report
  every job's current state; after a restart the old cursor is also watched once for
  objects deleted meanwhile. A dropped connection is resumed at the next call.
  Objects deleted by someone other than gpush are reported cancelled, or lost (queued
  again) when they never started.
- **Inventory** (adapters.k8s.inventory): per node, time-slicing per physical GPU,
  MIG per profile, whole GPUs; Pod requests of the whole cluster count as allocated
  (with permission to list Pods in every namespace; else this namespace's, which the
  records' labels say). Nodes and Pods come from watch-fed caches
  (adapters.k8s.informer: one list, then a watch), so a cycle does not list the whole
  cluster; ``informers=false`` lists every time instead, Nodes read within
  ``cache_seconds`` sharing one listing.
- **Topology** (adapters.k8s.topology): with ``topology_levels`` (the network's levels, widest
  first, each a node label, as Kueue's Topology names them) every inventory record carries its
  node's domain at each level (None where the node lacks the label). Which device indexes are
  free, and which GPUs NVLink joins, Kubernetes does not say through its API: records leave
  ``free_gpus`` and ``gpu_topology`` None.
- **Where Pods run.** A gang's ranks may run only on the gang's nodes, a one-node Job's Pods
  only on its ``placement.node`` (required node affinity on the Nodes' names); an elastic job's
  Deployment only prefers its node, since ``scale`` may need others. Which GPUs a Pod gets on
  its node, Kubernetes gives the Pod no say in: the device plugin picks them (NVIDIA's picks
  NVLink-aligned whole GPUs itself, in its GetPreferredAllocation). gpush's own choice
  (``placement.gpus``) goes on the Pods as the annotation ``gpush.io/gpus``, for people to read,
  and never as ``CUDA_VISIBLE_DEVICES``, which would contradict what the plugin allocated.
- **Scale.** :meth:`KubernetesAdapter.scale` sets an elastic job's replicas through the
  Deployment's scale subresource; the broker decides whether the replicas fit.
- **NodeFencing** (:class:`broker.core.adapter.NodeFencer`) cordons a node and notes the reason in
  its ``gpush.io/fenced`` annotation; ``fenced`` lists only those, and ``unfence`` never lifts a
  cordon someone else set (adapters.k8s.mig).
- **MIG layouts** (:class:`broker.core.adapter.MigPublisher`) go through the GPU Operator's MIG
  manager: a mig-parted config per node in its ConfigMap (``mig_config``, or the ClusterPolicy's
  ``migManager.config.name``) and the node label ``nvidia.com/mig.config``; the MIG manager's
  ``nvidia.com/mig.config.state`` and the node's allocatable say when the layout is offered.
  Instance placements do not reach the cluster (adapters.k8s.mig says what follows from that).
- **Speed.** ``submit_many`` creates a batch on several threads (``submit_threads``).
- **Output** (:meth:`KubernetesAdapter.logs`): a job's output is its Pod's log (``pods/log``),
  replica K being the K-th of the job's Pods (by completion index, then age). Kubernetes keeps
  stdout and stderr as one log, so both streams answer it. A Pod that is gone took its log with
  it: the answer says so (``readable`` False) and names the Pod; a Pod whose container has not
  started is :class:`Rejected`. Offsets count characters; the API cannot start a log at an
  offset, so a read takes the log from its start up to ``offset`` plus one chunk (bounded by
  ``limitBytes``), and a ``tail`` read counts the whole log (up to ``LOG_SCAN_BYTES``) to
  say where following it continues.

The adapter is thin: each concern is a class of its own module, handed the one
:class:`adapters.k8s.context.KubeContext` (settings, client, the objects' whereabouts), and the
adapter's methods delegate to them. adapters.k8s.settings holds the settings;
adapters.k8s.jobs submits, cancels, preempts, finds and scales; adapters.k8s.status pages
statuses; adapters.k8s.logs reads output; adapters.k8s.capacity reads Nodes and Pods and the
inventory; adapters.k8s.namespaces makes namespaces ready and keeps the tenants' quotas;
adapters.k8s.nodes fences and sets nodes up; adapters.k8s.mig_publish publishes MIG layouts;
adapters.k8s.health checks the cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from adapters.k8s.capacity import Capacity, NodesAndPods
from adapters.k8s.client import KubeClient
from adapters.k8s.context import KubeContext
from adapters.k8s.health import check_health
from adapters.k8s.jobs import Jobs
from adapters.k8s.logs import JobLogs
from adapters.k8s.mig_publish import MigPublishing
from adapters.k8s.namespaces import Namespaces, TenantQuotas
from adapters.k8s.nodes import NodeFencing, NodeSetup
from adapters.k8s.settings import KubernetesSettings
from adapters.k8s.status import StatusTracker
from adapters.k8s.tenancy import TenantQuotaPlan
from adapters.k8s.timeslice import (
    TimeslicePlan,
    TimesliceState,
    apply_timeslice,
    read_timeslice,
    render_timeslice,
)
from adapters.settings import load_settings
from broker.core.adapter import (
    AdapterError,
    BackendJob,
    BatchSubmitter,
    CapacityUnit,
    ChangeNotifier,
    Closable,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    NodeConfigurer,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    Scaler,
    StatusPage,
    SubmitItem,
    TenantQuotaKeeper,
    TimesliceConfigurator,
)
from broker.core.clock import Clock, utcnow
from broker.core.schemas import JobSpec

__all__ = ["KubernetesAdapter", "KubernetesSettings"]


class KubernetesAdapter:
    """gpush's adapter for one Kubernetes cluster (see the module docstring)."""

    capabilities: ClassVar[frozenset[type]] = frozenset(
        {
            BatchSubmitter,
            Scaler,
            TimesliceConfigurator,
            Closable,
            LogReader,
            ChangeNotifier,
            TenantQuotaKeeper,
            Preemptor,
            NodeFencer,
            MigPublisher,
            NodeConfigurer,
        }
    )
    # The GPU Operator's MIG manager changes the GPU when the layout is published: no node
    # agent may change it too.
    changes_gpus: ClassVar[bool] = True

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        *,
        clock: Clock | None = None,
        client: KubeClient | None = None,
    ):
        self.settings = load_settings(KubernetesSettings, config, cluster=f"Kubernetes cluster {name}")
        self.name = name
        self.clock = clock or utcnow
        self.context = ctx = KubeContext(name, self.settings, client)
        self.client = ctx.client
        self.namespace, self.tag, self.tenancy = ctx.namespace, ctx.tag, ctx.tenancy
        self.gpu_types, self.options = ctx.gpu_types, ctx.options
        self.cache = NodesAndPods(ctx)
        self.capacity = Capacity(ctx, self.cache)
        self.quotas = TenantQuotas(ctx, self.capacity)
        self.jobs = Jobs(ctx, Namespaces(ctx, self.quotas), self.capacity)
        self.tracker = StatusTracker(ctx)
        self.job_logs = JobLogs(ctx)
        self.fencing = NodeFencing(ctx)
        self.node_setup = NodeSetup(ctx)
        self.mig = MigPublishing(ctx, self.cache)

    # -- jobs (adapters.k8s.jobs, adapters.k8s.status, adapters.k8s.logs) ----------------------

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        return self.jobs.submit(job_id, spec, placement, owner)

    def submit_many(self, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
        return self.jobs.submit_many(items)

    def cancel(self, job_id: int) -> None:
        self.jobs.cancel(job_id)

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        self.jobs.preempt(job_id, signal, grace_seconds)

    def find(self, job_id: int) -> BackendJob | None:
        return self.jobs.find(job_id)

    def scale(self, job_id: int, replicas: int) -> int:
        return self.jobs.scale(job_id, replicas)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        return self.tracker.statuses(cursor)

    def logs(
        self,
        job_id: int,
        backend_id: str,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> JobOutput:
        return self.job_logs.read(job_id, backend_id, stream, replica, offset, tail)

    # -- the cluster (adapters.k8s.capacity, adapters.k8s.health) ------------------------------

    def inventory(self) -> list[CapacityUnit]:
        return self.capacity.inventory()

    def notify_changes(self, callback: Callable[[], None] | None) -> None:
        self.cache.notify_changes(callback)

    def health(self) -> Health:
        return check_health(self.context)

    def close(self) -> None:
        self.cache.close()

    # -- tenants (adapters.k8s.namespaces) -----------------------------------------------------

    def tenant_quotas(self, quotas: Mapping[str, float | None]) -> TenantQuotaPlan:
        return self.quotas.tenant_quotas(quotas)

    def apply_tenant_quotas(self, plan: TenantQuotaPlan) -> list[str]:
        return self.quotas.apply_tenant_quotas(plan)

    # -- nodes (adapters.k8s.nodes, adapters.k8s.mig_publish, adapters.k8s.timeslice) ----------

    def fence(self, node: str, reason: str) -> None:
        self.fencing.fence(node, reason)

    def unfence(self, node: str) -> None:
        self.fencing.unfence(node)

    def fenced(self) -> dict[str, str]:
        return self.fencing.fenced()

    def configure_node(self, node: str, setup: Mapping[str, str]) -> None:
        self.node_setup.configure_node(node, setup)

    def node_configured(self, node: str, setup: Mapping[str, str]) -> bool | None:
        return self.node_setup.node_configured(node, setup)

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        self.mig.publish_mig(node, gpu, instances, reported)

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        return self.mig.mig_published(node, gpu)

    def timeslice(self, replicas: int, node_label: str | None = None) -> TimeslicePlan:
        """The time-slicing ConfigMap and ClusterPolicy patch for this cluster (not applied)."""
        return render_timeslice(replicas, node_label=node_label, config_map=self.settings.timeslice_config)

    def apply_timeslice(self, plan: TimeslicePlan) -> list[str]:
        """Apply a plan from :meth:`timeslice`; returns what changed."""
        return apply_timeslice(self.client, plan)

    def timeslice_state(self) -> TimesliceState | None:
        return read_timeslice(self.client, self.settings.timeslice_config)
