"""A KWOK-style GPU cluster simulator: nodes, scheduler, kubelet, controllers and device plugin.

This module owns everything that makes an API server behave like a GPU cluster with the NVIDIA GPU
Operator installed, talking to it only through the official ``kubernetes`` client (list, watch,
create, patch, delete and the binding subresource), so the same code runs against the test server of
``integration/k8s/apiserver.py`` or a real cluster. ``gpu_nodes`` owns what a node advertises.

Components (one thread per watch, keyed work queues in the manner of client-go, so a key is never
processed twice at once and every controller can be re-driven from its cache):

- ``Informer``: list (paginated) then watch from the list's resourceVersion with bookmarks; a watch
  that ends is resumed from the last resourceVersion; ``410 Gone`` (status or ERROR event) re-lists
  and replays the difference as events; a resource type the server lacks (404) is re-listed later.
- ``Scheduler``: binds pending pods through ``pods/<name>/binding`` (or, when the server has no
  binding subresource, by patching ``spec.nodeName``, reported in ``Simulator.server_gaps``); fit is
  decided on in-memory free resources kept from watch events, with assumed bindings, as
  kube-scheduler does. Unschedulable pods get ``PodScheduled=False/Unschedulable`` with the message
  of kube-scheduler's FitError (v1.34 ``pkg/scheduler/framework/types.go``: ``0/N nodes are
  available: <count> <reason>, ....``, reasons as ``Insufficient <resource>``, ``node(s) didn't match
  Pod's node affinity/selector``, ``node(s) had untolerated taint {k: v}``, sorted as strings; then
  `` preemption: 0/N nodes are available: ...`` with ``Preemption is not helpful for scheduling`` on
  nodes where no eviction could help and ``No preemption victims found for incoming pod`` elsewhere,
  since the simulator never preempts) and a ``FailedScheduling`` Warning event.
- ``Kubelet``: for pods bound to simulated nodes: Pending -> Running after ``Timings.pod_start``
  (container statuses running, Ready conditions), then Succeeded/Failed after the pod's annotation
  ``sim.gpush.io/duration`` (seconds) with ``sim.gpush.io/exit-code``; ``sim.gpush.io/oom: "true"``
  ends in ``OOMKilled``, exit code 137, as the kubelet reports a cgroup OOM kill. GPU memory: each
  pod holds its GPU memory on the devices it was given (replicas spread over the physical GPUs);
  the memory it uses is ``sim.gpush.io/gpu-memory-gb`` if annotated (a test's way to make a job
  use more than it declared), else the container env ``GPUSH_GPU_MEMORY_GB`` (per device, summed
  over containers), else ``GPUSH_GPU_MEMORY_FRACTION`` x the device's memory. GB are gpush's (GFD
  MiB / 1024); a MIG device holds at least its profile's named GB. The pod that pushes a
  time-sliced GPU (or a whole GPU or MIG device) past its memory, or an MPS client past
  memory/replicas, is OOMKilled after ``Timings.oom_after``. ``restartPolicy: Always``
  (and ``OnFailure`` on a non-zero exit) restarts the container after a CrashLoopBackOff delay.
  Pods marked for deletion are deleted with grace period 0 (the kubelet's confirmation). Output:
  what each container prints follows from its command (integration/k8s/container_output.py:
  ``echo``, simple ``sh -c`` scripts, ``python -c`` prints; nothing for other programs) and stops
  at the end its annotations give it; the log of each run (and of the one before a restart) is
  served at ``/containerLogs`` by integration/k8s/kubelet_server.py, which the nodes' ``InternalIP``
  and kubelet port name, so an API server's ``pods/log`` (``kubectl logs``) reaches it.
- ``JobController`` (batch/v1): ``min(parallelism, completions - succeeded)`` pods from the template
  (``completionMode: Indexed``: one per index not yet succeeded, lowest first, named
  ``<job>-<index>-<xxxxx>`` with the index in the ``batch.kubernetes.io/job-completion-index``
  annotation and label, ``JOB_COMPLETION_INDEX`` from it in every container, host name
  ``<job>-<index>``, and ``status.completedIndexes``; a Job completes once every index did),
  labelled ``batch.kubernetes.io/controller-uid``/``job-name`` (and the legacy
  ``controller-uid``/``job-name``), owned by the Job; failed pods are replaced after a back-off
  until failures exceed ``backoffLimit`` (default 6; restarts count under ``OnFailure``); then
  ``FailureTarget`` + ``Failed`` with reason ``BackoffLimitExceeded`` (a ``podFailurePolicy``
rule on a pod condition or exit code first: ``FailJob`` fails it with reason ``PodFailurePolicy``,
``Ignore`` does not count the failure); ``activeDeadlineSeconds``
  gives ``DeadlineExceeded``; success gives ``SuccessCriteriaMet`` + ``Complete`` (v1.31+ shape)
  with ``completionTime``. Status goes through the status subresource, written before the pods of a
  Job that ended are deleted (the ``FailureTarget``/``SuccessCriteriaMet`` order of v1.31).
- ``DeploymentController`` (apps/v1): keeps ``spec.replicas`` pods of the current template
  (``pod-template-hash`` label), scales up and down (the scale subresource only changes
  ``spec.replicas``), deletes pods of an older template at once (Recreate, not RollingUpdate),
  reports replicas/updated/ready/available and the Available/Progressing conditions.
- ``GarbageCollector``: deletes pods whose Job or Deployment owners are all gone, honours the
  ``foregroundDeletion`` and ``orphan`` finalizers on those owners, and deletes pods bound to a
  simulated node that was deleted, first marking them Failed with a ``DisruptionTarget``
  condition (``DeletionByPodGC``) as the Pod garbage collector does.
- ``DevicePlugin``: watches the ClusterPolicy (``nvidia.com/v1 clusterpolicies``,
  ``spec.devicePlugin.config.{name,default}``) and the ConfigMaps of the operator namespace, picks
  a config per node (label ``nvidia.com/device-plugin.config``, else the default, else the pool's
  own), and patches the node's GFD labels and ``capacity``/``allocatable`` when they differ.
- ``MigManager``: the GPU Operator's MIG manager: when a node's ``nvidia.com/mig.config`` label
  changes it applies that mig-parted config from the operator namespace's ConfigMap (ClusterPolicy
  ``spec.migManager.config.name``) after ``Timings.mig_reconfigure``, through the device plugin,
  and reports ``pending``, ``success`` or ``failed`` in ``nvidia.com/mig.config.state``.

Approximated, on purpose: no ReplicaSets (Deployment pods are owned by the Deployment; their names
still look like ``<deploy>-<hash>-<xxxxx>``); no preemption, priorities, pod affinity, topology
spread, volumes or ports; of pod anti-affinity only the incoming pod's required terms (a node in the
``topologyKey`` domain of a pod they select is filtered out, ``node(s) didn't match pod
anti-affinity rules``), not existing pods' terms against it; scoring is LeastAllocated on cpu and
memory over a small sample of feasible nodes from a rotating start; one exit code or OOM applies to
every container of a pod; ``OnFailure`` Job pods fail the Job through restarts like the real
controller but never become Failed pods themselves; Job pod names are chosen client-side, not by
``generateName``; pods are not held by the ``batch.kubernetes.io/job-tracking`` finalizer, so counts
are the larger of the status and the pods that still exist; node leases and heartbeats are not
renewed; a ConfigMap edit takes effect at once (the real device plugin may need a restart for a
content change, though it follows the node label); delays are short by default (``Timings``) and all
divided by ``speed``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import hashlib
import heapq
import itertools
import json
import logging
import math
import random
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache

from kubernetes import client
from kubernetes.client.rest import ApiException
from kubernetes.watch.watch import iter_resp_lines

from integration.k8s.apiserver_quantity import from_json
from integration.k8s.container_output import ContainerLog, program_output
from integration.k8s.gpu_nodes import (
    DEFAULT_MIG_PARTED_CONFIG,
    DEVICE_PLUGIN_CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    MIG_CONFIG_STATE_LABEL,
    MIG_PARTED_KEY,
    POOL_LABEL,
    SIMULATED_LABEL,
    GpuPool,
    NodeDevices,
    SharingConfig,
    mig_parted_layouts,
    node_devices,
    node_manifest,
    pools_from,
    reconfigured,
)
from integration.k8s.kubelet_server import KubeletError, KubeletServer

log = logging.getLogger("gpush.k8s.simulator")

ANN_DURATION = "sim.gpush.io/duration"
ANN_EXIT_CODE = "sim.gpush.io/exit-code"
ANN_OOM = "sim.gpush.io/oom"
ANN_GPU_MEMORY_GB = "sim.gpush.io/gpu-memory-gb"
ENV_GPU_MEMORY_GB = "GPUSH_GPU_MEMORY_GB"
ENV_GPU_MEMORY_FRACTION = "GPUSH_GPU_MEMORY_FRACTION"

SCHEDULER = "default-scheduler"
TERMINAL = ("Succeeded", "Failed")
MERGE = "application/merge-patch+json"
JOB_CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
JOB_NAME = "batch.kubernetes.io/job-name"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # annotation and label of an Indexed Job's Pod
POD_TEMPLATE_HASH = "pod-template-hash"
CLUSTER_POLICY = ("nvidia.com", "v1", "clusterpolicies")
_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery rand.String's alphabet


@dataclass(frozen=True)
class Timings:
    """Delays of the simulated cluster in seconds, before division by ``speed``."""

    pod_start: float = 0.2  # binding -> Running (a real kubelet: sandbox, image pull, start)
    oom_after: float = 0.3  # Running -> OOMKilled for a pod over its GPU memory, or sim.gpush.io/oom with no duration
    crash_backoff: float = 0.5  # first container restart delay, doubling (real kubelet: 10 s, up to 5 min)
    job_backoff: float = 0.2  # first Job pod re-creation delay after a failure, doubling (real: 10 s, up to 6 min)
    unschedulable_retry: float = 2.0  # periodic retry of unschedulable pods, besides event-driven retries
    mig_reconfigure: float = (
        0.3  # MIG manager: nvidia.com/mig.config label change -> layout applied (real: a minute or more)
    )

    def scaled(self, speed: float) -> Timings:
        return Timings(*(getattr(self, f) / speed for f in self.__dataclass_fields__))


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _parse_time(text: str | None) -> float | None:
    if not text:
        return None
    with contextlib.suppress(ValueError):
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    return None


def _meta(obj: Mapping) -> dict:
    return obj.get("metadata") or {}


def _key(obj: Mapping) -> str:
    md = _meta(obj)
    return f"{md['namespace']}/{md['name']}" if md.get("namespace") else md.get("name", "")


def _split(key: str) -> tuple[str, str]:
    ns, _, name = key.rpartition("/")
    return ns, name


def _rand5() -> str:
    return "".join(random.choices(_NAME_CHARS, k=5))


def _child_name(base: str) -> str:
    return f"{base[:57]}-{_rand5()}"


def _gone(exc: ApiException) -> bool:
    return exc.status in (404, 409)


def _exists(read: Callable[..., bytes], *args) -> bool:
    """Whether a live GET finds the object: a 404 from a subresource alone does not say which is missing."""
    try:
        read(*args)
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    return True


@lru_cache(maxsize=8192)
def _quantity(resource: str, text: str) -> int:
    """A quantity as an integer: cpu in millicores, everything else in units (bytes for memory).
    Read by the API server's own parser, so every form it stores reads as the server means it."""
    value = from_json(text).value
    return math.ceil(value * 1000) if resource == "cpu" else math.ceil(value)


def container_requests(container: Mapping) -> dict[str, int]:
    """A container's requests, a limit without a request counting as the request (API defaulting)."""
    resources = container.get("resources") or {}
    merged = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
    return {r: _quantity(r, str(v)) for r, v in merged.items()}


def pod_requests(spec: Mapping) -> dict[str, int]:
    """What NodeResourcesFit charges a pod: containers summed, init containers as a maximum, overhead added."""
    total: dict[str, int] = defaultdict(int)
    for c in spec.get("containers") or []:
        for r, v in container_requests(c).items():
            total[r] += v
    for c in spec.get("initContainers") or []:
        for r, v in container_requests(c).items():
            if c.get("restartPolicy") == "Always":  # a sidecar runs beside the containers
                total[r] += v
            else:
                total[r] = max(total[r], v)
    for r, v in (spec.get("overhead") or {}).items():
        total[r] += _quantity(r, str(v))
    return {r: v for r, v in total.items() if v > 0}


def _tolerates(tolerations: Iterable[Mapping], taint: Mapping) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        op = t.get("operator") or "Equal"
        if not t.get("key"):
            if op == "Exists":
                return True
            continue
        if t["key"] != taint.get("key"):
            continue
        if op == "Exists" or (t.get("value") or "") == (taint.get("value") or ""):
            return True
    return False


def _expression_matches(expr: Mapping, labels: Mapping[str, str]) -> bool:
    key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
    if op == "In":
        return key in labels and labels[key] in values
    if op == "NotIn":
        return labels.get(key) not in values
    if op == "Exists":
        return key in labels
    if op == "DoesNotExist":
        return key not in labels
    if op in ("Gt", "Lt"):
        try:
            have, want = int(labels[key]), int(values[0])
        except (KeyError, ValueError, IndexError):
            return False
        return have > want if op == "Gt" else have < want
    return False


def _selects(selector: Mapping, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) over ``labels``; an empty one selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    return all(_expression_matches(e, labels) for e in selector.get("matchExpressions") or ())


