"""The Kubernetes adapter: gpush's adapter protocol (broker.core.adapter) over a Kubernetes API.

It turns placements into Jobs and Deployments (adapters.k8s.render), follows them by
watch (adapters.k8s.states says what each object state means), reads the node pool's
GPUs as inventory (adapters.k8s.inventory) and configures time-slicing
(adapters.k8s.timeslice). Only adapters.k8s.client talks to the API server. What a
caller may assume beyond the protocol's own guarantees:

- **Finding its jobs.** Every object is named ``<tag>-<gpush id>`` in the cluster's
  namespace and labelled ``gpush.io/broker=<tag>``, ``gpush.io/job-id=<id>``;
  ``find`` and ``cancel`` select by label, so they work after a crash. ``submit`` of a
  job whose object exists already (a broker killed between the create and its database
  write) returns that object's id once its labels prove it is this job's; an object of
  that name that is not refuses the submission.
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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.k8s.client import AlreadyExists, Gone, KubeClient, NotFound, WatchBatch
from adapters.k8s.informer import Informer, trim_pod
from adapters.k8s.inventory import gpu_requests_by_node, node_units
from adapters.k8s.render import (
    CONTAINER,
    LABEL_BROKER,
    RenderOptions,
    check_tag,
    default_gpu_types,
    job_id_of,
    object_name,
    product_names,
    render,
    selector,
)
from adapters.k8s.states import Observed, backend_job
from adapters.k8s.timeslice import (
    DEFAULT_CONFIG,
    TimeslicePlan,
    TimesliceState,
    apply_timeslice,
    read_timeslice,
    render_timeslice,
)
from adapters.settings import key_value_pairs, load_settings
from broker.core.adapter import (
    MAX_LOG_CHUNK,
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
    Owner,
    Placement,
    Rejected,
    Scaler,
    StatusPage,
    TimesliceConfigurator,
    submit_each,
)
from broker.core.clock import Clock, utcnow
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec

WATCHED = ("pods", "jobs", "deployments")
# The most of a log a ``tail`` read takes in to count where the log ends (``next_offset``); a
# longer log is tailed by the kubelet (``tailLines``) and its end is not known exactly.
LOG_SCAN_BYTES = 16 * MAX_LOG_CHUNK
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # Indexed Jobs' Pods carry it
BOTH_STREAMS = "Kubernetes keeps a container's stdout and stderr as one log: this is both, interleaved."
_CURSOR_VERSION = 1
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class KubernetesSettings(BaseModel):
    """A Kubernetes cluster's config (``gpush cluster add NAME --kind k8s --config KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    kubeconfig: str | None = Field(
        None, description="kubeconfig path; 'in-cluster' for the broker Pod's service account; default $KUBECONFIG"
    )
    context: str | None = Field(None, description="kubeconfig context (default: its current-context)")
    namespace: str = Field("gpush", pattern=_DNS_LABEL, description="where gpush's Jobs and Deployments go")
    create_namespace: bool = Field(False, description="create the namespace on first use")
    tag: str = Field("gpush", description="names this broker's objects (<tag>-<id>) and labels them")
    image: str | None = Field(None, description="image for jobs that name none")
    service_account: str | None = Field(None, description="service account of the Pods (default: none mounted)")
    run_as_user: int = Field(1000, ge=1, description="the non-root uid Pods run as")
    priority_class: str | None = None
    node_selector: dict[str, str] = Field(default_factory=dict, description="added to every Pod: KEY=VALUE,...")
    timeslice_config: str = Field(DEFAULT_CONFIG, description="NAMESPACE/NAME of the time-slicing ConfigMap")
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


