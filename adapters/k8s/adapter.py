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
- **Statuses by watch.** The cursor holds the resourceVersions of the Pod, Job and
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
- **Scale.** :meth:`KubernetesAdapter.scale` sets an elastic job's replicas through the
  Deployment's scale subresource; the broker decides whether the replicas fit.
- **Fencing** (:class:`broker.core.adapter.NodeFencer`) cordons a node and notes the reason in
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
  ``limitBytes``), and a ``tail`` read counts the whole log (up to :data:`LOG_SCAN_BYTES`) to
  say where following it continues.
"""

from __future__ import annotations

import codecs
import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from adapters.k8s import quantity
from adapters.k8s.client import AlreadyExists, Conflict, Gone, KubeClient, NotFound, WatchBatch
from adapters.k8s.informer import Informer, trim_pod
from adapters.k8s.inventory import gpu_requests_by_node, node_units
from adapters.k8s.mig import (
    DEFAULT_MIG_CONFIG,
    FENCED_ANNOTATION,
    FENCED_OVER_CORDON,
    MIG_CONFIG_LABEL,
    MIG_PARTED_KEY,
    MIG_STATE_LABEL,
    PUBLISHED_ANNOTATION,
    MigConfigError,
    caught_up,
    config_names,
    counts_of,
    current_layouts,
    instances_of,
    merge_config,
    next_config_name,
    node_gpu_count,
    parse_configs,
    published_record,
    render_entries,
    resolve,
    whole_gpus,
)
from adapters.k8s.render import (
    CONTAINER,
    DEVICE_PLUGIN_CONFIG,
    GFD_PRODUCT,
    LABEL_BROKER,
    MIG_RESOURCE_PREFIX,
    Manifest,
    RenderOptions,
    check_tag,
    default_gpu_types,
    job_id_of,
    model_of_product,
    object_name,
    product_names,
    render,
    selector,
)
from adapters.k8s.states import Observed, backend_job
from adapters.k8s.tenancy import (
    PER_TENANT,
    QUOTA_NAME,
    SHARED,
    TenantNamespaces,
    TenantQuota,
    TenantQuotaPlan,
    check_namespace,
    check_pattern,
    claimed_by,
    gpu_resources,
    namespace_manifest,
    plan_quotas,
)
from adapters.k8s.timeslice import (
    CLUSTER_POLICY,
    DEFAULT_CONFIG,
    TimeslicePlan,
    TimesliceState,
    apply_timeslice,
    parse_ref,
    read_timeslice,
    render_timeslice,
)
from adapters.settings import key_value_pairs, load_settings
from broker.core.adapter import (
    MAX_LOG_CHUNK,
    PREEMPT_SIGNALS,
    AdapterError,
    BackendJob,
    BackendState,
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
    Rejected,
    Scaler,
    StatusPage,
    SubmitItem,
    TenantQuotaKeeper,
    TimesliceConfigurator,
    Unreachable,
    submit_each,
)
from broker.core.clock import Clock, utcnow
from broker.core.gpus import GpuModel, gpu_model
from broker.core.schemas import JobSpec
from broker.mig.layouts import MigSlot, layout_problem

log = logging.getLogger("gpush.k8s")

WATCHED = ("pods", "jobs", "deployments")
# The most of a log a ``tail`` read takes in to count where the log ends (``next_offset``); a
# longer log is tailed by the kubelet (``tailLines``) and its end is not known exactly.
LOG_SCAN_BYTES = 16 * MAX_LOG_CHUNK
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # Indexed Jobs' Pods carry it
BOTH_STREAMS = "Kubernetes keeps a container's stdout and stderr as one log: this is both, interleaved."
_CURSOR_VERSION = 1
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
# After the API refused a tenant's ResourceQuota, or a tenant's namespace was not there, how
# long before trying again: the scheduler hands the quotas over every cycle.
QUOTA_RETRY_SECONDS = 60.0
RBAC_FILE = "deploy/k8s/gpush-broker-rbac.yaml"


class KubernetesSettings(BaseModel):
    """A Kubernetes cluster's config (``gpush cluster add NAME --kind k8s --config KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    kubeconfig: str | None = Field(
        None, description="kubeconfig path; 'in-cluster' for the broker Pod's service account; default $KUBECONFIG"
    )
    context: str | None = Field(None, description="kubeconfig context (default: its current-context)")
    namespace: str = Field(
        "gpush",
        pattern=_DNS_LABEL,
        description="where gpush's Jobs and Deployments go (with namespace_mode=per-tenant: those without an owner)",
    )
    create_namespace: bool = Field(False, description="create namespaces (the tenants' too) on first use")
    namespace_mode: Literal["shared", "per-tenant"] = Field(
        SHARED,
        description="shared: every tenant's jobs in namespace; per-tenant: each tenant's in its own "
        "(tenant_namespaces, namespace_pattern), with a ResourceQuota from its GPU quota",
    )
    tenant_namespaces: dict[str, str] = Field(
        default_factory=dict, description="tenant -> its namespace (per-tenant): vision=cv-jobs,nlp=nlp-jobs"
    )
    namespace_pattern: str | None = Field(
        None,
        description="the namespace of a tenant that tenant_namespaces does not name (per-tenant), {tenant} "
        "being its name made a DNS label: gpush-{tenant}",
    )
    tag: str = Field("gpush", description="names this broker's objects (<tag>-<id>) and labels them")
    image: str | None = Field(None, description="image for jobs that name none")
    service_account: str | None = Field(None, description="service account of the Pods (default: none mounted)")
    run_as_user: int = Field(1000, ge=1, description="the non-root uid Pods run as")
    priority_class: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, description="added to every Pod: KEY=VALUE,...")
    timeslice_config: str = Field(DEFAULT_CONFIG, description="NAMESPACE/NAME of the time-slicing ConfigMap")
    mig_config: str = Field(
        DEFAULT_MIG_CONFIG,
        description="NAMESPACE/NAME of the GPU Operator's mig-parted ConfigMap (the ClusterPolicy's "
        "migManager.config.name, when set, names it instead)",
    )
    gpu_types: dict[str, str] = Field(default_factory=dict, description="nvidia.com/gpu.product -> GPU model")
    submit_threads: int = Field(8, ge=1, le=64)
    watch_seconds: float = Field(0.02, gt=0, le=30, description="longest a status read waits for events")
    cache_seconds: float = Field(1.0, ge=0)
    informers: bool = Field(True, description="keep Nodes and Pods by watch instead of listing them each cycle")
    timeout: float = Field(30.0, gt=0)

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str) -> str:
        return check_tag(value)

    @field_validator("node_selector", mode="before")
    @classmethod
    def _selector_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "node_selector", "pool=gpu,zone=a")

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _type_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "gpu_types", "NVIDIA-A100-SXM4-80GB=A100-SXM4-80GB")

    @field_validator("gpu_types")
    @classmethod
    def _known_models(cls, value: dict[str, str]) -> dict[str, str]:
        return {product: gpu_model(model).name for product, model in value.items()}

    @field_validator("tenant_namespaces", mode="before")
    @classmethod
    def _tenant_pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "tenant_namespaces", "vision=cv-jobs,nlp=nlp-jobs", form="TENANT=NAMESPACE")

    @field_validator("tenant_namespaces")
    @classmethod
    def _one_namespace_each(cls, value: dict[str, str]) -> dict[str, str]:
        held: dict[str, str] = {}
        for tenant, namespace in value.items():
            check_namespace(namespace, f"tenant {tenant}'s namespace")
            if namespace in held:
                raise ValueError(
                    f"tenants {held[namespace]} and {tenant} both map to namespace {namespace}: give each tenant "
                    "a namespace of its own (its ResourceQuota is that tenant's GPU quota)"
                )
            held[namespace] = tenant
        return value

    @field_validator("namespace_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        return None if value is None else check_pattern(value)

    @model_validator(mode="after")
    def _tenancy(self) -> KubernetesSettings:
        given = [key for key in ("tenant_namespaces", "namespace_pattern") if getattr(self, key)]
        if self.namespace_mode == SHARED and given:
            raise ValueError(
                f"{' and '.join(given)} take effect with namespace_mode=per-tenant: add "
                f"--config namespace_mode=per-tenant, or leave {'them' if len(given) > 1 else 'it'} out"
            )
        if self.namespace_mode == PER_TENANT:
            if not given:
                raise ValueError(
                    "namespace_mode=per-tenant needs tenant_namespaces (TENANT=NAMESPACE,...), namespace_pattern "
                    "(e.g. gpush-{tenant}), or both, to say where each tenant's jobs go"
                )
            for tenant, namespace in self.tenant_namespaces.items():
                if namespace == self.namespace:
                    raise ValueError(
                        f"tenant_namespaces maps tenant {tenant} to {namespace}, the namespace of jobs without an "
                        "owner (namespace): give the tenant a namespace of its own"
                    )
        return self


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
        s = self.settings
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
        self._scope: str | None = None if self.tenancy.per_tenant else s.namespace
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
        self._lock = threading.RLock()
        self._status_lock = threading.Lock()  # one status read at a time: it owns the watch state
        self._namespace_lock = threading.Lock()
        self._ready: set[tuple[str, str | None]] = set()  # (namespace, tenant) there and checked
        # Tenants' ResourceQuotas (apply_tenant_quotas); one writer at a time.
        self._quota_lock = threading.RLock()
        self._quota_plan: dict[str, TenantQuota] = {}  # namespace -> what the last plan wants there
        self._quotas_applied: dict[str, dict[str, str]] | None = None  # namespace -> spec.hard; None: not read
        self._quota_absent: dict[str, float] = {}  # tenant namespaces not there yet -> when looked (monotonic)
        self._quota_retry_at = 0.0
        self._resources: dict[str, tuple[float, ...]] | None = None  # GPU resources of the last inventory
        self._watchers = ThreadPoolExecutor(len(WATCHED), thread_name_prefix=f"k8s-watch-{name}")
        self._seen: dict[int, Observed] = {}
        self._ids: dict[int, str] = {}  # gpush id -> backend id
        self._versions: dict[str, str] | None = None  # what the last status page's cursor said
        self._reported: dict[int, tuple[BackendState, str | None]] = {}
        self._cancelled: set[int] = set()
        self._gone: set[int] = set()  # jobs whose object was deleted: their Pods' events are late news
        self._node_listing: tuple[float, list[dict[str, Any]]] | None = None
        self._node_cache = Informer(self.client, "nodes", name=f"{name}-nodes")
        # Cluster-wide; None once the cluster said this broker may not list Pods everywhere.
        self._pod_cache: Informer | None = Informer(
            self.client, "pods", trim=trim_pod, name=f"{name}-pods", on_event=self._pod_changed
        )
        self._on_change: Callable[[], None] | None = None
        self._products: dict[str, set[str]] = {}  # GPU model -> product labels seen on nodes

    # -- the protocol ------------------------------------------------------------------

    def notify_changes(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` when the pod watch sees a Pod of this broker's jobs change
        (ChangeNotifier): the scheduler then reads statuses at once. The watch starts with
        the first inventory read."""
        self._on_change = callback

    def _pod_changed(self, pod: dict[str, Any]) -> None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        callback = self._on_change
        if callback is not None and labels.get(LABEL_BROKER) == self.tag:
            callback()

    def health(self) -> Health:
        try:
            version = str(self.client.version().get("gitVersion") or "?")
        except AdapterError as exc:
            return Health(False, f"Kubernetes cluster {self.name} does not answer: {exc}")
        try:
            namespace = self.client.get("namespaces", None, self.namespace)
        except AdapterError as exc:
            return Health(
                False,
                f"Kubernetes {version} answers, but namespace {self.namespace} is not readable: {exc}{_rbac_hint(exc)}",
            )
        if not self.tenancy.per_tenant:
            if namespace is None and not self.settings.create_namespace:
                return Health(
                    False,
                    f"Kubernetes {version} answers, but namespace {self.namespace} does not exist: create it "
                    f"(kubectl create namespace {self.namespace}) or set create_namespace=true",
                    version,
                )
            said = "created on first use" if namespace is None else "readable"
            return Health(True, f"Kubernetes {version}: namespace {self.namespace} {said}", version)
        # A namespace per tenant: the broker finds its jobs by label in every namespace.
        try:
            self.client.peek("jobs", None, label_selector=selector(self.tag))
        except AdapterError as exc:
            return Health(
                False,
                f"Kubernetes {version} answers, but with a namespace per tenant the broker must list and watch "
                f"Jobs, Deployments and Pods in every namespace, and listing Jobs failed: {exc}{_rbac_hint(exc)}",
                version,
            )
        created = "created on first use" if self.settings.create_namespace else "created by an admin"
        return Health(True, f"Kubernetes {version}: a namespace per tenant ({created})", version)

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        namespace, tenant = self.tenancy.namespace_for(owner)
        if owner is not None:
            # Whose job it is, in its labels and environment too, is its owner's word, not the spec's.
            spec = spec.model_copy(update={"tenant": owner.tenant, "user": owner.user})
        options = self.options if namespace == self.options.namespace else replace(self.options, namespace=namespace)
        manifest = render(
            job_id,
            spec,
            placement,
            options,
            gpu_memory_gb=self._model_memory(placement.gpu_model),
            products=self._products_for(placement),
        )
        self._ensure_namespace(namespace, tenant)
        try:
            self._create(job_id, manifest, namespace)
        except NotFound:
            # The namespace went after this process saw it: made again where that is allowed.
            self._forget_namespace(namespace)
            if not self.settings.create_namespace:
                raise Rejected(self._no_namespace(namespace, tenant)) from None
            self._ensure_namespace(namespace, tenant)
            try:
                self._create(job_id, manifest, namespace)
            except NotFound as exc:
                raise Rejected(f"{self._no_namespace(namespace, tenant)} ({exc})") from None
        backend_id = self._id_in(namespace, manifest.backend_id)
        with self._lock:
            self._ids[job_id] = backend_id
            self._cancelled.discard(job_id)
        return backend_id

    def _create(self, job_id: int, manifest: Manifest, namespace: str) -> None:
        """Create the job's object; an object of its name that is this job's already (a broker
        killed between this create and its database write) counts as created."""
        try:
            self.client.create(manifest.kind, namespace, manifest.body)
        except AlreadyExists:
            existing = self.client.get(manifest.kind, namespace, manifest.name)
            if existing is None:  # deleted in between: this create is the one
                self.client.create(manifest.kind, namespace, manifest.body)
            elif job_id_of(existing, self.tag) != job_id:
                raise Rejected(
                    f"{manifest.backend_id} exists in namespace {namespace} of {self.name} but is not "
                    f"gpush job {job_id} of this broker (labels {(existing['metadata'].get('labels') or {})}): "
                    "delete it, or give this cluster another tag"
                ) from None

    def submit_many(self, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
        """Create a batch on several threads; per item the backend id or the AdapterError."""
        refused: dict[int, AdapterError] = {}
        if len(items) > 1:
            # Each namespace once, before the threads, which would race to create it; a
            # namespace that is refused refuses its items without asking again for each.
            checked: dict[tuple[str, str | None], AdapterError | None] = {}
            for index, item in enumerate(items):
                try:
                    key = self.tenancy.namespace_for(item[3] if len(item) > 3 else None)  # type: ignore[misc]
                except Rejected:
                    continue  # submit says so for this item
                if key not in checked:
                    try:
                        self._ensure_namespace(*key)
                        checked[key] = None
                    except AdapterError as exc:
                        checked[key] = exc
                failure = checked[key]
                if failure is not None:
                    refused[index] = failure
        left = [item for index, item in enumerate(items) if index not in refused]
        results = iter(submit_each(self, left, threads=self.settings.submit_threads))
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
        with self._lock:
            self._cancelled.add(job_id)
        for kind in ("jobs", "deployments", "pods"):
            # Pods too: a Job's are removed by the garbage collector in its own time, and
            # they hold their GPUs until then.
            for obj in self._owned(kind, job_id):
                self.client.delete(kind, self._namespace_of(obj), obj["metadata"]["name"], grace=grace)

    def find(self, job_id: int) -> BackendJob | None:
        seen = Observed()
        for kind in ("jobs", "deployments"):
            for obj in self._owned(kind, job_id):
                setattr(seen, "job" if kind == "jobs" else "deployment", obj)
        if seen.owner is None:
            return None
        seen.pods = {p["metadata"]["name"]: p for p in self._owned("pods", job_id, self._namespace_of(seen.owner))}
        seen.note_started()
        return backend_job(job_id, self._backend_id(job_id, seen), seen, self.name)

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

    def inventory(self) -> list[CapacityUnit]:
        nodes = self._nodes()
        pods, partial = self._bound_pods()
        held = gpu_requests_by_node(pods)
        try:
            timeslice = read_timeslice(self.client, self.settings.timeslice_config)
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
                self.name,
                node,
                held.get((node.get("metadata") or {}).get("name", ""), {}),
                gpu_types=self.gpu_types,
                expected_replicas=expected,
                expected_from=source,
            )
            for unit in found:
                if unit.labels.get("product"):
                    products.setdefault(unit.gpu_model, set()).add(unit.labels["product"])
            if partial:
                found = [_with_label(u, "allocation", partial) for u in found]
            units.extend(found)
        with self._lock:
            self._products = products
            self._resources = gpu_resources(units)
        return units

    # -- beyond the protocol -------------------------------------------------------------

    def scale(self, job_id: int, replicas: int) -> int:
        """Set an elastic job's replicas (its Deployment's scale subresource); returns them."""
        if replicas < 0:
            raise Rejected(f"replicas must be 0 or more, not {replicas}")
        deployments = self._owned("deployments", job_id)
        if not deployments:
            if self._owned("jobs", job_id):
                raise Rejected(
                    f"job {job_id} runs as a Kubernetes Job, which does not scale: only elastic inference does"
                )
            where = f"namespace {self.namespace}" if self._scope else "any namespace"
            raise Rejected(f"{self.name} has no Deployment for job {job_id} ({where})")
        deployment = deployments[0]
        answer = self.client.scale(self._namespace_of(deployment), deployment["metadata"]["name"], replicas)
        return int((answer.get("spec") or {}).get("replicas", replicas))

    def timeslice(self, replicas: int, node_label: str | None = None) -> TimeslicePlan:
        """The time-slicing ConfigMap and ClusterPolicy patch for this cluster (not applied)."""
        return render_timeslice(replicas, node_label=node_label, config_map=self.settings.timeslice_config)

    def apply_timeslice(self, plan: TimeslicePlan) -> list[str]:
        """Apply a plan from :meth:`timeslice`; returns what changed."""
        return apply_timeslice(self.client, plan)

    def timeslice_state(self) -> TimesliceState | None:
        return read_timeslice(self.client, self.settings.timeslice_config)

    def tenant_quotas(self, quotas: Mapping[str, float | None]) -> TenantQuotaPlan:
        """The tenants' namespaces and ResourceQuotas (TenantQuotaKeeper; adapters.k8s.tenancy),
        not applied. The GPU resources are those of the last inventory read (read now if none was)."""
        with self._lock:
            resources = self._resources
        if resources is None and self.tenancy.per_tenant:
            self.inventory()
            with self._lock:
                resources = self._resources
        return plan_quotas(quotas, self.tenancy, resources or {}, tag=self.tag)

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
        wanted = plan.by_namespace()
        self._quota_plan = wanted
        if self._quotas_applied is None:
            # What an earlier process left: written again only where it differs, deleted where
            # the tenant's quota went while no broker was looking.
            found, _ = self._list_in("resourcequotas", None, selector(self.tag))
            self._quotas_applied = {
                self._namespace_of(q): dict((q.get("spec") or {}).get("hard") or {})
                for q in found
                if q["metadata"]["name"] == QUOTA_NAME
            }
        applied = self._quotas_applied
        done: list[str] = []
        for namespace, entry in wanted.items():
            if applied.get(namespace) == dict(entry.hard):
                continue
            if namespace not in applied and not self._namespace_known(namespace):
                looked = self._quota_absent.get(namespace)
                if looked is not None and now - looked < QUOTA_RETRY_SECONDS:
                    continue
                if self.client.get("namespaces", None, namespace) is None:
                    self._quota_absent[namespace] = now  # its tenant has not run here yet
                    continue
            self._quota_absent.pop(namespace, None)
            said = self._write_quota(entry)
            if said:
                done.append(said)
        for namespace in sorted(set(applied) - set(wanted)):
            self.client.delete("resourcequotas", namespace, QUOTA_NAME)
            del applied[namespace]
            done.append(f"deleted ResourceQuota {namespace}/{QUOTA_NAME}: its tenant has no GPU quota here now")
        return done

    def _write_quota(self, entry: TenantQuota) -> str | None:
        """Create or replace one tenant's ResourceQuota (``_quota_lock`` held); what changed,
        or None when its namespace has gone meanwhile."""
        namespace = entry.namespace
        applied = self._quotas_applied if self._quotas_applied is not None else {}
        try:
            if namespace in applied:
                try:
                    self.client.replace("resourcequotas", namespace, QUOTA_NAME, entry.quota_body)
                    verb = "updated"
                except NotFound:
                    self.client.create("resourcequotas", namespace, entry.quota_body)
                    verb = "created"
            else:
                try:
                    self.client.create("resourcequotas", namespace, entry.quota_body)
                    verb = "created"
                except AlreadyExists:
                    self.client.replace("resourcequotas", namespace, QUOTA_NAME, entry.quota_body)
                    verb = "updated"
        except NotFound:  # the namespace itself is gone
            applied.pop(namespace, None)
            self._forget_namespace(namespace)
            return None
        applied[namespace] = dict(entry.hard)
        limits = ", ".join(f"{key.removeprefix('requests.')} {value}" for key, value in entry.hard.items())
        return (
            f"{verb} ResourceQuota {namespace}/{QUOTA_NAME} of tenant {entry.tenant} "
            f"({entry.gpu_quota:g} GPU-equivalents): {limits}"
        )

    def _quota_for_new_namespace(self, namespace: str) -> None:
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
                log.warning("%s: the ResourceQuota of namespace %s is not written yet: %s", self.name, namespace, exc)

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
        """Job ``job_id``'s output: the log of its Pod for replica ``replica`` (the first when
        None), from character ``offset`` on (at most MAX_LOG_CHUNK), or its last ``tail`` lines.
        ``stream`` ``stderr`` answers the same log, with a note that it holds both."""
        if stream not in ("stdout", "stderr"):
            raise Rejected(f"stream must be stdout or stderr, not {stream!r}")
        if offset < 0 or (tail is not None and tail < 0) or (replica is not None and replica < 0):
            raise Rejected(f"offset, tail and replica count from 0: got {offset}, {tail}, {replica}")
        index = replica or 0
        namespace, kind, owner_name = parse_backend_id(backend_id, self.namespace)
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

    # -- submissions ---------------------------------------------------------------------

    def _ensure_namespace(self, namespace: str, tenant: str | None) -> None:
        """``namespace`` is there (created with ``create_namespace=true``) and, for a tenant's,
        not another tenant's (two whose names make the same namespace): checked once per
        namespace and process. A tenant's namespace gets its ResourceQuota here when the
        scheduler has handed the quotas over already."""
        key = (namespace, tenant)
        if key in self._ready:
            return
        with self._namespace_lock:
            if key in self._ready:
                return
            existing = self.client.get("namespaces", None, namespace)
            if existing is None:
                if not self.settings.create_namespace:
                    raise Rejected(self._no_namespace(namespace, tenant))
                body = namespace_manifest(namespace, tag=self.tag, tenant=tenant)
                if not self.client.create_namespace(namespace, body):  # made meanwhile by another
                    existing = self.client.get("namespaces", None, namespace)
            holder = claimed_by(existing, self.tag) if existing is not None and tenant is not None else None
            if holder is not None and holder != tenant:
                raise Rejected(
                    f"namespace {namespace} holds tenant {holder}'s jobs on {self.name}, and tenant {tenant} "
                    "maps to it too: give one of them a namespace of its own "
                    f"(--config tenant_namespaces={tenant}=NAMESPACE)"
                )
            self._ready.add(key)
        if tenant is not None:
            self._quota_for_new_namespace(namespace)

    def _forget_namespace(self, namespace: str) -> None:
        with self._namespace_lock:
            self._ready = {key for key in self._ready if key[0] != namespace}

    def _namespace_known(self, namespace: str) -> bool:
        return any(key[0] == namespace for key in self._ready)

    def _no_namespace(self, namespace: str, tenant: str | None) -> str:
        whose = f" (tenant {tenant}'s)" if tenant is not None else ""
        return (
            f"namespace {namespace}{whose} does not exist in {self.name}: create it "
            f"(kubectl create namespace {namespace}) or set create_namespace=true"
        )

    def _namespace_of(self, obj: Mapping[str, Any] | None) -> str:
        return ((obj or {}).get("metadata") or {}).get("namespace") or self.namespace

    def _id_in(self, namespace: str, backend_id: str) -> str:
        """A backend id (``job/<name>``) as this cluster hands it out: with its namespace in
        front when each tenant has its own (see :func:`parse_backend_id`)."""
        return f"{namespace}/{backend_id}" if self.tenancy.per_tenant else backend_id

    def _list_in(self, kind: str, namespace: str | None, label_selector: str) -> tuple[list[dict[str, Any]], str]:
        """Objects of ``kind`` with ``label_selector`` in ``namespace`` (None: every namespace,
        where a refusal says what grants it)."""
        try:
            return self.client.list(kind, namespace, label_selector=label_selector)
        except Rejected as exc:
            raise self._refused_everywhere(exc, kind, namespace) from None

    def _refused_everywhere(self, exc: Rejected, kind: str, where: str | None) -> Rejected:
        if where is not None or not _forbidden(exc):
            return exc
        return Rejected(
            f"{self.name} keeps each tenant's jobs in its own namespace, so the broker lists and watches its "
            f"{kind} in every namespace, and Kubernetes refused it: {exc}{_rbac_hint(exc)}"
        )

    def _owned(self, kind: str, job_id: int, namespace: str | None = None) -> list[dict[str, Any]]:
        """Job ``job_id``'s objects of ``kind`` (in ``namespace``, else where this broker keeps them)."""
        where = namespace if namespace is not None else self._scope
        items, _ = self._list_in(kind, where, selector(self.tag, job_id))
        return [obj for obj in items if job_id_of(obj, self.tag) == job_id]

    def _model_memory(self, name: str | None) -> float | None:
        if not name:
            return None
        try:
            return float(gpu_model(name).memory_gb)
        except ValueError:
            return None

    def _products_for(self, placement: Placement) -> list[str]:
        if not placement.gpu_model:
            return []
        with self._lock:
            seen = set(self._products.get(placement.gpu_model, ()))
        return product_names(placement.gpu_model, self.gpu_types, seen)

    def _backend_id(self, job_id: int, seen: Observed) -> str:
        owner = seen.owner
        if owner is not None:
            kind = "job" if seen.job is not None else "deployment"
            return self._id_in(self._namespace_of(owner), f"{kind}/{owner['metadata']['name']}")
        return self._ids.get(job_id) or f"job/{object_name(self.tag, job_id)}"

    # -- statuses ------------------------------------------------------------------------

    def _observed(self, job_id: int) -> Observed:
        seen = self._seen.get(job_id)
        if seen is None:
            seen = self._seen[job_id] = Observed()
        return seen

    def _relist(self, since: dict[str, str] | None) -> set[int]:
        """Read this broker's objects afresh; returns every job id known (all are reported).
        With ``since`` (a cursor from before this process), objects deleted after it are
        looked for in a watch from there."""
        wanted = selector(self.tag)
        listed: dict[str, list[dict[str, Any]]] = {}
        versions: dict[str, str] = {}
        for kind in WATCHED:
            listed[kind], versions[kind] = self._list_in(kind, self._scope, wanted)
        with self._lock:
            cancelled = set(self._cancelled)
        old = self._seen
        fresh: dict[int, Observed] = {}
        for kind in ("jobs", "deployments"):
            for obj in listed[kind]:
                job_id = job_id_of(obj, self.tag)
                if job_id is None:
                    continue
                seen = fresh.setdefault(job_id, Observed())
                setattr(seen, "job" if kind == "jobs" else "deployment", obj)
        for pod in listed["pods"]:
            job_id = job_id_of(pod, self.tag)
            if job_id in fresh:
                fresh[job_id].pods[pod["metadata"]["name"]] = pod
        for job_id, seen in fresh.items():
            seen.started = old[job_id].started if job_id in old else False
            seen.cancelled = job_id in cancelled
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
        changed: set[int] = set()
        for kind in ("jobs", "deployments"):
            if since[kind] == now[kind]:
                continue
            try:
                batch = self.client.watch(
                    kind,
                    self._scope,
                    resource_version=since[kind],
                    label_selector=selector(self.tag),
                    seconds=self.settings.watch_seconds,
                )
            except (Gone, Rejected):
                continue
            for event in batch.events:
                job_id = job_id_of(event.object, self.tag)
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
        with self._lock:
            cancelled = set(self._cancelled)
        # Owners first, so a Pod event of a job created in this batch finds its Job.
        for kind in ("jobs", "deployments", "pods"):
            batch = batches[kind]
            for event in batch.events:
                job_id = job_id_of(event.object, self.tag)
                if job_id is None:
                    continue
                name = (event.object.get("metadata") or {}).get("name", "")
                if kind == "pods":
                    if job_id in self._gone or job_id not in self._seen:
                        continue
                    seen = self._seen[job_id]
                    if event.type == "DELETED":
                        seen.pods.pop(name, None)
                    else:
                        seen.pods[name] = event.object
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
                        setattr(seen, attribute, event.object)
                        self._gone.discard(job_id)
                seen.note_started()
                changed.add(job_id)
            versions[kind] = batch.resource_version
        self._versions = versions
        return changed

    def _watch_scoped(self, kind: str, version: str) -> WatchBatch:
        try:
            return self.client.watch(
                kind,
                self._scope,
                resource_version=version,
                label_selector=selector(self.tag),
                seconds=self.settings.watch_seconds,
            )
        except Rejected as exc:
            raise self._refused_everywhere(exc, kind, self._scope) from None

    def _page(self, changed: set[int], report_all: bool) -> list[BackendJob]:
        out: list[BackendJob] = []
        for job_id in sorted(changed):
            seen = self._seen.get(job_id)
            if seen is None or (seen.owner is None and not seen.deleted):
                continue
            backend = backend_job(job_id, self._backend_id(job_id, seen), seen, self.name)
            key = (backend.state, backend.reason)
            if report_all or self._reported.get(job_id) != key:
                out.append(backend)
            self._reported[job_id] = key
            if seen.deleted:
                # Reported once; later Pod events of it are ignored (``_gone``).
                self._seen.pop(job_id, None)
                self._reported.pop(job_id, None)
                with self._lock:
                    self._cancelled.discard(job_id)
        return out

    # -- output ----------------------------------------------------------------------------

    def _replica_pods(self, job_id: int, namespace: str) -> list[dict[str, Any]]:
        """The job's Pods (in ``namespace``, its own) in replica order: completion index
        (Indexed Jobs), then age, then name, so that replica K names the same Pod from one
        call to the next."""
        try:
            pods = self._owned("pods", job_id, namespace)
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
        name = name or object_name(self.tag, job_id)
        owner = self.client.get(kind, namespace, name)
        if owner is not None and job_id_of(owner, self.tag) == job_id and not _finished(owner):
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
            events = self.client.events_for(namespace, "Job", name)
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
        return self.client.read_namespaced_pod_log(pod, namespace, container=container, **options)

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

    # -- fencing (NodeFencer) --------------------------------------------------------------

    def fence(self, node: str, reason: str) -> None:
        """Cordon ``node`` (``spec.unschedulable``, as ``kubectl cordon``) and record ``reason`` in its
        ``gpush.io/fenced`` annotation: no new Pod lands there, Pods running there go on. Fencing a
        fenced node again only updates the reason. A node someone had cordoned already is marked so
        (``gpush.io/fenced-over-cordon``), and unfencing it leaves their cordon in place."""
        found = self._node(node)
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        cordoned = bool((found.get("spec") or {}).get("unschedulable"))
        if cordoned and annotations.get(FENCED_ANNOTATION) == reason:
            return
        marks = {FENCED_ANNOTATION: reason}
        if cordoned and FENCED_ANNOTATION not in annotations:
            marks[FENCED_OVER_CORDON] = "true"
        self.client.patch("nodes", None, node, {"metadata": {"annotations": marks}, "spec": {"unschedulable": True}})

    def unfence(self, node: str) -> None:
        """Drop gpush's fence: its annotations go and the node is uncordoned, unless someone had
        cordoned it before gpush fenced it. A node gpush did not fence is left as it is (cordoned
        or not: someone else's cordon is not gpush's to lift)."""
        found = self._node(node)
        annotations = (found.get("metadata") or {}).get("annotations") or {}
        if FENCED_ANNOTATION not in annotations:
            return
        body: dict[str, Any] = {"metadata": {"annotations": {FENCED_ANNOTATION: None, FENCED_OVER_CORDON: None}}}
        if annotations.get(FENCED_OVER_CORDON) != "true":
            body["spec"] = {"unschedulable": None}  # what kubectl uncordon leaves: the field unset
        self.client.patch("nodes", None, node, body)

    def fenced(self) -> dict[str, str]:
        """The nodes gpush fenced, with their reasons (read now, not from the node cache, so a
        fence just set is in the answer); nodes only someone else cordoned are not."""
        nodes, _ = self.client.list("nodes")
        out = {}
        for found in nodes:
            meta = found.get("metadata") or {}
            reason = (meta.get("annotations") or {}).get(FENCED_ANNOTATION)
            if reason is not None:
                out[str(meta.get("name"))] = reason
        return out

    def _node(self, node: str) -> dict[str, Any]:
        found = self.client.get("nodes", None, node)
        if found is None:
            raise Rejected(f"Kubernetes cluster {self.name} has no node {node} (kubectl get nodes lists them)")
        return found

    # -- setting a lent node up (NodeConfigurer) ---------------------------------------------

    def configure_node(self, node: str, setup: Mapping[str, str]) -> None:
        """Label ``node`` as the GPU Operator reads it: ``nvidia.com/device-plugin.config=<device_plugin>``
        (the device plugin's config key: time-slicing replicas, MPS) and, with ``mig``,
        ``nvidia.com/mig.config=<mig>`` with the MIG manager's state ``pending`` (``all-disabled``
        makes whole GPUs of a MIG node). Labels already so are not touched."""
        labels = (self._node(node).get("metadata") or {}).get("labels") or {}
        patch: dict[str, str] = {}
        if setup.get("device_plugin") and labels.get(DEVICE_PLUGIN_CONFIG) != setup["device_plugin"]:
            patch[DEVICE_PLUGIN_CONFIG] = setup["device_plugin"]
        if setup.get("mig") and labels.get(MIG_CONFIG_LABEL) != setup["mig"]:
            patch.update({MIG_CONFIG_LABEL: setup["mig"], MIG_STATE_LABEL: "pending"})
        if patch:
            self.client.patch("nodes", None, node, {"metadata": {"labels": patch}})

    def node_configured(self, node: str, setup: Mapping[str, str]) -> bool | None:
        """Whether ``node`` has ``setup``: its labels say it, and the MIG manager reports
        ``success`` for the ``mig`` config (``failed``: False; still at work: None)."""
        labels = (self._node(node).get("metadata") or {}).get("labels") or {}
        if setup.get("device_plugin") and labels.get(DEVICE_PLUGIN_CONFIG) != setup["device_plugin"]:
            return None
        if setup.get("mig"):
            if labels.get(MIG_CONFIG_LABEL) != setup["mig"]:
                return None
            state = labels.get(MIG_STATE_LABEL)
            if state == "failed":
                return False
            if state != "success":
                return None
        return True

    # -- MIG layouts (MigPublisher) -------------------------------------------------------

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Have the GPU Operator's MIG manager give GPU ``gpu`` of ``node`` the instances
        ``instances`` (``"3g.20gb@0"``; adapters.k8s.mig says how): gpush's mig-parted config for
        the node is written into the MIG manager's ConfigMap (its other configs kept byte for byte)
        with this GPU's new instance counts and the other GPUs' current layouts, and the node is
        labelled ``nvidia.com/mig.config=<that config>``, ``nvidia.com/mig.config.state=pending``.

        mig-parted counts instances per profile and chooses their placement itself, so the
        ``@start`` of each instance is not sent to the cluster (:meth:`mig_published` answers with
        it while the counts agree). :class:`Rejected` when the instances do not fit the node's GPU
        model, or when the node's Pods hold more of a MIG profile than the node would offer after
        the change (Kubernetes does not say which GPU a Pod's instance is on, so this is checked
        per node). Publishing what is published already, and not failed, changes nothing."""
        try:
            slots = [MigSlot.parse(text) for text in instances]
        except ValueError as exc:
            raise Rejected(str(exc)) from None
        if gpu < 0:
            raise Rejected(f"GPU indices count from 0, not {gpu}")
        found = self._node(node)
        meta = found.get("metadata") or {}
        labels = meta.get("labels") or {}
        allocatable = (found.get("status") or {}).get("allocatable") or {}
        model = self._node_model(labels)
        if model is not None:
            problem = layout_problem(model, slots)
            if problem:
                raise Rejected(f"GPU {gpu} of node {node} ({model.name}) cannot hold {', '.join(instances)}: {problem}")
        namespace, config_map = self._mig_config_ref()
        where = f"ConfigMap {namespace}/{config_map} key {MIG_PARTED_KEY}"
        own = config_names(node)
        label = labels.get(MIG_CONFIG_LABEL)
        for attempt in range(3):
            existing = self.client.get("configmaps", namespace, config_map)
            text = ((existing or {}).get("data") or {}).get(MIG_PARTED_KEY)
            try:
                configs = parse_configs(text, where)
                gpus = max(node_gpu_count(labels), gpu + 1)
                now, _ = current_layouts(labels, configs, model, gpus, own)
                wanted = {**now, gpu: counts_of(model, slots)}
                in_flight = label in own and labels.get(MIG_STATE_LABEL) in ("pending", "rebooting", "success")
                if in_flight and label in configs and resolve(configs[label], gpus, label) == wanted:
                    self._record_published(node, meta, label, gpu, instances)
                    return
                self._check_holders(node, allocatable, now.get(gpu), wanted[gpu])
                name = next_config_name(node, label)
                merged = merge_config(text, name, render_entries(wanted), drop=[n for n in own if n != name])
            except MigConfigError as exc:
                raise Rejected(f"{exc}: fix {where}, or point the cluster's mig_config at another") from None
            try:
                if existing is None:
                    self.client.create("configmaps", namespace, _mig_config_map(namespace, config_map, merged))
                elif merged != text:
                    version = (existing.get("metadata") or {}).get("resourceVersion")
                    body = {"metadata": {"resourceVersion": version}, "data": {MIG_PARTED_KEY: merged}}
                    self.client.patch("configmaps", namespace, config_map, body)
                break
            except NotFound:
                raise Rejected(
                    f"namespace {namespace} does not exist: is the GPU Operator installed there? (set the "
                    "cluster's mig_config to NAMESPACE/NAME of its mig-parted ConfigMap)"
                ) from None
            except (AlreadyExists, Conflict):
                if attempt == 2:
                    raise Unreachable(f"{where} kept changing while gpush wrote it: try again") from None
        record = published_record(meta.get("annotations") or {})
        gpus_published = {**(record.get("gpus") or {}), str(gpu): list(instances)}
        self.client.patch(
            "nodes",
            None,
            node,
            {
                "metadata": {
                    "labels": {MIG_CONFIG_LABEL: name, MIG_STATE_LABEL: "pending"},
                    "annotations": {
                        PUBLISHED_ANNOTATION: json.dumps({"config": name, "gpus": gpus_published}, sort_keys=True)
                    },
                }
            },
        )

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers now, as :meth:`publish_mig` takes them: those
        of the mig-parted config the node's ``nvidia.com/mig.config`` label names, once the MIG
        manager says ``success`` and the node's allocatable ``nvidia.com/mig-<profile>`` counts
        agree with the config (the device plugin has caught up). None while the MIG manager is
        still at it (``pending``, ``rebooting``), while the label names a config other than the
        one gpush last published there, or while the device plugin lags. :class:`Rejected` when
        the MIG manager failed (``failed``: its log on the node says why; publishing again
        retries), or when the config does not set that GPU."""
        found = self._node(node)
        meta = found.get("metadata") or {}
        labels = meta.get("labels") or {}
        allocatable = (found.get("status") or {}).get("allocatable") or {}
        label, state = labels.get(MIG_CONFIG_LABEL), labels.get(MIG_STATE_LABEL)
        if state == "failed":
            raise Rejected(
                f"the GPU Operator's MIG manager could not apply mig-parted config {label} on node {node} "
                f"({MIG_STATE_LABEL}=failed): the nvidia-mig-manager Pod's log on that node says why"
            )
        record = published_record(meta.get("annotations") or {})
        if state != "success" or not label or record.get("config") not in (None, label):
            return None
        namespace, config_map = self._mig_config_ref()
        where = f"ConfigMap {namespace}/{config_map} key {MIG_PARTED_KEY}"
        existing = self.client.get("configmaps", namespace, config_map)
        try:
            configs = parse_configs(((existing or {}).get("data") or {}).get(MIG_PARTED_KEY), where)
            if label not in configs:
                raise MigConfigError(f"node {node} is labelled {MIG_CONFIG_LABEL}={label}, which {where} does not hold")
            count = node_gpu_count(labels)
            layouts = resolve(configs[label], max(count, gpu + 1), label)
        except MigConfigError as exc:
            raise Rejected(str(exc)) from None
        if gpu not in layouts:
            raise Rejected(
                f"mig-parted config {label} does not set GPU {gpu} of node {node}, so Kubernetes does not show "
                "its layout"
            )
        every_gpu = set(layouts) >= set(range(count)) and whole_gpus(allocatable) == 0
        if not caught_up(layouts, allocatable, every_gpu):
            return None
        published = (record.get("gpus") or {}).get(str(gpu)) if record.get("config") == label else None
        try:
            return instances_of(self._node_model(labels), layouts[gpu], published)
        except ValueError as exc:
            raise Rejected(f"GPU {gpu} of node {node}: {exc} (name its model in the cluster's gpu_types)") from None

    def _record_published(
        self, node: str, meta: Mapping[str, Any], config: str, gpu: int, instances: Sequence[str]
    ) -> None:
        """Note ``instances`` as published on ``gpu`` when the config in force has them already."""
        record = published_record(meta.get("annotations") or {})
        gpus = record.get("gpus") or {}
        if record.get("config") == config and gpus.get(str(gpu)) == list(instances):
            return
        value = json.dumps({"config": config, "gpus": {**gpus, str(gpu): list(instances)}}, sort_keys=True)
        self.client.patch("nodes", None, node, {"metadata": {"annotations": {PUBLISHED_ANNOTATION: value}}})

    def _check_holders(
        self, node: str, allocatable: Mapping[str, Any], before: dict[str, int] | None, after: dict[str, int] | None
    ) -> None:
        """Refuse a change that leaves the node fewer instances of a profile than its Pods hold."""
        pods, _ = self._bound_pods()
        held = gpu_requests_by_node(p for p in pods if (p.get("spec") or {}).get("nodeName") == node).get(node, {})
        short = []
        for resource, n in sorted(held.items()):
            if not resource.startswith(MIG_RESOURCE_PREFIX):
                continue
            profile = resource.removeprefix(MIG_RESOURCE_PREFIX)
            offered = quantity.count(allocatable.get(resource))
            left = offered - (before or {}).get(profile, 0) + (after or {}).get(profile, 0)
            if left < n:
                short.append(f"{n} {resource} held, {max(left, 0)} left")
        if short:
            raise Rejected(
                f"the node's Pods hold MIG instances the new layout takes away ({'; '.join(short)}): "
                f"drain node {node} first"
            )

    def _mig_config_ref(self) -> tuple[str, str]:
        """(namespace, name) of the MIG manager's ConfigMap: the cluster's ``mig_config``, its name
        overridden by the ClusterPolicy's ``spec.migManager.config.name`` when that is set."""
        namespace, name = parse_ref(self.settings.mig_config)
        try:
            policies = self.client.list_custom(*CLUSTER_POLICY)
        except Rejected as exc:
            if not _forbidden(exc):
                raise
            policies = []  # not allowed to read the ClusterPolicy: the setting stands
        for policy in policies:
            configured = (((policy.get("spec") or {}).get("migManager") or {}).get("config") or {}).get("name")
            if configured:
                name = str(configured)
            break
        return namespace, name

    def _node_model(self, labels: Mapping[str, str]) -> GpuModel | None:
        """The node's GPU model from ``nvidia.com/gpu.product`` (a single-strategy ``-MIG-`` suffix
        dropped), through the cluster's gpu_types; None when gpush does not know it."""
        product = (labels.get(GFD_PRODUCT) or "").split("-MIG-", 1)[0]
        name = model_of_product(product, self.gpu_types) if product else None
        try:
            return gpu_model(name) if name else None
        except ValueError:
            return None

    # -- inventory -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop the caches' watches (they are daemon threads; a process may also just exit)."""
        self._node_cache.stop()
        if self._pod_cache is not None:
            self._pod_cache.stop()

    def _nodes(self) -> list[dict[str, Any]]:
        if self.settings.informers:
            return self._node_cache.snapshot()
        with self._lock:
            now = time.monotonic()
            if self._node_listing is None or now - self._node_listing[0] > self.settings.cache_seconds:
                nodes, _ = self.client.list("nodes")
                self._node_listing = (now, nodes)
            return self._node_listing[1]

    def _bound_pods(self) -> tuple[list[dict[str, Any]], str | None]:
        """Pods that hold resources, cluster-wide when allowed; and, when only this
        namespace could be read, a note saying so."""
        if self.settings.informers and self._pod_cache is not None:
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
            pods, _ = self.client.list("pods", None, field_selector=unfinished)
            return pods, None
        except NotFound:
            pass
        except Rejected as exc:
            if "Forbidden" not in str(exc) and "403" not in str(exc):
                # A server that does not take this field selector: filter here instead.
                pods, _ = self.client.list("pods", None)
                return pods, None
        pods, _ = self.client.list("pods", self.namespace)
        return pods, f"counted from namespace {self.namespace} only (no permission to list Pods cluster-wide)"


def _mig_config_map(namespace: str, name: str, text: str) -> dict[str, Any]:
    """The MIG manager's ConfigMap as gpush creates it when the cluster has none."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/managed-by": "gpush"}},
        "data": {MIG_PARTED_KEY: text},
    }


def _forbidden(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, Rejected) and ("HTTP 403" in text or "Forbidden" in text)


def _rbac_hint(exc: BaseException) -> str:
    """What grants the broker what Kubernetes refused it (a 403), else nothing."""
    return f" (grant the broker what it needs with {RBAC_FILE})" if _forbidden(exc) else ""


def _with_label(unit: CapacityUnit, key: str, value: str) -> CapacityUnit:
    from dataclasses import replace

    return replace(unit, labels={**unit.labels, key: value})


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