def matches_node(spec: Mapping, node_name: str, labels: Mapping[str, str]) -> bool:
    """nodeSelector and required node affinity (matchExpressions, matchFields on metadata.name)."""
    for k, v in (spec.get("nodeSelector") or {}).items():
        if labels.get(k) != v:
            return False
    affinity = (spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if not required:
        return True
    for term in required.get("nodeSelectorTerms") or []:
        exprs, fields_ = term.get("matchExpressions") or [], term.get("matchFields") or []
        if not exprs and not fields_:
            continue  # an empty term matches no node
        if all(_expression_matches(e, labels) for e in exprs) and all(
            _expression_matches(f, {"metadata.name": node_name}) for f in fields_
        ):
            return True
    return False


def _condition(obj: Mapping, kind: str) -> dict | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def _is_ready(pod: Mapping) -> bool:
    c = _condition(pod, "Ready")
    return bool(c and c.get("status") == "True")


def _phase(pod: Mapping) -> str:
    return (pod.get("status") or {}).get("phase") or "Pending"


def _controller_ref(obj: Mapping) -> dict | None:
    for ref in _meta(obj).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


# ---------------------------------------------------------------- watch and queue machinery


class Informer:
    """A cache of one resource type kept by list and watch; handlers get (type, obj, old)."""

    def __init__(
        self,
        name: str,
        list_fn: Callable,
        stop: threading.Event,
        *,
        page_size: int = 500,
        watch_timeout: int = 60,
        absent_retry: float = 2.0,
    ):
        self.name = name
        self.store: dict[str, dict] = {}
        self.synced = threading.Event()
        self.handlers: list[Callable[[str, dict, dict | None], None]] = []
        self._list = list_fn
        self._stop = stop
        self._page = page_size
        self._watch_timeout = watch_timeout
        self._absent_retry = absent_retry
        self._resp = None
        self._thread: threading.Thread | None = None
        self.relists = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"sim-informer-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        resp = self._resp
        if resp is not None:
            with contextlib.suppress(Exception):
                resp.shutdown()
            with contextlib.suppress(Exception):
                resp.close()

    def join(self, timeout: float) -> None:
        if self._thread:
            self._thread.join(timeout)

    def get(self, key: str) -> dict | None:
        return self.store.get(key)

    def items(self) -> list[dict]:
        return list(self.store.values())

    def _emit(self, kind: str, obj: dict, old: dict | None) -> None:
        for handler in self.handlers:
            try:
                handler(kind, obj, old)
            except Exception:
                log.exception("%s handler failed on %s %s", self.name, kind, _key(obj))

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            try:
                rv = self._relist()
                self.synced.set()
                backoff = 0.1
                self._watch(rv)
            except ApiException as exc:
                if self._stop.is_set():
                    break
                if exc.status == 404:  # the resource type is not served (yet): an empty cache, looked at later
                    self._replace({})
                    self.synced.set()
                    self._stop.wait(self._absent_retry)
                    continue
                if exc.status != 410:
                    log.warning("%s: list/watch failed (%s %s); retrying", self.name, exc.status, exc.reason)
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # connection reset, server restart, shutdown()
                if self._stop.is_set():
                    break
                log.debug("%s: watch interrupted (%r); resuming", self.name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 5.0)

    def _relist(self) -> str:
        items: list[dict] = []
        cont = None
        while True:
            kwargs = {"limit": self._page, "_preload_content": False, "_request_timeout": 60}
            if cont:
                kwargs["_continue"] = cont
            resp = self._list(**kwargs)
            try:
                data = json.loads(resp.data)
            finally:
                resp.release_conn()
            items += data.get("items") or []
            cont = (data.get("metadata") or {}).get("continue")
            if not cont:
                break
        self.relists += 1
        self._replace({_key(o): o for o in items})
        return (data.get("metadata") or {}).get("resourceVersion") or ""

    def _replace(self, new: dict[str, dict]) -> None:
        old = self.store
        self.store = new
        for key, obj in old.items():
            if key not in new:
                self._emit("DELETED", obj, obj)
        for key, obj in new.items():
            before = old.get(key)
            if before is None:
                self._emit("ADDED", obj, None)
            elif _meta(before).get("resourceVersion") != _meta(obj).get("resourceVersion"):
                self._emit("MODIFIED", obj, before)

    def _watch(self, rv: str) -> None:
        while not self._stop.is_set():
            kwargs = {
                "watch": True,
                "allow_watch_bookmarks": True,
                "timeout_seconds": self._watch_timeout,
                "_preload_content": False,
                "_request_timeout": (10, self._watch_timeout + 30),
            }
            if rv:
                kwargs["resource_version"] = rv
            resp = self._list(**kwargs)
            self._resp = resp
            try:
                for line in iter_resp_lines(resp):
                    if not line:
                        continue
                    event = json.loads(line)
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        if obj.get("code") == 410:
                            return  # too old: the caller re-lists
                        raise ApiException(status=obj.get("code") or 500, reason=obj.get("message"))
                    rv = _meta(obj).get("resourceVersion") or rv
                    if kind == "BOOKMARK":
                        continue
                    key = _key(obj)
                    if kind == "DELETED":
                        old = self.store.pop(key, None)
                        self._emit("DELETED", obj, old)
                    else:
                        old = self.store.get(key)
                        self.store[key] = obj
                        self._emit("ADDED" if old is None else "MODIFIED", obj, old)
                    if self._stop.is_set():
                        return
            finally:
                self._resp = None
                with contextlib.suppress(Exception):
                    resp.release_conn()


class WorkQueue:
    """A de-duplicating work queue: a key queued while it is processed is processed again after."""

    def __init__(self, name: str, stop: threading.Event):
        self.name = name
        self._stop = stop
        self._cv = threading.Condition()
        self._queue: deque[str] = deque()
        self._dirty: set[str] = set()
        self._processing: set[str] = set()
        self._timers: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._failures: dict[str, int] = defaultdict(int)

    def add(self, key: str) -> None:
        with self._cv:
            self._add_locked(key)

    def _add_locked(self, key: str) -> None:
        if key in self._dirty:
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._queue.append(key)
            self._cv.notify()

    def add_after(self, key: str, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        with self._cv:
            heapq.heappush(self._timers, (time.monotonic() + delay, next(self._seq), key))
            self._cv.notify()

    def get(self) -> str | None:
        with self._cv:
            while not self._stop.is_set():
                now = time.monotonic()
                while self._timers and self._timers[0][0] <= now:
                    self._add_locked(heapq.heappop(self._timers)[2])
                if self._queue:
                    key = self._queue.popleft()
                    self._dirty.discard(key)
                    self._processing.add(key)
                    return key
                wait = self._timers[0][0] - now if self._timers else 0.5
                self._cv.wait(min(wait, 0.5))
            return None

    def done(self, key: str, failed: bool = False) -> None:
        with self._cv:
            self._processing.discard(key)
            if key in self._dirty:
                self._queue.append(key)
                self._cv.notify()
        if failed:
            self._failures[key] += 1
            self.add_after(key, min(0.05 * 2 ** self._failures[key], 5.0))
        else:
            self._failures.pop(key, None)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def busy(self) -> bool:
        with self._cv:
            return bool(self._queue or self._processing)


def _run_worker(queue: WorkQueue, fn: Callable[[str], None]) -> None:
    while (key := queue.get()) is not None:
        failed = False
        try:
            fn(key)
        except ApiException as exc:
            failed = True
            log.debug("%s %s: API error %s %s; retrying", queue.name, key, exc.status, exc.reason)
        except Exception:
            failed = True
            log.exception("%s %s failed; retrying", queue.name, key)
        finally:
            queue.done(key, failed)


class _Expectations:
    """Pods a controller created or deleted that its cache has not shown yet (client-go's expectations)."""

    TTL = 5.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adds: dict[str, set[str]] = {}
        self._dels: dict[str, set[str]] = {}
        self._since: dict[str, float] = {}

    def expect(self, owner: str, adds: Iterable[str] = (), dels: Iterable[str] = ()) -> None:
        with self._lock:
            self._adds.setdefault(owner, set()).update(adds)
            self._dels.setdefault(owner, set()).update(dels)
            self._since[owner] = time.monotonic()

    def forget_add(self, owner: str, name: str) -> None:
        with self._lock:
            self._adds.get(owner, set()).discard(name)

    def observed(self, owner: str, name: str | None = None, uid: str | None = None) -> None:
        with self._lock:
            if name:
                self._adds.get(owner, set()).discard(name)
            if uid:
                self._dels.get(owner, set()).discard(uid)

    def pending_adds(self, owner: str) -> set[str]:
        with self._lock:
            if time.monotonic() - self._since.get(owner, 0) > self.TTL:
                self._adds.pop(owner, None)
                self._dels.pop(owner, None)
                return set()
            return set(self._adds.get(owner, ()))

    def pending_dels(self, owner: str) -> set[str]:
        with self._lock:
            if time.monotonic() - self._since.get(owner, 0) > self.TTL:
                return set()
            return set(self._dels.get(owner, ()))

    def drop(self, owner: str) -> None:
        with self._lock:
            self._adds.pop(owner, None)
            self._dels.pop(owner, None)
            self._since.pop(owner, None)


# ---------------------------------------------------------------- shared context


class _Writer:
    """An API object whose calls return the raw response body and hand the connection back at once.

    Skipping the client's model deserialization saves most of a request's CPU; reading the body and
    releasing the connection keeps it in the pool for the next request.
    """

    def __init__(self, api):
        self._api = api

    def __getattr__(self, name: str) -> Callable[..., bytes]:
        method = getattr(self._api, name)

        def call(*args, **kwargs) -> bytes:
            resp = method(*args, _preload_content=False, **kwargs)
            try:
                return resp.data
            finally:
                resp.release_conn()

        call.__name__ = name
        return call


class _Cluster:
    """What every component shares: the clients, the caches, the write pool, events and gaps."""

    def __init__(self, api_client, *, timings: Timings, speed: float, record_events: bool, workers: int):
        # Our own client, its pool sized for every watch and worker at once: a pool smaller than the
        # concurrency makes urllib3 open (and drop) a connection per request.
        configuration = copy.deepcopy(api_client.configuration)
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, 2 * workers + 32)
        self.api_client = client.ApiClient(configuration)
        self.read_core = client.CoreV1Api(self.api_client)
        self.read_batch = client.BatchV1Api(self.api_client)
        self.read_apps = client.AppsV1Api(self.api_client)
        self.read_custom = client.CustomObjectsApi(self.api_client)
        self.core = _Writer(self.read_core)
        self.batch = _Writer(self.read_batch)
        self.apps = _Writer(self.read_apps)
        self.timings = timings
        self.speed = speed
        self.record_events = record_events
        self.stop = threading.Event()
        self.writes = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-write")
        self.gaps: set[str] = set()
        self.pools: dict[str, GpuPool] = {}
        self.managed: set[str] = set()  # simulated node names seen in the node cache
        self.pods: Informer
        self.nodes: Informer
        self.jobs: Informer
        self.deployments: Informer
        self.configmaps: Informer
        self.policies: Informer
        self.counters: dict[str, int] = defaultdict(int)
        self._count_lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self.counters[name] += n

    def submit(self, fn: Callable, *args, **kwargs) -> None:
        if self.stop.is_set():
            return

        def run() -> None:
            try:
                fn(*args, **kwargs)
            except ApiException as exc:
                if not _gone(exc):
                    log.warning("%s failed: %s %s", getattr(fn, "__name__", fn), exc.status, exc.reason)
            except Exception:
                if not self.stop.is_set():
                    log.exception("%s failed", getattr(fn, "__name__", fn))

        with contextlib.suppress(RuntimeError):  # the pool is shut down while stopping
            self.writes.submit(run)

    def event(
        self,
        kind: str,
        api_version: str,
        obj: Mapping,
        reason: str,
        message: str,
        *,
        warning: bool = False,
        component: str = SCHEDULER,
    ) -> None:
        """Records a core/v1 Event about ``obj`` (Warnings always, Normal ones when enabled)."""
        if not warning and not self.record_events:
            return
        md = _meta(obj)
        ns = md.get("namespace") or "default"
        now = _now()
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{md.get('name')}.{random.getrandbits(64):016x}", "namespace": ns},
            "involvedObject": {
                "apiVersion": api_version,
                "kind": kind,
                "name": md.get("name"),
                "namespace": md.get("namespace"),
                "uid": md.get("uid"),
                "resourceVersion": md.get("resourceVersion"),
            },
            "reason": reason,
            "message": message,
            "type": "Warning" if warning else "Normal",
            "source": {"component": component},
            "reportingComponent": component,
            "reportingInstance": f"{component}-sim",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        self.submit(self.core.create_namespaced_event, ns, body)

    def delete_pod(self, pod: Mapping, *, grace: int | None = None, unchanged: bool = False) -> None:
        """Deletes this pod (its uid), or with ``unchanged`` only the very version given (409 otherwise, ignored)."""
        md = _meta(pod)
        preconditions = {"uid": md.get("uid")}
        if unchanged:
            preconditions["resourceVersion"] = md.get("resourceVersion")
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions}
        if grace is not None:
            body["gracePeriodSeconds"] = grace
        try:
            self.core.delete_namespaced_pod(md["name"], md["namespace"], body=body)
        except ApiException as exc:
            if not _gone(exc):
                raise

    def patch_status(self, kind: str, name: str, namespace: str, body: dict) -> None:
        """Writes status through the status subresource, falling back to the object if the server lacks it."""
        status_fn, plain_fn, gap = {
            "Job": (self.batch.patch_namespaced_job_status, self.batch.patch_namespaced_job, "batch/v1 jobs/status"),
            "Deployment": (
                self.apps.patch_namespaced_deployment_status,
                self.apps.patch_namespaced_deployment,
                "apps/v1 deployments/status",
            ),
        }[kind]
        if gap not in self.gaps:
            try:
                status_fn(name, namespace, body, _content_type=MERGE)
                return
            except ApiException as exc:
                read = self.batch.read_namespaced_job if kind == "Job" else self.apps.read_namespaced_deployment
                if exc.status not in (404, 405) or not _exists(read, name, namespace):
                    raise
                self.gaps.add(gap)
                log.warning("the server has no %s subresource; patching the object instead", gap)
        plain_fn(name, namespace, body, _content_type=MERGE)