class KubernetesAdapter:
    """gpush's adapter for one Kubernetes cluster (see the module docstring)."""

    capabilities: ClassVar[frozenset[type]] = frozenset(
        {BatchSubmitter, Scaler, TimesliceConfigurator, Closable, LogReader, ChangeNotifier}
    )

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
        self._namespace_ready = False
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
            return Health(False, f"Kubernetes {version} answers, but namespace {self.namespace} is not readable: {exc}")
        if namespace is None and not self.settings.create_namespace:
            return Health(
                False,
                f"Kubernetes {version} answers, but namespace {self.namespace} does not exist: create it "
                f"(kubectl create namespace {self.namespace}) or set create_namespace=true",
                version,
            )
        said = "created on first use" if namespace is None else "readable"
        return Health(True, f"Kubernetes {version}: namespace {self.namespace} {said}", version)

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        manifest = render(
            job_id,
            spec,
            placement,
            self.options,
            gpu_memory_gb=self._model_memory(placement.gpu_model),
            products=self._products_for(placement),
        )
        self._ensure_namespace()
        try:
            self.client.create(manifest.kind, self.namespace, manifest.body)
        except AlreadyExists:
            existing = self.client.get(manifest.kind, self.namespace, manifest.name)
            if existing is None:  # deleted in between: this create is the one
                self.client.create(manifest.kind, self.namespace, manifest.body)
            elif job_id_of(existing, self.tag) != job_id:
                raise Rejected(
                    f"{manifest.backend_id} exists in namespace {self.namespace} of {self.name} but is not "
                    f"gpush job {job_id} of this broker (labels {(existing['metadata'].get('labels') or {})}): "
                    "delete it, or give this cluster another tag"
                ) from None
        except NotFound as exc:
            raise Rejected(
                f"namespace {self.namespace} does not exist in {self.name}: create it "
                f"(kubectl create namespace {self.namespace}) or set create_namespace=true ({exc})"
            ) from None
        with self._lock:
            self._ids[job_id] = manifest.backend_id
            self._cancelled.discard(job_id)
        return manifest.backend_id

    def submit_many(self, items: Sequence[tuple[int, JobSpec, Placement]]) -> list[str | AdapterError]:
        """Create a batch on several threads; per item the backend id or the AdapterError."""
        if len(items) > 1:
            self._ensure_namespace()  # once, not raced by the threads
        return submit_each(self, items, threads=self.settings.submit_threads)

    def cancel(self, job_id: int) -> None:
        with self._lock:
            self._cancelled.add(job_id)
        wanted = selector(self.tag, job_id)
        for kind in ("jobs", "deployments", "pods"):
            # Pods too: a Job's are removed by the garbage collector in its own time, and
            # they hold their GPUs until then.
            items, _ = self.client.list(kind, self.namespace, label_selector=wanted)
            for obj in items:
                if job_id_of(obj, self.tag) == job_id:
                    self.client.delete(kind, self.namespace, obj["metadata"]["name"])

    def find(self, job_id: int) -> BackendJob | None:
        wanted = selector(self.tag, job_id)
        seen = Observed()
        for kind in ("jobs", "deployments"):
            items, _ = self.client.list(kind, self.namespace, label_selector=wanted)
            for obj in items:
                if job_id_of(obj, self.tag) == job_id:
                    setattr(seen, "job" if kind == "jobs" else "deployment", obj)
        if seen.owner is None:
            return None
        pods, _ = self.client.list("pods", self.namespace, label_selector=wanted)
        seen.pods = {p["metadata"]["name"]: p for p in pods if job_id_of(p, self.tag) == job_id}
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
        return units

    # -- beyond the protocol -------------------------------------------------------------

    def scale(self, job_id: int, replicas: int) -> int:
        """Set an elastic job's replicas (its Deployment's scale subresource); returns them."""
        if replicas < 0:
            raise Rejected(f"replicas must be 0 or more, not {replicas}")
        name = object_name(self.tag, job_id)
        existing = self.client.get("deployments", self.namespace, name)
        if existing is None or job_id_of(existing, self.tag) != job_id:
            if self.client.get("jobs", self.namespace, name) is not None:
                raise Rejected(
                    f"job {job_id} runs as a Kubernetes Job, which does not scale: only elastic inference does"
                )
            raise Rejected(f"{self.name} has no Deployment for job {job_id} (namespace {self.namespace})")
        answer = self.client.scale(self.namespace, name, replicas)
        return int((answer.get("spec") or {}).get("replicas", replicas))

    def timeslice(self, replicas: int, node_label: str | None = None) -> TimeslicePlan:
        """The time-slicing ConfigMap and ClusterPolicy patch for this cluster (not applied)."""
        return render_timeslice(replicas, node_label=node_label, config_map=self.settings.timeslice_config)

    def apply_timeslice(self, plan: TimeslicePlan) -> list[str]:
        """Apply a plan from :meth:`timeslice`; returns what changed."""
        return apply_timeslice(self.client, plan)

    def timeslice_state(self) -> TimesliceState | None:
        return read_timeslice(self.client, self.settings.timeslice_config)

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
        pods = self._replica_pods(job_id)
        if index >= len(pods):
            return self._no_pod(job_id, backend_id, index, pods, offset)
        pod = pods[index]
        name = pod["metadata"]["name"]
        location = f"pod {name} (namespace {self.namespace})"
        container = _log_container(pod)
        waiting = _not_started(pod, container)
        if waiting:
            raise Rejected(f"job {job_id} has no output yet: {location} {waiting}")
        try:
            if tail is not None:
                text, next_offset, note = self._tail(name, container, tail)
            else:
                text, next_offset, note = self._from(name, container, offset)
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

    def _ensure_namespace(self) -> None:
        if self._namespace_ready or not self.settings.create_namespace:
            return
        with self._lock:
            if self._namespace_ready:
                return
            if self.client.get("namespaces", None, self.namespace) is None:
                self.client.create_namespace(self.namespace)
            self._namespace_ready = True

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
            return f"{kind}/{owner['metadata']['name']}"
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
            listed[kind], versions[kind] = self.client.list(kind, self.namespace, label_selector=wanted)
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
                    self.namespace,
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
        futures = {
            kind: self._watchers.submit(
                self.client.watch,
                kind,
                self.namespace,
                resource_version=versions[kind],
                label_selector=selector(self.tag),
                seconds=self.settings.watch_seconds,
            )
            for kind in WATCHED
        }
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

    def _replica_pods(self, job_id: int) -> list[dict[str, Any]]:
        """The job's Pods in replica order: completion index (Indexed Jobs), then age, then
        name, so that replica K names the same Pod from one call to the next."""
        try:
            pods, _ = self.client.list("pods", self.namespace, label_selector=selector(self.tag, job_id))
        except NotFound:  # the namespace is gone, and everything in it
            return []
        return sorted((p for p in pods if job_id_of(p, self.tag) == job_id), key=_replica_order)

    def _no_pod(self, job_id: int, backend_id: str, index: int, pods: list[dict[str, Any]], offset: int) -> JobOutput:
        """No Pod for replica ``index``: not started yet, not a replica, or deleted with its log."""
        if pods:
            names = ", ".join(p["metadata"]["name"] for p in pods)
            raise Rejected(
                f"job {job_id} has {len(pods)} replica pod(s) in namespace {self.namespace} ({names}): "
                f"replica {index} is not one of them; use 0 to {len(pods) - 1}"
            )
        kind, _, name = backend_id.partition("/")
        kind, name = ("deployments", name) if kind == "deployment" else ("jobs", name or object_name(self.tag, job_id))
        owner = self.client.get(kind, self.namespace, name)
        if owner is not None and job_id_of(owner, self.tag) == job_id and not _finished(owner):
            what = "Job" if kind == "jobs" else "Deployment"
            raise Rejected(
                f"job {job_id} has no output yet: its {what} {name} (namespace {self.namespace}) has no pod yet"
            )
        pod = self._created_pods(kind, name)[index : index + 1]
        if pod:
            location = f"pod {pod[0]} (namespace {self.namespace})"
        else:
            location = f"the pods of {kind.removesuffix('s')}/{name} (namespace {self.namespace})"
        return JobOutput(location, next_offset=offset, readable=False, note=_gone_note(pod[0] if pod else None))

    def _created_pods(self, kind: str, name: str) -> list[str]:
        """The Pods a Job's controller said it created (its SuccessfulCreate events, which
        outlive the Pods for a while), oldest first; none known for a Deployment."""
        if kind != "jobs":
            return []
        try:
            events = self.client.events_for(self.namespace, "Job", name)
        except AdapterError:
            return []
        prefix = "Created pod: "
        return [
            e["message"].removeprefix(prefix)
            for e in events
            if e.get("reason") == "SuccessfulCreate" and str(e.get("message") or "").startswith(prefix)
        ]

    def _read_log(self, pod: str, container: str, **options: Any) -> bytes:
        return self.client.read_namespaced_pod_log(pod, self.namespace, container=container, **options)

    def _from(self, pod: str, container: str, offset: int) -> tuple[str, int, str | None]:
        """The log from character ``offset`` on, at most MAX_LOG_CHUNK of it; the next offset;
        a note when the log is shorter than ``offset`` (a new container run starts a new log)."""
        wanted = offset + MAX_LOG_CHUNK
        limit = wanted  # bytes: enough for ASCII, the common case
        while True:
            data = self._read_log(pod, container, limit_bytes=limit)
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

    def _tail(self, pod: str, container: str, lines: int) -> tuple[str, int, str | None]:
        """The last ``lines`` lines (at most MAX_LOG_CHUNK characters of them) and the offset of the
        log's end. The API cannot say where a log ends without sending it, so the log is read up
        to LOG_SCAN_BYTES and tailed here (one request: its end is where the tail ends); a longer
        log is tailed by the kubelet (``tailLines``), and following it resumes at the scan's end."""
        data = self._read_log(pod, container, limit_bytes=LOG_SCAN_BYTES)
        if len(data) < LOG_SCAN_BYTES:
            whole = _decode(data, final=True)
            return _last_lines(whole, lines)[-MAX_LOG_CHUNK:], len(whole), None
        scanned = len(_decode(data, final=False))
        tailed = self._read_log(pod, container, tail_lines=lines, limit_bytes=4 * MAX_LOG_CHUNK)
        text = _decode(tailed, final=len(tailed) < 4 * MAX_LOG_CHUNK)[-MAX_LOG_CHUNK:]
        note = (
            f"the log of pod {pod} is longer than {LOG_SCAN_BYTES >> 20} MiB: gpush counted that much of it, "
            "so following it from here starts at that point, not at its end"
        )
        return text, scanned, note

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