# ---------------------------------------------------------------- scheduler


class _NodeInfo:
    __slots__ = ("name", "allocatable", "labels", "taints", "unschedulable")

    def __init__(self, node: Mapping):
        md, spec, status = _meta(node), node.get("spec") or {}, node.get("status") or {}
        self.name = md["name"]
        self.allocatable = {r: _quantity(r, str(v)) for r, v in (status.get("allocatable") or {}).items()}
        self.labels = dict(md.get("labels") or {})
        self.taints = [t for t in spec.get("taints") or [] if t.get("effect") in ("NoSchedule", "NoExecute")]
        self.unschedulable = bool(spec.get("unschedulable"))

    def same(self, other: _NodeInfo) -> bool:
        return (self.allocatable, self.labels, self.taints, self.unschedulable) == (
            other.allocatable,
            other.labels,
            other.taints,
            other.unschedulable,
        )


class Scheduler:
    """Binds pending pods to nodes where they fit, or leaves them Unschedulable as kube-scheduler does.

    One cycle, for one pod taken from the active queue:
    1. skip a pod that is bound, terminating, terminal, gated, or for another scheduler;
    2. compute its requests (``pod_requests``);
    3. filter nodes in the default plugins' order: NodeUnschedulable, TaintToleration, NodeAffinity,
       NodeResourcesFit (pods, then each requested resource) against the free resources kept in
       memory, which count every bound non-terminal pod (terminating ones too) and every assumed pod,
       then InterPodAffinity (the pod's required anti-affinity terms);
    4. take the least allocated (cpu, memory) of the first ``sample`` feasible nodes from a rotating
       start, over the nodes that offer the pod's scarcest extended resource;
    5. assume the pod there and bind it on the write pool; a failed binding forgets the assumption
       and re-queues the pod;
    6. with no feasible node, write PodScheduled=False/Unschedulable with FitError's message and a
       FailedScheduling event when the message changes, and park the pod until a node changes, a pod
       frees resources, or ``Timings.unschedulable_retry`` passes.
    """

    MOVE_INTERVAL = 0.05  # seconds between two moves of the parked pods back to the active queue

    def __init__(self, cluster: _Cluster, *, name: str = SCHEDULER, sample: int = 8):
        self.c = cluster
        self.name = name
        self.sample = sample
        self._lock = threading.RLock()
        self._nodes: dict[str, _NodeInfo] = {}
        self._order: list[str] = []
        self._by_resource: dict[str, list[str]] = {}
        self._index_dirty = True
        self._requested: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self._bound: dict[str, tuple[str, dict[str, int]]] = {}
        self._assumed: dict[str, tuple[str, dict[str, int]]] = {}
        self._labels: dict[str, tuple[str, dict[str, str]]] = {}  # uid -> (namespace, labels), bound or assumed
        self._active: deque[str] = deque()
        self._queued: set[str] = set()
        self._parked: dict[str, str] = {}  # pod key -> uid
        self._reported: dict[str, str] = {}  # uid -> last Unschedulable message written
        # Placing a pod only makes fit harder, so a failure stays true until something is freed
        # (a pod ends, a node is added or changes): failures are cached per scheduling signature
        # and generation of freed capacity, which keeps thousands of waiting pods cheap to retry.
        self._freed = 0
        self._failures: dict[str, tuple[int, str]] = {}
        self._move_all = False
        self._cv = threading.Condition(self._lock)
        self._rr = 0
        self._thread: threading.Thread | None = None

    # cache maintenance, called from informer threads

    def on_node(self, kind: str, node: dict, old: dict | None) -> None:
        name = _meta(node)["name"]
        with self._lock:
            if kind == "DELETED":
                self._nodes.pop(name, None)
            else:
                info = _NodeInfo(node)
                before = self._nodes.get(name)
                self._nodes[name] = info
                if before is not None and before.same(info):
                    return
            self._index_dirty = True
            self._freed += 1
            self._request_move()

    def _charge(self, node: str, req: Mapping[str, int], sign: int) -> None:
        used = self._requested[node]
        for r, v in req.items():
            used[r] += sign * v
        used["pods"] += sign

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        md, spec = _meta(pod), pod.get("spec") or {}
        uid, key, node = md.get("uid"), _key(pod), spec.get("nodeName")
        holds = kind != "DELETED" and bool(node) and _phase(pod) not in TERMINAL
        with self._lock:
            if holds:
                if uid in self._bound:
                    return
                req = pod_requests(spec)
                assumed = self._assumed.pop(uid, None)
                if assumed:
                    self._charge(assumed[0], assumed[1], -1)
                self._charge(node, req, +1)
                self._bound[uid] = (node, req)
                self._labels[uid] = (md.get("namespace", ""), dict(md.get("labels") or {}))
                self._parked.pop(key, None)
                self._reported.pop(uid, None)
                return
            freed = False
            # a bound pod that ended or went away frees its node; an assumed one only when deleted
            for table in (self._bound, self._assumed) if kind == "DELETED" else (self._bound,):
                held = table.pop(uid, None)
                if held:
                    self._charge(held[0], held[1], -1)
                    freed = True
            if uid not in self._bound and uid not in self._assumed:
                self._labels.pop(uid, None)
            if kind == "DELETED":
                self._parked.pop(key, None)
                self._reported.pop(uid, None)
            elif self._wants(pod) and (kind == "ADDED" or key not in self._parked):
                self._enqueue(key)
            if freed:
                self._freed += 1
                self._request_move()

    def _wants(self, pod: Mapping) -> bool:
        md, spec = _meta(pod), pod.get("spec") or {}
        return (
            not spec.get("nodeName")
            and not md.get("deletionTimestamp")
            and _phase(pod) == "Pending"
            and (spec.get("schedulerName") or SCHEDULER) == self.name
            and not spec.get("schedulingGates")
        )

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._active.append(key)
            self._cv.notify()

    def _request_move(self) -> None:
        if self._parked:
            self._move_all = True
            self._cv.notify()

    # the scheduling loop

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        with self._lock:
            self._cv.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread:
            self._thread.join(timeout)

    def _loop(self) -> None:
        last_flush = time.monotonic()
        while not self.c.stop.is_set():
            with self._lock:
                now = time.monotonic()
                moving = self._move_all and now - last_flush >= self.MOVE_INTERVAL
                if self._parked and (moving or now - last_flush >= self.c.timings.unschedulable_retry):
                    for key in list(self._parked):
                        self._enqueue(key)
                    self._parked.clear()
                    self._move_all = False
                    last_flush = now
                if not self._active:
                    self._cv.wait(self.MOVE_INTERVAL if self._move_all else 0.2)
                    continue
                key = self._active.popleft()
                self._queued.discard(key)
            try:
                self._schedule_one(key)
            except Exception:
                log.exception("scheduling %s failed", key)

    def _schedule_one(self, key: str) -> None:
        pod = self.c.pods.get(key)
        if pod is None or not self._wants(pod):
            return
        uid = _meta(pod).get("uid")
        spec = pod.get("spec") or {}
        req = pod_requests(spec)
        signature = json.dumps(
            [
                sorted(req.items()),
                spec.get("nodeSelector"),
                (spec.get("affinity") or {}).get("nodeAffinity"),
                spec.get("tolerations"),
                (spec.get("affinity") or {}).get("podAntiAffinity"),
                _meta(pod).get("namespace") if (spec.get("affinity") or {}).get("podAntiAffinity") else None,
            ],
            sort_keys=True,
        )
        with self._lock:
            if uid in self._assumed or uid in self._bound:
                return
            cached = self._failures.get(signature)
            blocked = self._anti_affinity_blocked(spec, _meta(pod).get("namespace", ""))
            node = None if cached and cached[0] == self._freed else self._select(spec, req, blocked)
            if node is not None:
                self._assumed[uid] = (node, req)
                self._labels[uid] = (_meta(pod).get("namespace", ""), dict(_meta(pod).get("labels") or {}))
                self._charge(node, req, +1)
            else:
                if cached and cached[0] == self._freed:
                    message = cached[1]
                else:
                    message = self._fit_error(spec, req, blocked)
                    self._failures[signature] = (self._freed, message)
                    if len(self._failures) > 10_000:
                        self._failures.clear()
                self._parked[key] = uid
                if self._reported.get(uid) == message:
                    return
                self._reported[uid] = message
        if node is not None:
            self.c.count("binds")
            self.c.submit(self._bind, pod, node)
        else:
            self.c.count("unschedulable")
            self.c.submit(self._mark_unschedulable, pod, message)

    def _refresh_index(self) -> None:
        if not self._index_dirty:
            return
        self._order = sorted(self._nodes)
        by_resource: dict[str, list[str]] = defaultdict(list)
        for name in self._order:
            for r, v in self._nodes[name].allocatable.items():
                if v > 0 and "/" in r:
                    by_resource[r].append(name)
        self._by_resource = dict(by_resource)
        self._index_dirty = False

    def _anti_affinity_blocked(self, spec: Mapping, namespace: str) -> frozenset[str]:
        """Nodes the pod's required pod anti-affinity keeps it off: those in the topology domain
        (the node label ``topologyKey``) of a bound or assumed pod its term selects (the term's
        namespaces, else the pod's own). The other direction (an existing pod's anti-affinity
        against this one) is not played."""
        terms = ((spec.get("affinity") or {}).get("podAntiAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution"
        ) or []
        blocked: set[str] = set()
        for term in terms:
            key = term.get("topologyKey") or ""
            namespaces = set(term.get("namespaces") or ()) or {namespace}
            selector = term.get("labelSelector") or {}
            domains: set[str] = set()
            for uid, (ns, labels) in self._labels.items():
                held = self._bound.get(uid) or self._assumed.get(uid)
                if held is None or ns not in namespaces or not _selects(selector, labels):
                    continue
                node = self._nodes.get(held[0])
                if node is not None and key in node.labels:
                    domains.add(node.labels[key])
            blocked.update(name for name, info in self._nodes.items() if info.labels.get(key) in domains)
        return frozenset(blocked)

    def _reasons(
        self, spec: Mapping, req: Mapping[str, int], info: _NodeInfo, blocked: frozenset[str] = frozenset()
    ) -> tuple[list[str], bool]:
        """Why ``info`` cannot take the pod (empty if it can), and whether eviction could never help."""
        tolerations = spec.get("tolerations") or []
        if info.unschedulable and not _tolerates(
            tolerations, {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
        ):
            return ["node(s) were unschedulable"], True
        for taint in info.taints:
            if not _tolerates(tolerations, taint):
                return [f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"], True
        if not matches_node(spec, info.name, info.labels):
            return ["node(s) didn't match Pod's node affinity/selector"], True
        used = self._requested.get(info.name, {})
        alloc = info.allocatable
        reasons, unresolvable = [], False
        if used.get("pods", 0) + 1 > alloc.get("pods", 110):
            reasons.append("Too many pods")
        for r, v in req.items():
            have = alloc.get(r, 0)
            if used.get(r, 0) + v > have:
                reasons.append(f"Insufficient {r}")
                unresolvable = unresolvable or v > have
        if not reasons and info.name in blocked:  # InterPodAffinity filters after NodeResourcesFit
            return ["node(s) didn't match pod anti-affinity rules"], False
        return reasons, unresolvable

    def _select(self, spec: Mapping, req: Mapping[str, int], blocked: frozenset[str] = frozenset()) -> str | None:
        self._refresh_index()
        extended = [r for r in req if "/" in r]
        if extended:
            candidates = min((self._by_resource.get(r, []) for r in extended), key=len)
        else:
            candidates = self._order
        if not candidates:
            return None
        n = len(candidates)
        start = self._rr % n
        self._rr += 1
        best, best_score, found = None, None, 0
        for i in range(n):
            info = self._nodes.get(candidates[(start + i) % n])
            if info is None:
                continue
            reasons, _ = self._reasons(spec, req, info, blocked)
            if reasons:
                continue
            used = self._requested.get(info.name, {})
            score = sum(
                (used.get(r, 0) + req.get(r, 0)) / info.allocatable[r]
                for r in ("cpu", "memory")
                if info.allocatable.get(r)
            )
            if best_score is None or score < best_score:
                best, best_score = info.name, score
            found += 1
            if found >= self.sample or i >= 64:
                break
        return best

    def _fit_error(self, spec: Mapping, req: Mapping[str, int], blocked: frozenset[str] = frozenset()) -> str:
        n = len(self._nodes)
        if n == 0:
            return "no nodes available to schedule pods"
        reasons: dict[str, int] = defaultdict(int)
        verdicts: dict[str, int] = defaultdict(int)
        for info in self._nodes.values():
            node_reasons, unresolvable = self._reasons(spec, req, info, blocked)
            for r in node_reasons:
                reasons[r] += 1
            if unresolvable or not node_reasons:
                verdicts["Preemption is not helpful for scheduling"] += 1
            else:
                verdicts["No preemption victims found for incoming pod"] += 1

        def histogram(counts: Mapping[str, int]) -> str:
            return ", ".join(sorted(f"{v} {k}" for k, v in counts.items()))

        return (
            f"0/{n} nodes are available: {histogram(reasons)}. "
            f"preemption: 0/{n} nodes are available: {histogram(verdicts)}."
        )

    def _forget(self, pod: Mapping, requeue_after: float | None) -> None:
        uid, key = _meta(pod).get("uid"), _key(pod)
        with self._lock:
            held = self._assumed.pop(uid, None)
            if held:
                self._charge(held[0], held[1], -1)
                self._request_move()
        if requeue_after is not None:
            timer = threading.Timer(requeue_after, self._requeue, args=(key,))
            timer.daemon = True
            timer.start()

    def _requeue(self, key: str) -> None:
        with self._lock:
            pod = self.c.pods.get(key)
            if pod is not None and self._wants(pod):
                self._enqueue(key)

    def _bind(self, pod: Mapping, node: str) -> None:
        md = _meta(pod)
        name, ns, uid = md["name"], md["namespace"], md.get("uid")
        try:
            if "pods/binding subresource" in self.c.gaps:
                self._bind_by_patch(name, ns, node)
            else:
                body = {
                    "apiVersion": "v1",
                    "kind": "Binding",
                    "metadata": {"name": name, "namespace": ns, "uid": uid},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node},
                }
                try:
                    self.c.core.create_namespaced_pod_binding(name, ns, body)
                except ApiException as exc:
                    if exc.status not in (404, 405) or not _exists(self.c.core.read_namespaced_pod, name, ns):
                        raise
                    self._bind_by_patch(name, ns, node)
                    self.c.gaps.add("pods/binding subresource")
                    log.warning("the server has no pods/binding subresource; binding by patching spec.nodeName")
        except ApiException as exc:
            self._forget(pod, None if exc.status == 404 else 0.2)
            if exc.status not in (404, 409):
                log.warning("binding %s/%s to %s failed: %s %s", ns, name, node, exc.status, exc.reason)
            return
        except Exception:
            self._forget(pod, 0.5)
            raise
        self.c.event("Pod", "v1", pod, "Scheduled", f"Successfully assigned {ns}/{name} to {node}")

    def _bind_by_patch(self, name: str, ns: str, node: str) -> None:
        self.c.core.patch_namespaced_pod(name, ns, {"spec": {"nodeName": node}}, _content_type=MERGE)

    def _mark_unschedulable(self, pod: Mapping, message: str) -> None:
        md = _meta(pod)
        conditions = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "PodScheduled"]
        conditions.append(
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": message,
                "lastProbeTime": None,
                "lastTransitionTime": _now(),
            }
        )
        self.c.core.patch_namespaced_pod_status(
            md["name"],
            md["namespace"],
            {"status": {"conditions": conditions}},
            _content_type=MERGE,
        )
        self.c.event("Pod", "v1", pod, "FailedScheduling", message, warning=True)

    def free(self, node: str) -> dict[str, int]:
        """Allocatable minus what bound and assumed pods request on ``node`` (pods included)."""
        with self._lock:
            info = self._nodes.get(node)
            if info is None:
                return {}
            used = self._requested.get(node, {})
            return {r: v - used.get(r, 0) for r, v in info.allocatable.items()}

    def pending(self) -> int:
        with self._lock:
            return len(self._active) + len(self._assumed)


# ---------------------------------------------------------------- kubelet


@dataclass
class _Run:
    """What the simulated kubelet knows of one pod it runs."""

    uid: str
    node: str
    stage: str  # starting | running | backoff | done
    due: float
    start_time: str = ""
    started_at: str = ""
    restarts: int = 0
    exit: tuple[int, str] | None = None
    last_terminated: dict | None = None
    claims: list[tuple[int, float]] = field(default_factory=list)  # (device index, GB held)
    pod_ip: str = ""
    container_ids: dict[str, str] = field(default_factory=dict)
    timer: float = math.inf  # the due time a queue timer is already set for
    logs: dict[str, ContainerLog] = field(default_factory=dict)  # each container's current (or last) run
    previous: dict[str, ContainerLog] = field(default_factory=dict)  # the run before it, after a restart

    def end_logs(self) -> None:
        for container_log in self.logs.values():
            container_log.end()


class Kubelet:
    """Runs the pods bound to simulated nodes: phases, container states, GPU claims and memory, and
    keeps each container run's log (integration/k8s/container_output.py) for the kubelet server."""

    def __init__(self, cluster: _Cluster, plugin: DevicePlugin):
        self.c = cluster
        self.plugin = plugin
        self.queue = WorkQueue("kubelet", cluster.stop)
        self._runs: dict[str, _Run] = {}
        self._lock = threading.Lock()
        self._usage: dict[tuple[str, int], list[float]] = defaultdict(lambda: [0, 0.0])  # replicas, GB
        self._ips = itertools.count(1)
        self._by_node: dict[str, set[str]] = defaultdict(set)
        self._index_lock = threading.Lock()

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        key = _key(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        with self._index_lock:
            if kind == "DELETED" or _phase(pod) in TERMINAL:
                if node:
                    self._by_node[node].discard(key)
            elif node:
                self._by_node[node].add(key)
        if (node and node in self.c.managed) or key in self._runs:
            self.queue.add(key)

    def node_added(self, node: str) -> None:
        """Pods seen before their simulated node was: run them now."""
        with self._index_lock:
            keys = list(self._by_node.get(node, ()))
        for key in keys:
            self.queue.add(key)

    def _schedule(self, key: str, run: _Run) -> None:
        if run.due != math.inf and run.due != run.timer:
            run.timer = run.due
            self.queue.add_after(key, max(run.due - time.monotonic(), 0))

    def claims(self, key: str) -> list[tuple[str, int]]:
        """(resource, physical GPU index) of every device the pod holds."""
        run = self._runs.get(key)
        if run is None:
            return []
        devices = self.plugin.devices(run.node)
        if devices is None:
            return []
        return [
            (devices.devices[i].resource, devices.devices[i].gpu) for i, _ in run.claims if i < len(devices.devices)
        ]

    def _container_log(self, pod: Mapping, container: Mapping, started: float | None = None) -> ContainerLog:
        lines = program_output(container, _meta(pod).get("name", ""), pod)
        return ContainerLog(lines, started=started, speed=self.c.speed)

    def container_log(self, namespace: str, name: str, container: str, previous: bool) -> ContainerLog:
        """The log the kubelet server answers ``/containerLogs/<namespace>/<name>/<container>`` with,
        or :class:`KubeletError` in the kubelet's words (server.go, ``validateContainerLogStatus``)."""
        key = f"{namespace}/{name}"
        pod = self.c.pods.get(key)
        if pod is None or (pod.get("spec") or {}).get("nodeName") not in self.c.managed:
            raise KubeletError(404, f'pod "{name}" does not exist')
        spec = pod.get("spec") or {}
        by_name = {c.get("name"): c for c in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]}
        if container not in by_name:
            raise KubeletError(404, f'container "{container}" not found in pod "{name}"')
        run = self._runs.get(key)
        if run is not None and run.uid != _meta(pod).get("uid"):
            run = None
        if previous:
            if run is None or container not in run.previous:
                raise KubeletError(400, f'previous terminated container "{container}" in pod "{name}" not found')
            return run.previous[container]
        if run is None and _phase(pod) in TERMINAL:
            return self._finished_log(pod, by_name[container])
        if run is None or run.stage == "starting" or container not in run.logs:
            raise KubeletError(400, f'container "{container}" in pod "{name}" is waiting to start: ContainerCreating')
        if run.stage == "backoff" and container in run.previous:
            return run.previous[container]  # waiting to restart: the last terminated run's log
        return run.logs[container]

    def _finished_log(self, pod: Mapping, container: Mapping) -> ContainerLog:
        """A finished Pod this process did not run (a restarted simulator): its log again, from the
        times in its status (whole seconds, so a line near the end may fall either side of it)."""
        name = container.get("name")
        statuses = (pod.get("status") or {}).get("containerStatuses") or ()
        state = next((s.get("state") or {} for s in statuses if s.get("name") == name), {})
        terminated = state.get("terminated") or {}
        started, finished = _parse_time(terminated.get("startedAt")), _parse_time(terminated.get("finishedAt"))
        if started is None or finished is None:
            pod_name = _meta(pod).get("name")
            raise KubeletError(400, f'container "{name}" in pod "{pod_name}" is terminated')
        container_log = self._container_log(pod, container, started)
        container_log.end(finished + 1.0)
        return container_log

    def reconcile(self, key: str) -> None:
        pod = self.c.pods.get(key)
        run = self._runs.get(key)
        if run is not None and (pod is None or _meta(pod).get("uid") != run.uid):
            self._release(run)
            run.end_logs()  # its logs go with the Pod; followers see the end
            self._runs.pop(key, None)
            run = None
        if pod is None:
            return
        md, spec = _meta(pod), pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or node not in self.c.managed:
            return
        if md.get("deletionTimestamp"):
            if run is not None:
                self._release(run)
                run.end_logs()
                self._runs.pop(key, None)
            self.c.delete_pod(pod, grace=0)
            return
        now = time.monotonic()
        if run is None:
            if _phase(pod) in TERMINAL:
                return
            run = self._adopt(pod, node, now)
            self._runs[key] = run
        if run.stage == "done":
            return
        if now >= run.due:
            if run.stage in ("starting", "backoff"):
                self._start(pod, run, now)
            elif run.stage == "running":
                self._finish(pod, run, now)
        self._schedule(key, run)

    def _adopt(self, pod: Mapping, node: str, now: float) -> _Run:
        uid = _meta(pod).get("uid")
        if _phase(pod) != "Running":
            return _Run(uid=uid, node=node, stage="starting", due=now + self.c.timings.pod_start)
        # a pod this process did not start (a restarted simulator): carry on from its status
        status = pod.get("status") or {}
        statuses = status.get("containerStatuses") or [{}]
        started = ((statuses[0].get("state") or {}).get("running") or {}).get("startedAt") or status.get("startTime")
        run = _Run(
            uid=uid,
            node=node,
            stage="running",
            due=math.inf,
            start_time=status.get("startTime") or _now(),
            started_at=started or _now(),
            restarts=int(statuses[0].get("restartCount") or 0),
            pod_ip=status.get("podIP") or "",
        )
        self._claim(pod, run)
        started_wall = _parse_time(started)
        for c in (pod.get("spec") or {}).get("containers") or []:
            run.logs[c["name"]] = self._container_log(pod, c, started_wall)
        exit_ = self._planned_exit(pod)
        if exit_ is not None:
            elapsed = time.time() - (_parse_time(started) or time.time())
            run.exit, run.due = exit_[0], now + max(exit_[1] - elapsed, 0)
        return run

    def _duration(self, pod: Mapping) -> float | None:
        text = (_meta(pod).get("annotations") or {}).get(ANN_DURATION)
        if text is None:
            return None
        try:
            return max(float(text), 0.0) / self.c.speed
        except ValueError:
            log.warning("%s: %s=%r is not a number of seconds; running forever", _key(pod), ANN_DURATION, text)
            return None

    def _planned_exit(self, pod: Mapping) -> tuple[tuple[int, str], float] | None:
        annotations = _meta(pod).get("annotations") or {}
        duration = self._duration(pod)
        if annotations.get(ANN_OOM, "").lower() == "true":
            return (137, "OOMKilled"), duration if duration is not None else self.c.timings.oom_after
        if duration is None:
            return None
        try:
            code = int(annotations.get(ANN_EXIT_CODE, "0"))
        except ValueError:
            code = 1
        return (code, "Completed" if code == 0 else "Error"), duration

    def _memory_demand(self, pod: Mapping) -> tuple[float | None, float | None]:
        """GPU memory the pod uses per device: (GB, fraction of the device), either may be None."""
        annotated = (_meta(pod).get("annotations") or {}).get(ANN_GPU_MEMORY_GB)
        if annotated is not None:
            with contextlib.suppress(ValueError):
                return float(annotated), None
        gb = fraction = None
        for c in (pod.get("spec") or {}).get("containers") or []:
            for env in c.get("env") or []:
                with contextlib.suppress(TypeError, ValueError):
                    if env.get("name") == ENV_GPU_MEMORY_GB:
                        gb = (gb or 0.0) + float(env.get("value"))
                    elif env.get("name") == ENV_GPU_MEMORY_FRACTION:
                        fraction = max(fraction or 0.0, float(env.get("value")))
        return gb, fraction

    def _claim(self, pod: Mapping, run: _Run) -> bool:
        """Gives the pod its devices (replicas spread over GPUs); False if its GPU memory does not fit."""
        devices = self.plugin.devices(run.node)
        if devices is None:
            return True
        gb, fraction = self._memory_demand(pod)
        fits = True
        with self._lock:
            for c in (pod.get("spec") or {}).get("containers") or []:
                for resource, units in container_requests(c).items():
                    candidates = [i for i, d in enumerate(devices.devices) if d.resource == resource]
                    chosen: list[int] = []
                    for _ in range(units):
                        if not candidates:
                            break
                        i = min(
                            candidates,
                            key=lambda j: (j in chosen, self._usage[(run.node, j)][0] / devices.devices[j].replicas),
                        )
                        chosen.append(i)
                        self._usage[(run.node, i)][0] += 1
                    for i in chosen:
                        device = devices.devices[i]
                        size = device.memory_gb
                        demand = gb if gb is not None else (fraction * size if fraction is not None else 0.0)
                        usage = self._usage[(run.node, i)]
                        if device.sharing == "mps" and device.replicas > 1:
                            over = demand > size / device.replicas
                        else:
                            over = usage[1] + demand > size + 1e-9
                        if over:
                            fits = False
                            demand = 0.0
                        usage[1] += demand
                        run.claims.append((i, demand))
        return fits

    def _release(self, run: _Run) -> None:
        with self._lock:
            for i, gb in run.claims:
                usage = self._usage[(run.node, i)]
                usage[0] -= 1
                usage[1] -= gb
            run.claims.clear()

    def _start(self, pod: Mapping, run: _Run, now: float) -> None:
        fits = self._claim(pod, run)
        planned = self._planned_exit(pod)
        if not fits:
            run.exit, run.due = (137, "OOMKilled"), now + self.c.timings.oom_after
        elif planned is not None:
            run.exit, run.due = planned[0], now + planned[1]
        else:
            run.exit, run.due = None, math.inf
        if run.stage == "backoff":
            run.restarts += 1
        run.stage = "running"
        run.started_at = _now()
        run.start_time = run.start_time or run.started_at
        if not run.pod_ip:
            n = next(self._ips)
            run.pod_ip = f"10.{128 + (n >> 16) % 64}.{(n >> 8) % 256}.{n % 256}"
        containers = (pod.get("spec") or {}).get("containers") or []
        for c in containers:
            run.container_ids[c["name"]] = f"containerd://{random.getrandbits(256):064x}"
            if c["name"] in run.logs:
                run.previous[c["name"]] = run.logs[c["name"]]
            run.logs[c["name"]] = self._container_log(pod, c)
        statuses = [
            self._container_status(c, run, {"running": {"startedAt": run.started_at}}, ready=True) for c in containers
        ]
        self._write(pod, run, "Running", statuses, ready=True)
        self.c.count("pods_started")

    def _container_status(self, container: Mapping, run: _Run, state: dict, *, ready: bool) -> dict:
        status = {
            "name": container["name"],
            "image": container.get("image") or "",
            "imageID": f"sim.local/{container.get('image') or 'image'}@sha256:{'0' * 64}",
            "containerID": run.container_ids.get(container["name"], ""),
            "ready": ready,
            "started": "running" in state,
            "restartCount": run.restarts,
            "state": state,
            "lastState": {"terminated": run.last_terminated} if run.last_terminated else {},
        }
        return status

    def _finish(self, pod: Mapping, run: _Run, now: float) -> None:
        code, reason = run.exit or (0, "Completed")
        self._release(run)
        run.end_logs()
        terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": run.started_at,
            "finishedAt": _now(),
        }
        spec = pod.get("spec") or {}
        containers = spec.get("containers") or []
        policy = spec.get("restartPolicy") or "Always"
        if policy == "Always" or (policy == "OnFailure" and code != 0):
            delay = min(self.c.timings.crash_backoff * 2**run.restarts, 300.0 / self.c.speed)
            statuses = []
            for c in containers:
                run.last_terminated = {**terminated, "containerID": run.container_ids.get(c["name"], "")}
                waiting = {
                    "waiting": {
                        "reason": "CrashLoopBackOff",
                        "message": f"back-off {int(delay)}s restarting failed container={c['name']} "
                        f"pod={_meta(pod)['name']}_{_meta(pod)['namespace']}({run.uid})",
                    }
                }
                statuses.append(self._container_status(c, run, waiting, ready=False))
            run.stage, run.due, run.exit = "backoff", now + delay, None
            self._write(pod, run, "Running", statuses, ready=False)
            self.c.count("container_restarts")
            return
        statuses = [
            self._container_status(
                c,
                run,
                {"terminated": {**terminated, "containerID": run.container_ids.get(c["name"], "")}},
                ready=False,
            )
            for c in containers
        ]
        phase = "Succeeded" if code == 0 else "Failed"
        run.stage, run.due = "done", math.inf
        self._write(pod, run, phase, statuses, ready=False)
        self.c.count("pods_succeeded" if code == 0 else "pods_failed")
        if reason == "OOMKilled":
            self.c.count("pods_oom_killed")

    def _write(self, pod: Mapping, run: _Run, phase: str, statuses: list[dict], *, ready: bool) -> None:
        md = _meta(pod)
        now = _now()
        terminal = phase in TERMINAL
        if terminal:
            not_ready_reason = "PodCompleted" if phase == "Succeeded" else "PodFailed"
        else:
            not_ready_reason = "ContainersNotReady"
        unready = [s["name"] for s in statuses if not s["ready"]]

        def cond(kind: str, ok: bool, reason: str | None = None, message: str | None = None) -> dict:
            c = {"type": kind, "status": "True" if ok else "False", "lastProbeTime": None, "lastTransitionTime": now}
            if not ok and reason:
                c["reason"] = reason
            if not ok and message:
                c["message"] = message
            return c

        message = None if terminal else f"containers with unready status: [{' '.join(unready)}]"
        conditions = [
            cond("PodReadyToStartContainers", not terminal),
            cond("Initialized", True),
            cond("Ready", ready, not_ready_reason, message),
            cond("ContainersReady", ready, not_ready_reason, message),
            cond("PodScheduled", True),
        ]
        node = self.c.nodes.get(run.node) or {}
        host_ip = next(
            (a["address"] for a in (node.get("status") or {}).get("addresses") or [] if a.get("type") == "InternalIP"),
            "",
        )
        status = {
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": statuses,
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}] if host_ip else None,
            "podIP": run.pod_ip,
            "podIPs": [{"ip": run.pod_ip}],
            "startTime": run.start_time,
            "qosClass": (pod.get("status") or {}).get("qosClass") or _qos_class(pod.get("spec") or {}),
        }
        self.c.core.patch_namespaced_pod_status(md["name"], md["namespace"], {"status": status}, _content_type=MERGE)


def _qos_class(spec: Mapping) -> str:
    containers = spec.get("containers") or []
    requests = [(c.get("resources") or {}) for c in containers]
    if not any(r.get("requests") or r.get("limits") for r in requests):
        return "BestEffort"
    for r in requests:
        limits = r.get("limits") or {}
        reqs = {**limits, **(r.get("requests") or {})}
        for res in ("cpu", "memory"):
            if res not in limits or str(limits[res]) != str(reqs.get(res)):
                return "Burstable"
    return "Guaranteed"


# ---------------------------------------------------------------- controllers


class _OwnerIndex:
    """Pods by the uid of their controller, kept from the pod cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_owner: dict[str, set[str]] = defaultdict(set)
        self._owner_of: dict[str, set[str]] = {}

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        key = _key(pod)
        owners = set() if kind == "DELETED" else {r.get("uid") for r in _meta(pod).get("ownerReferences") or []}
        with self._lock:
            for uid in self._owner_of.pop(key, set()) - owners:
                self._by_owner[uid].discard(key)
                if not self._by_owner[uid]:
                    del self._by_owner[uid]
            for uid in owners:
                self._by_owner[uid].add(key)
            if owners:
                self._owner_of[key] = owners

    def pods(self, owner_uid: str) -> list[str]:
        with self._lock:
            return list(self._by_owner.get(owner_uid, ()))


class _PodOwnerController:
    """What the Job and Deployment controllers share: a work queue of their objects, the pods
    they expect to see created or deleted, and a pod event that wakes the pod's owner."""

    OWNER_KIND = ""
    QUEUE = ""

    def __init__(self, cluster: _Cluster, owners: _OwnerIndex):
        self.c = cluster
        self.owners = owners
        self.queue = WorkQueue(self.QUEUE, cluster.stop)
        self.expect = _Expectations()

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        ref = _controller_ref(pod)
        if not ref or ref.get("kind") != self.OWNER_KIND:
            return
        owner = f"{_meta(pod)['namespace']}/{ref['name']}"
        if kind == "ADDED":
            self.expect.observed(owner, name=_meta(pod)["name"])
        elif kind == "DELETED":
            self.expect.observed(owner, uid=_meta(pod).get("uid"))
        self.queue.add(owner)


class JobController(_PodOwnerController):
    """Runs batch/v1 Jobs: pods from the template, retries within backoffLimit, status and conditions."""

    OWNER_KIND = "Job"
    QUEUE = "jobs"

    def __init__(self, cluster: _Cluster, owners: _OwnerIndex):
        super().__init__(cluster, owners)
        self._failures_seen: dict[str, tuple[int, float]] = {}
        self._finished: set[str] = set()  # Job uids whose terminal condition this process wrote

    def on_job(self, kind: str, job: dict, old: dict | None) -> None:
        if kind == "DELETED":
            self.expect.drop(_key(job))
            self._failures_seen.pop(_meta(job).get("uid"), None)
            self._finished.discard(_meta(job).get("uid"))
            return
        self.queue.add(_key(job))

    def reconcile(self, key: str) -> None:
        job = self.c.jobs.get(key)
        if job is None:
            return
        md, spec, status = _meta(job), job.get("spec") or {}, job.get("status") or {}
        uid, ns, name = md.get("uid"), md["namespace"], md["name"]
        pods = [
            p
            for k in self.owners.pods(uid)
            if (p := self.c.pods.get(k)) and (_controller_ref(p) or {}).get("uid") == uid
        ]
        active = [p for p in pods if _phase(p) not in TERMINAL and not _meta(p).get("deletionTimestamp")]
        indexed = spec.get("completionMode") == "Indexed"
        completed = _completed_indexes(status, pods) if indexed else set()
        succeeded = max(sum(_phase(p) == "Succeeded" for p in pods), status.get("succeeded") or 0)
        if indexed:
            succeeded = len(completed)  # each index once, however many of its Pods succeeded
        fail_job, ignored = _pod_failure_policy(spec, [p for p in pods if _phase(p) == "Failed"])
        failed = max(
            sum(_phase(p) == "Failed" and _meta(p).get("name") not in ignored for p in pods), status.get("failed") or 0
        )
        finished = any(
            c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        if finished or uid in self._finished or md.get("deletionTimestamp"):
            for p in active:
                self.c.submit(self.c.delete_pod, p)
            return
        pending = self.expect.pending_adds(key)
        parallelism = spec.get("parallelism", 1) if spec.get("parallelism") is not None else 1
        completions = spec.get("completions")
        backoff_limit = spec.get("backoffLimit", 6) if spec.get("backoffLimit") is not None else 6
        restarts = 0
        if ((spec.get("template") or {}).get("spec") or {}).get("restartPolicy") == "OnFailure":
            restarts = sum(
                int(s.get("restartCount") or 0)
                for p in active
                for s in (p.get("status") or {}).get("containerStatuses") or []
            )
        now = _now()
        start_time = status.get("startTime") or now
        new_conditions: list[dict] = []
        event = None

        def condition(kind: str, reason: str, message: str) -> dict:
            return {
                "type": kind,
                "status": "True",
                "reason": reason,
                "message": message,
                "lastProbeTime": now,
                "lastTransitionTime": now,
            }

        deadline = spec.get("activeDeadlineSeconds")
        started = _parse_time(start_time) or time.time()
        if fail_job:
            reason, message = "PodFailurePolicy", fail_job
        elif failed + restarts > backoff_limit:
            reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
        elif deadline is not None and time.time() - started >= deadline / self.c.speed:
            reason, message = "DeadlineExceeded", "Job was active longer than specified deadline"
        else:
            reason = message = None
        stopping: list[dict] = []  # deleted once the status says why, as the controller does since v1.31
        if reason:
            new_conditions = [condition("FailureTarget", reason, message), condition("Failed", reason, message)]
            stopping, active = active, []
            event = (reason, message, True)
        elif (completions is not None and succeeded >= completions) or (
            completions is None and succeeded > 0 and not active and not pending
        ):
            msg = "Reached expected number of succeeded pods"
            new_conditions = [
                condition("SuccessCriteriaMet", "CompletionsReached", msg),
                condition("Complete", "CompletionsReached", msg),
            ]
            stopping, active = active, []
            event = ("Completed", "Job completed", False)
        elif spec.get("suspend"):
            for p in active:
                self.c.submit(self.c.delete_pod, p)
            active = []
        else:
            want = (
                min(parallelism, completions - succeeded)
                if completions is not None
                else (parallelism if succeeded == 0 else 0)
            )
            missing = want - len(active) - len(pending)
            wait = self._backoff_wait(uid, failed + restarts)
            if missing > 0 and wait > 0:
                self.queue.add_after(key, wait)
            elif missing > 0 and indexed:
                # The lowest indexes that neither succeeded nor have a Pod (getPodsWithDelayedDeletionPerIndex).
                taken = completed | {_pod_index(p) for p in active} | {_name_index(n, name) for n in pending}
                free = [i for i in range(completions) if i not in taken][:missing]
                names = [_child_name(f"{name}-{i}") for i in free]
                self.expect.expect(key, adds=names)
                for i, pod_name in zip(free, names):
                    self.c.submit(self._create_pod, job, pod_name, key, i)
            elif missing > 0:
                names = [_child_name(name) for _ in range(missing)]
                self.expect.expect(key, adds=names)
                for pod_name in names:
                    self.c.submit(self._create_pod, job, pod_name, key)
            elif missing < 0:
                for p in sorted(active, key=lambda p: _phase(p) == "Running")[:-missing]:
                    self.c.submit(self.c.delete_pod, p)
            if deadline is not None:
                self.queue.add_after(key, max(started + deadline / self.c.speed - time.time(), 0) + 0.01)
        desired = {
            "active": (len(active) + len(pending)) or None,
            "succeeded": succeeded or None,
            "failed": failed or None,
            "ready": sum(_is_ready(p) for p in active),
            "startTime": start_time,
        }
        if indexed:
            desired["completedIndexes"] = _index_ranges(completed) or None
        conditions = list(status.get("conditions") or [])
        if new_conditions:
            conditions += new_conditions
            desired["conditions"] = conditions
            if new_conditions[-1]["type"] == "Complete":
                desired["completionTime"] = now
        if _differs(status, desired):
            self.c.patch_status("Job", name, ns, {"status": desired})
        for p in stopping:
            self.c.submit(self.c.delete_pod, p)
        if new_conditions:
            self._finished.add(uid)
        if event:
            self.c.event("Job", "batch/v1", job, event[0], event[1], warning=event[2], component="job-controller")

    def _backoff_wait(self, uid: str, failures: int) -> float:
        """Seconds until a replacement may be created after the latest failure (doubling, capped)."""
        if failures <= 0:
            return 0.0
        seen, since = self._failures_seen.get(uid, (0, 0.0))
        now = time.monotonic()
        if failures > seen:
            self._failures_seen[uid] = (failures, now)
            since = now
        delay = min(self.c.timings.job_backoff * 2 ** (failures - 1), 360.0 / self.c.speed)
        return since + delay - now

    def _create_pod(self, job: Mapping, pod_name: str, owner_key: str, index: int | None = None) -> None:
        md = _meta(job)
        labels = {
            JOB_CONTROLLER_UID: md["uid"],
            JOB_NAME: md["name"],
            "controller-uid": md["uid"],
            "job-name": md["name"],
        }
        if index is not None:
            labels[COMPLETION_INDEX] = str(index)
        ref = {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "name": md["name"],
            "uid": md["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        body = _pod_from_template((job.get("spec") or {}).get("template") or {}, pod_name, md["namespace"], labels, ref)
        if index is not None:
            _index_pod(body, md["name"], index)
        try:
            self.c.core.create_namespaced_pod(md["namespace"], body)
        except Exception:
            self.expect.forget_add(owner_key, pod_name)
            self.queue.add_after(owner_key, 0.2)
            raise
        self.c.count("job_pods_created")
        self.c.event("Job", "batch/v1", job, "SuccessfulCreate", f"Created pod: {pod_name}", component="job-controller")


def _pod_failure_policy(spec: Mapping, failed_pods: Iterable[Mapping]) -> tuple[str | None, set[str]]:
    """A Job's ``podFailurePolicy`` over its failed pods (pkg/controller/job/pod_failure_policy.go):
    the message of the first ``FailJob`` rule a pod matches (None if none does), and the pods an
    ``Ignore`` rule keeps from counting as failures. Rules are tried in order, the first match
    decides; ``Count`` and ``FailIndex`` count the failure as usual."""
    rules = (spec.get("podFailurePolicy") or {}).get("rules") or []
    ignored: set[str] = set()
    for pod in failed_pods:
        for i, rule in enumerate(rules):
            matched = _rule_match(rule, pod)
            if matched is None:
                continue
            action = rule.get("action")
            if action == "FailJob":
                return f"{matched} matching FailJob rule at index {i}", ignored
            if action == "Ignore":
                ignored.add(_meta(pod).get("name", ""))
            break
    return None, ignored


def _rule_match(rule: Mapping, pod: Mapping) -> str | None:
    """How a failed pod matches a Pod failure policy rule, in the controller's words, or None."""
    md = _meta(pod)
    where = f"{md.get('namespace')}/{md.get('name')}"
    for pattern in rule.get("onPodConditions") or ():
        c = _condition(pod, pattern.get("type", ""))
        if c is not None and c.get("status") == (pattern.get("status") or "True"):
            return f"Pod {where} has condition {pattern.get('type')}"
    codes = rule.get("onExitCodes")
    if codes:
        values = set(codes.get("values") or ())
        for status in (pod.get("status") or {}).get("containerStatuses") or ():
            if codes.get("containerName") and status.get("name") != codes["containerName"]:
                continue
            code = ((status.get("state") or {}).get("terminated") or {}).get("exitCode")
            if code is None or code == 0:
                continue
            if (code in values) == (codes.get("operator") == "In"):
                return f"Container {status.get('name')} for pod {where} failed with exit code {code}"
    return None


def _pod_index(pod: Mapping) -> int | None:
    value = (_meta(pod).get("annotations") or {}).get(COMPLETION_INDEX)
    return int(value) if isinstance(value, str) and value.isdigit() else None


def _name_index(pod_name: str, job_name: str) -> int | None:
    """The index in a Pod name ``<job>-<index>-<suffix>`` this controller chose (a pending create)."""
    middle = pod_name[len(job_name[:57]) + 1 :].rsplit("-", 1)[0]
    return int(middle) if middle.isdigit() else None


def _completed_indexes(status: Mapping, pods: Iterable[Mapping]) -> set[int]:
    """Indexes recorded in ``status.completedIndexes`` (``1,3-5``) and those of Pods that succeeded."""
    done: set[int] = set()
    for part in str(status.get("completedIndexes") or "").split(","):
        first, _, last = part.partition("-")
        if first.strip().isdigit():
            done.update(range(int(first), int(last or first) + 1))
    done.update(i for p in pods if _phase(p) == "Succeeded" and (i := _pod_index(p)) is not None)
    return done


def _index_ranges(indexes: Iterable[int]) -> str:
    """``{0, 1, 2, 5}`` as the Job status writes it: ``0-2,5``."""
    out: list[str] = []
    for i in sorted(indexes):
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


def _index_pod(pod: dict, job_name: str, index: int) -> None:
    """What the Job controller adds to an Indexed Job's Pod (pkg/controller/job/indexed_job_utils.go):
    the completion index as an annotation (and label), ``JOB_COMPLETION_INDEX`` in every container
    from that annotation, and the host name ``<job>-<index>`` unless the template named one."""
    md = pod["metadata"]
    md["annotations"] = {**(md.get("annotations") or {}), COMPLETION_INDEX: str(index)}
    spec = pod["spec"]
    if not spec.get("hostname"):
        spec["hostname"] = f"{job_name}-{index}"
    ref = {"fieldRef": {"fieldPath": f"metadata.annotations['{COMPLETION_INDEX}']"}}
    for container in [*(spec.get("initContainers") or ()), *(spec.get("containers") or ())]:
        env = container.setdefault("env", [])
        if not any(v.get("name") == "JOB_COMPLETION_INDEX" for v in env):
            env.append({"name": "JOB_COMPLETION_INDEX", "valueFrom": ref})


def _differs(current: Mapping, desired: Mapping) -> bool:
    """Whether writing ``desired`` would change ``current``; 0, null and empty count as the same."""

    def norm(v):
        return None if v in (0, None, {}, []) and v is not False else v

    return any(norm(current.get(k)) != norm(v) for k, v in desired.items())


def _pod_from_template(template: Mapping, name: str, namespace: str, labels: Mapping, owner: Mapping) -> dict:
    md = template.get("metadata") or {}
    metadata = {
        "name": name,
        "namespace": namespace,
        "labels": {**(md.get("labels") or {}), **labels},
        "ownerReferences": [dict(owner)],
    }
    if md.get("annotations"):
        metadata["annotations"] = dict(md["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": copy.deepcopy(template.get("spec") or {})}


def pod_template_hash(template: Mapping) -> str:
    """A stable, label-safe hash of a pod template (the role of ComputeHash + SafeEncodeString)."""
    digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).digest()
    return "".join(_NAME_CHARS[b % len(_NAME_CHARS)] for b in digest[:10])


class DeploymentController(_PodOwnerController):
    """Keeps spec.replicas pods of a Deployment's current template and reports its status."""

    OWNER_KIND = "Deployment"
    QUEUE = "deployments"

    def on_deployment(self, kind: str, deployment: dict, old: dict | None) -> None:
        if kind == "DELETED":
            self.expect.drop(_key(deployment))
            return
        self.queue.add(_key(deployment))

    def reconcile(self, key: str) -> None:
        deployment = self.c.deployments.get(key)
        if deployment is None:
            return
        md, spec, status = _meta(deployment), deployment.get("spec") or {}, deployment.get("status") or {}
        uid, ns, name = md.get("uid"), md["namespace"], md["name"]
        template = spec.get("template") or {}
        hash_ = pod_template_hash(template)
        replicas = spec.get("replicas", 1) if spec.get("replicas") is not None else 1
        pods = [
            p
            for k in self.owners.pods(uid)
            if (p := self.c.pods.get(k)) and (_controller_ref(p) or {}).get("uid") == uid
        ]
        deleting = self.expect.pending_dels(key)
        live = [p for p in pods if not _meta(p).get("deletionTimestamp") and _meta(p).get("uid") not in deleting]
        current = [
            p
            for p in live
            if (_meta(p).get("labels") or {}).get(POD_TEMPLATE_HASH) == hash_ and _phase(p) not in TERMINAL
        ]
        stale = [p for p in live if p not in current]
        pending = self.expect.pending_adds(key)
        if not md.get("deletionTimestamp") and not spec.get("paused"):
            doomed = list(stale)
            missing = replicas - len(current) - len(pending)
            if missing > 0:
                names = [_child_name(f"{name}-{hash_}") for _ in range(missing)]
                self.expect.expect(key, adds=names)
                for pod_name in names:
                    self.c.submit(self._create_pod, deployment, hash_, pod_name, key)
            elif missing < 0:
                doomed += sorted(current, key=_scale_down_rank)[:-missing]
            if doomed:
                self.expect.expect(key, dels=[_meta(p).get("uid") for p in doomed])
                for p in doomed:
                    self.c.submit(self.c.delete_pod, p)
                doomed_uids = {_meta(p).get("uid") for p in doomed}
                current = [p for p in current if _meta(p).get("uid") not in doomed_uids]
                stale = []
        ready = sum(_is_ready(p) for p in current)
        total = len(current) + len(stale)
        max_unavailable = _scaled_int(
            ((spec.get("strategy") or {}).get("rollingUpdate") or {}).get("maxUnavailable", "25%"), replicas
        )
        rs_name = f"{name}-{hash_}"
        available_ok = ready >= replicas - max_unavailable
        progressed = ready >= replicas and not stale
        now = _now()
        old_conditions = {c.get("type"): c for c in status.get("conditions") or []}

        def condition(kind: str, ok: bool, reason: str, message: str) -> dict:
            before = old_conditions.get(kind) or {}
            same = before.get("status") == ("True" if ok else "False") and before.get("reason") == reason
            return {
                "type": kind,
                "status": "True" if ok else "False",
                "reason": reason,
                "message": message,
                "lastUpdateTime": before.get("lastUpdateTime") if same else now,
                "lastTransitionTime": before.get("lastTransitionTime") if same else now,
            }

        desired = {
            "observedGeneration": md.get("generation"),
            "replicas": total or None,
            "updatedReplicas": len(current) or None,
            "readyReplicas": ready or None,
            "availableReplicas": ready or None,
            "unavailableReplicas": max(replicas - ready, 0) or None,
            "conditions": [
                condition(
                    "Available",
                    available_ok,
                    "MinimumReplicasAvailable" if available_ok else "MinimumReplicasUnavailable",
                    "Deployment has minimum availability."
                    if available_ok
                    else "Deployment does not have minimum availability.",
                ),
                condition(
                    "Progressing",
                    True,
                    "NewReplicaSetAvailable" if progressed else "ReplicaSetUpdated",
                    f'ReplicaSet "{rs_name}" has successfully progressed.'
                    if progressed
                    else f'ReplicaSet "{rs_name}" is progressing.',
                ),
            ],
        }
        if _differs(status, desired):
            self.c.patch_status("Deployment", name, ns, {"status": desired})

    def _create_pod(self, deployment: Mapping, hash_: str, pod_name: str, owner_key: str) -> None:
        md = _meta(deployment)
        ref = {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": md["name"],
            "uid": md["uid"],
            "controller": True,
            "blockOwnerDeletion": True,
        }
        template = (deployment.get("spec") or {}).get("template") or {}
        body = _pod_from_template(template, pod_name, md["namespace"], {POD_TEMPLATE_HASH: hash_}, ref)
        try:
            self.c.core.create_namespaced_pod(md["namespace"], body)
        except Exception:
            self.expect.forget_add(owner_key, pod_name)
            self.queue.add_after(owner_key, 0.2)
            raise
        self.c.count("deployment_pods_created")


def _scale_down_rank(pod: Mapping) -> tuple:
    """ReplicaSet's order for deletion: unassigned, then pending, then not ready, then the newest."""
    created = _parse_time(_meta(pod).get("creationTimestamp")) or 0.0
    return (
        bool((pod.get("spec") or {}).get("nodeName")),
        _phase(pod) == "Running",
        _is_ready(pod),
        -created,
    )


def _scaled_int(value, total: int) -> int:
    if isinstance(value, str) and value.endswith("%"):
        return math.floor(total * int(value[:-1]) / 100)
    return int(value)


class GarbageCollector:
    """Deletes dependents whose owners are gone and serves foreground and orphan deletion."""

    KINDS = {("batch/v1", "Job"), ("apps/v1", "Deployment")}

    def __init__(self, cluster: _Cluster, owners: _OwnerIndex):
        self.c = cluster
        self.owners = owners
        self.queue = WorkQueue("gc", cluster.stop)
        self._deleted_nodes: set[str] = set()

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        if kind == "DELETED":
            for ref in _meta(pod).get("ownerReferences") or []:
                owner_key = f"{ref.get('kind')}:{_meta(pod)['namespace']}/{ref.get('name')}"
                self.queue.add(owner_key)
            return
        if _meta(pod).get("ownerReferences") or (pod.get("spec") or {}).get("nodeName") in self._deleted_nodes:
            self.queue.add(f"Pod:{_key(pod)}")

    def on_owner(self, kind_name: str) -> Callable[[str, dict, dict | None], None]:
        def handler(kind: str, obj: dict, old: dict | None) -> None:
            md = _meta(obj)
            if kind == "DELETED" or md.get("deletionTimestamp"):
                self.queue.add(f"{kind_name}:{_key(obj)}")
                for pod_key in self.owners.pods(md.get("uid")):
                    self.queue.add(f"Pod:{pod_key}")

        return handler

    def on_node(self, kind: str, node: dict, old: dict | None) -> None:
        name = _meta(node)["name"]
        if kind == "DELETED" and (_meta(node).get("labels") or {}).get(SIMULATED_LABEL) == "true":
            self._deleted_nodes.add(name)
            for pod in self.c.pods.items():
                if (pod.get("spec") or {}).get("nodeName") == name:
                    self.queue.add(f"Pod:{_key(pod)}")
        elif kind == "ADDED":
            self._deleted_nodes.discard(name)

    def _owner(self, ref: Mapping, namespace: str) -> dict | None:
        """The live owner, or None if gone; a cache miss is confirmed by a GET, as the real GC does."""
        job = ref.get("kind") == "Job"
        name = ref.get("name")
        obj = (self.c.jobs if job else self.c.deployments).get(f"{namespace}/{name}")
        if obj is None:
            read = self.c.batch.read_namespaced_job if job else self.c.apps.read_namespaced_deployment
            try:
                obj = json.loads(read(name, namespace))
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise
        return obj if _meta(obj).get("uid") == ref.get("uid") else None

    def reconcile(self, key: str) -> None:
        if not (self.c.jobs.synced.is_set() and self.c.deployments.synced.is_set()):
            self.queue.add_after(key, 0.2)
            return
        kind, _, obj_key = key.partition(":")
        if kind == "Pod":
            self._pod(obj_key)
        else:
            self._owner_finalizers(kind, obj_key)

    def _pod(self, key: str) -> None:
        pod = self.c.pods.get(key)
        if pod is None or _meta(pod).get("deletionTimestamp"):
            return
        md = _meta(pod)
        node = (pod.get("spec") or {}).get("nodeName")
        if node in self._deleted_nodes and self.c.nodes.get(node) is None:
            self._mark_disrupted(pod)
            self.c.delete_pod(pod, grace=0)
            self.c.count("gc_deleted")
            return
        refs = self._tracked_refs(pod)
        if not refs:
            return
        owners = [self._cached_owner(r, md["namespace"]) for r in refs]
        if all(o is None for o in owners):
            self._delete_orphan(md["namespace"], md["name"])
            return
        for ref, owner in zip(refs, owners):
            if owner is None or not _meta(owner).get("deletionTimestamp"):
                continue
            finalizers = _meta(owner).get("finalizers") or []
            if "foregroundDeletion" in finalizers:
                self.c.delete_pod(pod)
                self.c.count("gc_deleted")
                return
            if "orphan" in finalizers:
                kept = [r for r in md.get("ownerReferences") or [] if r.get("uid") != ref.get("uid")]
                self.c.core.patch_namespaced_pod(
                    md["name"],
                    md["namespace"],
                    {"metadata": {"ownerReferences": kept or None}},
                    _content_type=MERGE,
                )

    def _mark_disrupted(self, pod: Mapping) -> None:
        """PodGC's markFailedAndDeletePodWithCondition: a Pod whose node is gone ends Failed with a
        ``DisruptionTarget`` condition (reason ``DeletionByPodGC``) before it is deleted, so its Job
        counts it failed, and a Pod failure policy or a reader can tell the node went."""
        if _phase(pod) in TERMINAL:
            return
        md = _meta(pod)
        disrupted = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "DeletionByPodGC",
            "message": "PodGC: node no longer exists",
            "lastTransitionTime": _now(),
        }
        kept = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") != "DisruptionTarget"]
        body = {"status": {"phase": "Failed", "conditions": [*kept, disrupted]}}
        try:
            self.c.core.patch_namespaced_pod_status(md["name"], md["namespace"], body, _content_type=MERGE)
        except ApiException as exc:
            if not _gone(exc):
                raise

    def _delete_orphan(self, namespace: str, name: str) -> None:
        """Deletes a pod whose owners the cache says are gone, deciding again on live reads.

        The cache may be older than an owner's deletion (an Orphan deletion strips the references
        once the owner is gone), so the pod is read again, its owners are looked up live, and only
        the version read is deleted.
        """
        try:
            pod = json.loads(self.c.core.read_namespaced_pod(name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        refs = self._tracked_refs(pod)
        if refs and all(self._owner(r, namespace) is None for r in refs):
            self.c.delete_pod(pod, unchanged=True)
            self.c.count("gc_deleted")

    def _tracked_refs(self, pod: Mapping) -> list[dict]:
        """The pod's owner references, or none if any owner is of a kind this simulator does not track."""
        refs = _meta(pod).get("ownerReferences") or []
        if any((r.get("apiVersion"), r.get("kind")) not in self.KINDS for r in refs):
            return []  # such an owner is assumed alive
        return refs

    def _cached_owner(self, ref: Mapping, namespace: str) -> dict | None:
        obj = (self.c.jobs if ref.get("kind") == "Job" else self.c.deployments).get(f"{namespace}/{ref.get('name')}")
        return obj if obj is not None and _meta(obj).get("uid") == ref.get("uid") else None

    def _owner_finalizers(self, kind: str, key: str) -> None:
        cache = self.c.jobs if kind == "Job" else self.c.deployments if kind == "Deployment" else None
        obj = cache.get(key) if cache is not None else None
        if obj is None or not _meta(obj).get("deletionTimestamp"):
            return
        md = _meta(obj)
        finalizers = md.get("finalizers") or []
        ours = [f for f in finalizers if f in ("foregroundDeletion", "orphan")]
        if not ours:
            return
        dependents = [k for k in self.owners.pods(md.get("uid")) if self.c.pods.get(k) is not None]
        if dependents:
            for pod_key in dependents:
                self.queue.add(f"Pod:{pod_key}")
            self.queue.add_after(f"{kind}:{key}", 0.2)
            return
        patch = {"metadata": {"finalizers": [f for f in finalizers if f not in ours] or None}}
        ns, name = _split(key)
        fn = self.c.batch.patch_namespaced_job if kind == "Job" else self.c.apps.patch_namespaced_deployment
        fn(name, ns, patch, _content_type=MERGE)


# ---------------------------------------------------------------- device plugin


class DevicePlugin:
    """Advertises each simulated node's GPUs as its device-plugin config says, and labels it as GFD would."""

    def __init__(self, cluster: _Cluster, namespace: str, config_name: str | None, default_key: str | None):
        self.c = cluster
        self.namespace = namespace
        self._fallback = (config_name, default_key)
        self.queue = WorkQueue("device-plugin", cluster.stop)
        self._devices: dict[str, NodeDevices] = {}
        self._node_pools: dict[str, GpuPool] = {}  # nodes the MIG manager changed: their own pool
        self._lock = threading.Lock()

    def pool_for(self, node: str, pool: GpuPool) -> GpuPool:
        """``pool`` as ``node`` has it: with the MIG layouts the MIG manager gave the node, if any."""
        with self._lock:
            return self._node_pools.get(node, pool)

    def set_node_pool(self, node: str, pool: GpuPool) -> None:
        """What the MIG manager applied to ``node``; the next reconcile advertises it."""
        with self._lock:
            self._node_pools[node] = pool

    def devices(self, node: str) -> NodeDevices | None:
        with self._lock:
            found = self._devices.get(node)
        if found is None:
            obj = self.c.nodes.get(node)
            pool = self.c.pools.get(((_meta(obj).get("labels") or {}) if obj else {}).get(POOL_LABEL, ""))
            if pool is not None:
                pool = self.pool_for(node, pool)
                found = node_devices(pool, self.sharing_for(_meta(obj).get("labels") or {}, pool, node))
        return found

    def config_ref(self) -> tuple[str | None, str | None]:
        """(ConfigMap name, default key) from the ClusterPolicy, else what the simulator was given."""
        for policy in self.c.policies.items():
            config = ((policy.get("spec") or {}).get("devicePlugin") or {}).get("config") or {}
            if config.get("name"):
                return config["name"], config.get("default")
        return self._fallback

    def sharing_for(self, labels: Mapping[str, str], pool: GpuPool, node: str = "") -> SharingConfig:
        name, default = self.config_ref()
        if not name:
            return pool.default_sharing()
        configmap = self.c.configmaps.get(f"{self.namespace}/{name}")
        if configmap is None:
            return pool.default_sharing()
        key = labels.get(DEVICE_PLUGIN_CONFIG_LABEL) or default
        text = (configmap.get("data") or {}).get(key) if key else None
        if text is None:
            return pool.default_sharing()
        try:
            return SharingConfig.parse(text)
        except ValueError as exc:
            log.warning("ConfigMap %s/%s key %s: %s; keeping the node's config", self.namespace, name, key, exc)
            with self._lock:
                current = self._devices.get(node)
            return current.sharing if current else pool.default_sharing()

    def on_node(self, kind: str, node: dict, old: dict | None) -> None:
        labels = _meta(node).get("labels") or {}
        name = _meta(node)["name"]
        if kind == "DELETED":
            with self._lock:
                self._devices.pop(name, None)
                self._node_pools.pop(name, None)
            return
        if labels.get(POOL_LABEL) in self.c.pools:
            self.queue.add(name)

    def on_config(self, kind: str, obj: dict, old: dict | None) -> None:
        for node in list(self.c.managed):
            self.queue.add(node)

    def reconcile(self, name: str) -> None:
        if not (self.c.configmaps.synced.is_set() and self.c.policies.synced.is_set()):
            self.queue.add_after(name, 0.1)
            return
        node = self.c.nodes.get(name)
        if node is None:
            return
        md = _meta(node)
        labels = md.get("labels") or {}
        pool = self.c.pools.get(labels.get(POOL_LABEL, ""))
        if pool is None:
            return
        pool = self.pool_for(name, pool)
        desired = node_devices(pool, self.sharing_for(labels, pool, name))
        with self._lock:
            self._devices[name] = desired
        # The MIG config label is the admin's (or gpush's) and its state the MIG manager's: once a
        # node carries them, the device plugin leaves them alone.
        label_patch = {
            k: v
            for k, v in desired.labels.items()
            if labels.get(k) != v and not (k in _MIG_MANAGER_LABELS and k in labels)
        }
        for k in labels:
            if _gfd_label(k) and k not in desired.labels and k not in pool.labels:
                label_patch[k] = None
        status = node.get("status") or {}
        resource_patch: dict[str, dict] = {}
        for section in ("capacity", "allocatable"):
            have = status.get(section) or {}
            diff = {r: str(v) for r, v in desired.resources.items() if str(have.get(r)) != str(v)}
            diff.update({r: None for r in have if r.startswith("nvidia.com/") and r not in desired.resources})
            if diff:
                resource_patch[section] = diff
        if label_patch:
            self.c.core.patch_node(name, {"metadata": {"labels": label_patch}}, _content_type=MERGE)
        if resource_patch:
            self.c.core.patch_node_status(name, {"status": resource_patch}, _content_type=MERGE)
        if label_patch or resource_patch:
            self.c.count("device_plugin_updates")


_MIG_MANAGER_LABELS = (MIG_CONFIG_LABEL, MIG_CONFIG_STATE_LABEL)


def _gfd_label(key: str) -> bool:
    return key.startswith("nvidia.com/") and key != DEVICE_PLUGIN_CONFIG_LABEL and key not in _MIG_MANAGER_LABELS


# ---------------------------------------------------------------- MIG manager


class MigManager:
    """The GPU Operator's MIG manager on each simulated node: applies the mig-parted config that
    the node's ``nvidia.com/mig.config`` label names, and reports in ``nvidia.com/mig.config.state``.

    When the label changes to a name it has not applied, the state becomes ``pending``; after
    ``Timings.mig_reconfigure`` the named config is read from the MIG manager's ConfigMap (in the
    operator namespace, named by the ClusterPolicy's ``spec.migManager.config.name``, else the one
    the simulator was given) and applied: the node's GPUs get the config's layouts (GPUs it does
    not select keep theirs), the device plugin advertises them (``nvidia.com/mig-<profile>``
    allocatable, capacity and GFD labels, through the same ``node_devices`` as every node), then
    the state becomes ``success``. ``failed`` when the config is not there or is malformed, when a
    GPU would get a profile its product does not offer or a layout it cannot hold, or when the
    node's running Pods hold more of a MIG resource than the new layout leaves (the real MIG
    manager will not re-partition GPUs with clients on them). A failed node keeps its devices.

    Approximated: a change of the label alone starts the manager (as the real one, which does not
    follow ConfigMap edits); it applies at once rather than through a reboot; Pods left running on
    a node whose MIG devices changed keep their device claims by index, which after the change may
    name another device of the same node (memory accounting only)."""

    def __init__(self, cluster: _Cluster, plugin: DevicePlugin, namespace: str, config_name: str):
        self.c = cluster
        self.plugin = plugin
        self.namespace = namespace
        self._fallback = config_name
        self.queue = WorkQueue("mig-manager", cluster.stop)
        self._applied: dict[str, str | None] = {}  # node -> the label value last applied (or failed)
        self._due: dict[str, tuple[str, float]] = {}  # node -> (label value, when to apply it)
        self._lock = threading.Lock()

    def config_name(self) -> str:
        """The MIG manager's ConfigMap: from the ClusterPolicy, else what the simulator was given."""
        for policy in self.c.policies.items():
            name = (((policy.get("spec") or {}).get("migManager") or {}).get("config") or {}).get("name")
            if name:
                return str(name)
        return self._fallback

    def on_node(self, kind: str, node: dict, old: dict | None) -> None:
        md = _meta(node)
        name = md["name"]
        if kind == "DELETED":
            with self._lock:
                self._applied.pop(name, None)
                self._due.pop(name, None)
            return
        labels = md.get("labels") or {}
        pool = self.c.pools.get(labels.get(POOL_LABEL, ""))
        if pool is None or not pool.mig_capable:
            return
        label = labels.get(MIG_CONFIG_LABEL)
        with self._lock:
            if name not in self._applied and label == pool.mig_config_label():
                self._applied[name] = label  # registered with the pool's own layout: nothing to do
            if self._applied.get(name, object()) == label:
                return
        self.queue.add(name)

    def reconcile(self, name: str) -> None:
        if not (self.c.configmaps.synced.is_set() and self.c.policies.synced.is_set()):
            self.queue.add_after(name, 0.1)
            return
        node = self.c.nodes.get(name)
        if node is None:
            return
        labels = _meta(node).get("labels") or {}
        pool = self.c.pools.get(labels.get(POOL_LABEL, ""))
        label = labels.get(MIG_CONFIG_LABEL)
        if pool is None or label is None:
            return
        now = time.monotonic()
        with self._lock:
            if self._applied.get(name, object()) == label:
                return
            due = self._due.get(name)
            if due is None or due[0] != label:
                self._due[name] = due = (label, now + self.c.timings.mig_reconfigure)
                starting = True
            else:
                starting = False
        if starting:
            self._set_state(name, "pending")
        if now < due[1]:
            self.queue.add_after(name, due[1] - now)
            return
        state = self._apply(name, pool, label)
        with self._lock:
            if self._due.get(name) == due:
                self._due.pop(name, None)
                self._applied[name] = label
        self._set_state(name, state)

    def _apply(self, name: str, pool: GpuPool, label: str) -> str:
        """Applies config ``label`` to node ``name``; the state to report."""
        config = self.config_name()
        configmap = self.c.configmaps.get(f"{self.namespace}/{config}")
        text = ((configmap or {}).get("data") or {}).get(MIG_PARTED_KEY)
        current = self.plugin.pool_for(name, pool)
        try:
            if configmap is None:
                raise ValueError(f"ConfigMap {self.namespace}/{config} does not exist")
            changes = mig_parted_layouts(text, label, current.gpus_per_node)
            new_pool = reconfigured(current, current.layouts(), changes, label)
            wanted = node_devices(
                new_pool,
                self.plugin.sharing_for(_meta(self.c.nodes.get(name) or {}).get("labels") or {}, new_pool, name),
            )
        except ValueError as exc:
            log.warning("MIG manager on %s: config %s: %s", name, label, exc)
            return "failed"
        held: dict[str, int] = defaultdict(int)
        for pod in self.c.pods.items():
            if (pod.get("spec") or {}).get("nodeName") == name and _phase(pod) not in TERMINAL:
                for resource, n in pod_requests(pod.get("spec") or {}).items():
                    if resource.startswith("nvidia.com/mig-"):
                        held[resource] += n
        short = [r for r, n in held.items() if wanted.resources.get(r, 0) < n]
        if short:
            log.warning("MIG manager on %s: GPU clients hold %s, which config %s takes away", name, short, label)
            return "failed"
        self.plugin.set_node_pool(name, new_pool)
        self.plugin.reconcile(name)
        self.c.count("mig_reconfigurations")
        return "success"

    def _set_state(self, name: str, state: str) -> None:
        node = self.c.nodes.get(name)
        if node is not None and (_meta(node).get("labels") or {}).get(MIG_CONFIG_STATE_LABEL) == state:
            return
        self.c.core.patch_node(name, {"metadata": {"labels": {MIG_CONFIG_STATE_LABEL: state}}}, _content_type=MERGE)


# ---------------------------------------------------------------- the simulator


class Simulator:
    """A simulated GPU cluster driven through any Kubernetes API server.

    ``Simulator(api_client, spec, speed=1.0).start()`` watches pods, nodes, Jobs, Deployments, the
    operator namespace's ConfigMaps and ClusterPolicies; ``create_nodes()`` registers the pools'
    nodes; ``stop()`` ends every thread (also as a context manager). ``spec`` is a list of
    ``GpuPool`` or plain mappings of its fields. The simulator talks through its own copy of
    ``api_client``'s configuration, with a connection pool sized for its threads.

    Options: ``speed`` divides every delay and duration; ``timings`` overrides the delays.
    Against a real cluster, KWOK's arrangement: ``schedule=False`` leaves binding to its
    kube-scheduler and ``controllers=False`` leaves Jobs, Deployments and garbage collection to its
    kube-controller-manager; ``scheduler_name`` picks the pods this scheduler takes.
    ``operator_namespace`` is where the device plugin's ConfigMap lives, and
    ``device_plugin_config``/``device_plugin_default`` name the ConfigMap and default key when no
    ClusterPolicy does. ``record_events=False`` skips Normal events (Warnings are always written);
    ``workers`` sizes the write pool. ``kubelet_address`` is where the simulator serves its
    kubelets' container logs (integration/k8s/kubelet_server.py) on a free port, published as every
    node's ``InternalIP`` and kubelet port so that ``pods/log`` reaches it; None serves none.
    """

    def __init__(
        self,
        api_client: client.ApiClient,
        spec: Iterable[GpuPool | Mapping],
        *,
        speed: float = 1.0,
        timings: Timings | None = None,
        schedule: bool = True,
        controllers: bool = True,
        scheduler_name: str = SCHEDULER,
        operator_namespace: str = "gpu-operator",
        device_plugin_config: str | None = None,
        device_plugin_default: str | None = None,
        mig_parted_config: str = DEFAULT_MIG_PARTED_CONFIG,
        record_events: bool = True,
        workers: int = 8,
        kubelet_address: str | None = "127.0.0.1",
    ):
        if speed <= 0:
            raise ValueError("speed must be > 0 (2.0 runs the simulated cluster twice as fast)")
        self.api_client = api_client
        self.pools = pools_from(spec)
        self.speed = speed
        self.c = c = _Cluster(
            api_client,
            timings=(timings or Timings()).scaled(speed),
            speed=speed,
            record_events=record_events,
            workers=workers,
        )
        c.pools = {p.name: p for p in self.pools}
        stop = c.stop
        c.pods = Informer("pods", c.read_core.list_pod_for_all_namespaces, stop)
        c.nodes = Informer("nodes", c.read_core.list_node, stop)
        c.jobs = Informer("jobs", c.read_batch.list_job_for_all_namespaces, stop)
        c.deployments = Informer("deployments", c.read_apps.list_deployment_for_all_namespaces, stop)
        c.configmaps = Informer(
            "configmaps", lambda **kw: c.read_core.list_namespaced_config_map(operator_namespace, **kw), stop
        )
        c.policies = Informer(
            "clusterpolicies", lambda **kw: c.read_custom.list_cluster_custom_object(*CLUSTER_POLICY, **kw), stop
        )
        self.informers = [c.configmaps, c.policies, c.nodes, c.jobs, c.deployments, c.pods]

        self.owners = _OwnerIndex()
        self.plugin = DevicePlugin(c, operator_namespace, device_plugin_config, device_plugin_default)
        self.mig_manager = MigManager(c, self.plugin, operator_namespace, mig_parted_config)
        self.scheduler = Scheduler(c, name=scheduler_name) if schedule else None
        self.kubelet = Kubelet(c, self.plugin)
        self.jobs = JobController(c, self.owners)
        self.deployments = DeploymentController(c, self.owners)
        self.gc = GarbageCollector(c, self.owners)

        c.nodes.handlers += [self._track_node, self.plugin.on_node, self.mig_manager.on_node]
        c.pods.handlers += [self.owners.on_pod, self.kubelet.on_pod]
        c.configmaps.handlers.append(self.plugin.on_config)
        c.policies.handlers.append(self.plugin.on_config)
        self._worker_counts = {
            self.kubelet.queue: (self.kubelet.reconcile, max(workers // 2, 2)),
            self.plugin.queue: (self.plugin.reconcile, 2),
            self.mig_manager.queue: (self.mig_manager.reconcile, 1),
        }
        if self.scheduler:
            c.nodes.handlers.append(self.scheduler.on_node)
            c.pods.handlers.insert(0, self.scheduler.on_pod)
        if controllers:
            c.nodes.handlers.append(self.gc.on_node)
            c.pods.handlers += [self.jobs.on_pod, self.deployments.on_pod, self.gc.on_pod]
            c.jobs.handlers += [self.jobs.on_job, self.gc.on_owner("Job")]
            c.deployments.handlers += [self.deployments.on_deployment, self.gc.on_owner("Deployment")]
            self._worker_counts[self.jobs.queue] = (self.jobs.reconcile, 2)
            self._worker_counts[self.deployments.queue] = (self.deployments.reconcile, 2)
            self._worker_counts[self.gc.queue] = (self.gc.reconcile, 1)
        self._workers: list[threading.Thread] = []
        self._started = False
        self.kubelet_server: KubeletServer | None = None
        if kubelet_address is not None:  # bound now: node manifests name its port before start()
            self.kubelet_server = KubeletServer(self.kubelet.container_log, c.stop, host=kubelet_address)

    # lifecycle

    def start(self, *, timeout: float = 30.0) -> Simulator:
        """Starts every watch and worker and waits until the caches are filled."""
        if self._started:
            return self
        self._started = True
        for informer in self.informers:
            informer.start()
        for queue, (fn, n) in self._worker_counts.items():
            for i in range(n):
                t = threading.Thread(target=_run_worker, args=(queue, fn), name=f"sim-{queue.name}-{i}", daemon=True)
                t.start()
                self._workers.append(t)
        if self.scheduler:
            self.scheduler.start()
        if self.kubelet_server is not None:
            self.kubelet_server.start()
        self.wait_synced(timeout)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stops watches and workers; writes already sent finish, queued ones are dropped."""
        c = self.c
        c.stop.set()
        for informer in self.informers:
            informer.stop()
        for queue in self._worker_counts:
            queue.wake()
        if self.scheduler:
            self.scheduler.wake()
        c.writes.shutdown(wait=False, cancel_futures=True)
        if self.kubelet_server is not None:
            self.kubelet_server.close()
        deadline = time.monotonic() + timeout
        for t in self._workers:
            t.join(max(deadline - time.monotonic(), 0.01))
        for informer in self.informers:
            informer.join(max(deadline - time.monotonic(), 0.01))
        if self.scheduler:
            self.scheduler.join(max(deadline - time.monotonic(), 0.01))
        c.writes.shutdown(wait=True)
        c.api_client.close()

    def __enter__(self) -> Simulator:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait_synced(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        for informer in self.informers:
            if not informer.synced.wait(max(deadline - time.monotonic(), 0)):
                raise TimeoutError(f"the {informer.name} cache did not fill within {timeout}s; is the API server up?")

    # nodes

    def _track_node(self, kind: str, node: dict, old: dict | None) -> None:
        md = _meta(node)
        if kind == "DELETED":
            self.c.managed.discard(md["name"])
        elif (md.get("labels") or {}).get(POOL_LABEL) in self.c.pools and md["name"] not in self.c.managed:
            self.c.managed.add(md["name"])
            self.kubelet.node_added(md["name"])

    def node_manifests(self) -> list[dict]:
        """The Node objects ``create_nodes`` registers, with the device-plugin config in force now."""
        manifests = []
        for pool in self.pools:
            for i in range(pool.count):
                labels = {DEVICE_PLUGIN_CONFIG_LABEL: pool.device_plugin_config} if pool.device_plugin_config else {}
                labels["kubernetes.io/hostname"] = pool.node_names()[i]
                own = self.plugin.pool_for(pool.node_names()[i], pool)
                sharing = self.plugin.sharing_for(labels, own) if self._started else own.default_sharing()
                manifests.append(node_manifest(pool, i, node_devices(own, sharing), kubelet=self.kubelet_endpoint))
        return manifests

    def create_nodes(self, *, workers: int = 16, wait: float | None = 30.0) -> list[str]:
        """Registers every pool's nodes (in parallel); an existing node is brought to the spec.

        With ``wait`` (seconds), returns once the simulator's own caches hold every node, so pods
        bound to them right after are run. Returns the node names.
        """
        manifests = self.node_manifests()

        def register(body: dict) -> str:
            name = body["metadata"]["name"]
            try:
                resp = self.c.core.create_node(body)
                created = json.loads(resp)
                if (created.get("status") or {}).get("allocatable") != body["status"]["allocatable"]:
                    self._push_status(name, body)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.c.core.patch_node(
                    name,
                    {"metadata": {"labels": body["metadata"]["labels"]}, "spec": body["spec"]},
                    _content_type=MERGE,
                )
                self._push_status(name, body)
            return name

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-nodes") as pool:
            names = list(pool.map(register, manifests))
        self.c.count("nodes_created", len(names))
        if wait and self._started:
            deadline = time.monotonic() + wait
            while not set(names) <= self.c.managed:
                if time.monotonic() > deadline:
                    missing = sorted(set(names) - self.c.managed)
                    raise TimeoutError(f"{len(missing)} nodes (first {missing[0]}) did not reach the watch in {wait}s")
                time.sleep(0.02)
        return names

    @property
    def kubelet_endpoint(self) -> tuple[str, int] | None:
        """(address, port) of the kubelet server the nodes name, or None when there is none."""
        server = self.kubelet_server
        return (server.host, server.port) if server is not None else None

    @property
    def nodes(self) -> list[str]:
        """The simulated nodes of this simulator's pools that its node cache holds."""
        return sorted(self.c.managed)

    def _push_status(self, name: str, body: dict) -> None:
        self.c.core.patch_node_status(name, {"status": body["status"]}, _content_type=MERGE)

    def delete_nodes(self, *, workers: int = 16) -> None:
        """Deletes the simulated nodes of this simulator's pools (their pods are then deleted by the GC)."""
        names = [n for p in self.pools for n in p.node_names()]

        def remove(name: str) -> None:
            with contextlib.suppress(ApiException):
                self.c.core.delete_node(name)

        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sim-nodes") as pool:
            list(pool.map(remove, names))

    # what tests and benchmarks look at

    @property
    def server_gaps(self) -> set[str]:
        """API features the server lacked and the simulator worked around."""
        return set(self.c.gaps)

    @property
    def counters(self) -> dict[str, int]:
        return dict(self.c.counters)

    def node_devices(self, node: str) -> NodeDevices | None:
        """The devices, resources and labels the device plugin publishes for ``node``."""
        return self.plugin.devices(node)

    def gpu_claims(self, namespace: str, name: str) -> list[tuple[str, int]]:
        """(resource, physical GPU index) for each device unit the running pod holds."""
        return self.kubelet.claims(f"{namespace}/{name}")

    def free(self, node: str) -> dict[str, int]:
        """Free resources on ``node`` as the scheduler sees them (cpu in millicores, memory in bytes)."""
        return self.scheduler.free(node) if self.scheduler else {}

    def idle(self) -> bool:
        """No queued work anywhere (timers may still be set for later transitions)."""
        queues = [
            self.kubelet.queue,
            self.jobs.queue,
            self.deployments.queue,
            self.gc.queue,
            self.plugin.queue,
            self.mig_manager.queue,
        ]
        return not any(q.busy() for q in queues) and not (self.scheduler and self.scheduler.pending())


__all__ = [
    "ANN_DURATION",
    "ANN_EXIT_CODE",
    "ANN_GPU_MEMORY_GB",
    "ANN_OOM",
    "ENV_GPU_MEMORY_FRACTION",
    "ENV_GPU_MEMORY_GB",
    "GpuPool",
    "Informer",
    "MigManager",
    "SharingConfig",
    "Simulator",
    "Timings",
    "WorkQueue",
    "matches_node",
    "pod_requests",
    "pod_template_hash",
]
