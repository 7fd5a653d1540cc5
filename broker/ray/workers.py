"""A Ray cluster's worker nodes as gpush jobs: what the gpush node provider does, without Ray.

``broker.ray.provider.GpushNodeProvider`` is the thin shim Ray's autoscaler loads; the
work happens here, so it runs and is tested without Ray installed. What callers may
assume:

- **One worker, one job.** A Ray worker node is one gpush job whose command is
  ``ray start --address=<head> --block`` with the CPUs, GPUs and custom resources its
  node type declares. The node type's ``node_config.gpush`` holds the job's fields
  (``kind``, ``isolation``, ``gpu_memory_gb``, ...), so the routing policy, quotas and
  fair share decide where and when it runs, as for any other job.
- **Stateless.** Every worker carries labels (``ray.gpush.io/cluster``, ``node-type``,
  ``launch-config``, ``launch-request``, ``node-ip``); the list of nodes is read back
  from gpush by those labels, so an autoscaler that restarts finds its workers again.
- **Waiting is pending, not failed.** A job gpush has not started yet (queued, held,
  routed, submitting, submitted) is a pending node whose status is gpush's own reason
  ("queued in gpush: tenant ray at quota (0.143/0.143 GPU)"); Ray's autoscaler never
  declares a pending node dead, so it is neither killed nor launched twice. A running
  job whose ``ray start`` has joined the head is an ``up-to-date`` node; running, not
  joined yet, it is still pending ("running in gpush: ray start has not joined the Ray
  cluster yet"), read by an injected ``raylets()``. Ray's autoscaler expects a heartbeat
  from an up-to-date node within 30 s (``AUTOSCALER_HEARTBEAT_TIMEOUT_S``) and replaces
  one that sends none ("lost contact with raylet"): a worker whose ``ray start`` is
  slower than that (a cold machine) would be cancelled and launched again. When which
  raylets joined is unknown (the GCS did not answer), a running job is up-to-date. A
  finished job, or one whose cancel was requested, is a terminated node.
- **Terminate is cancel.** A queued worker is cancelled at once; a running one when
  its cluster confirms (Slurm's scancel stops ``ray start --block``, and with it the
  raylet).
- **A queued worker nobody wants is cancelled.** Ray's v1 autoscaler never terminates
  a node that has not joined (it is never "idle"), so a worker gpush has not started
  would wait forever once the work that asked for it is gone. ``reap()`` (each
  autoscaler update) cancels it once the Ray cluster has had no pending demand its node
  type could serve (task and actor shapes, placement group bundles, ``request_resources``
  bundles, read by an injected ``demand()``) for ``queued_idle_timeout_minutes``
  (default: the cluster's ``idle_timeout_minutes``), never below the node type's
  ``min_workers``, and stops listing it: to Ray, a pending node that went away. When the
  demand is unknown (the GCS did not answer), every queued worker is kept. The time
  demand was last seen is the one thing kept in memory (neither gpush nor Ray records
  it): a restarted provider starts that clock again, so it may cancel later, never
  sooner; the cancel itself is in gpush, so it happens once.
- **Launch is idempotent by request id.** Worker ``i`` of launch request ``r`` is
  submitted with idempotency key ``ray-<cluster>-<r>-<i>``: a retried launch returns
  the jobs of the first.
- **One address per worker.** Ray's autoscaler (v1) tells its nodes apart by IP, and
  several workers may share a host (seven MIG slices of one GPU node). ``worker_ip:
  loopback`` gives each worker its own 127.0.x.y (every worker on the head's machine,
  as in the test cluster); ``worker_ip: node-id`` gives each an integer resource
  ``NODE_ID_AS_RESOURCE`` that the autoscaler uses instead of the IP
  (``use_node_id_as_ip: true``; the head is started with ``NODE_ID_AS_RESOURCE: 1``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from broker.client.sdk import GpushClient
from broker.core.clock import Clock, utcnow
from broker.core.errors import GpushError, NotFound
from broker.core.schemas import JobOut, JobSpec
from broker.core.states import TERMINAL, JobState

# Ray's tag names and values (ray.autoscaler.tags), spelled out so this module needs no Ray.
TAG_NODE_KIND = "ray-node-type"
TAG_NODE_NAME = "ray-node-name"
TAG_NODE_STATUS = "ray-node-status"
TAG_USER_NODE_TYPE = "ray-user-node-type"
TAG_LAUNCH_CONFIG = "ray-launch-config"
TAG_LAUNCH_REQUEST = "ray-launch-request"
KIND_HEAD = "head"
KIND_WORKER = "worker"
STATUS_UP_TO_DATE = "up-to-date"

LABEL_CLUSTER = "ray.gpush.io/cluster"
LABEL_NODE_TYPE = "ray.gpush.io/node-type"
LABEL_LAUNCH_CONFIG = "ray.gpush.io/launch-config"
LABEL_LAUNCH_REQUEST = "ray.gpush.io/launch-request"
LABEL_NODE_IP = "ray.gpush.io/node-ip"

ENV_NODE_TYPE = "GPUSH_RAY_NODE_TYPE"
ENV_RESOURCES = "GPUSH_RAY_RESOURCES"

HEAD_NODE_ID = "head"
RAY_DEFAULT_IDLE_TIMEOUT_MINUTES = 5.0
LIVE_STATES = [s.value for s in JobState if s not in TERMINAL]
WORKER_IP_MODES = ("loopback", "node-id")
# Resources ray start takes as flags; the rest go to --resources.
_FLAG_RESOURCES = {"CPU": "--num-cpus", "GPU": "--num-gpus", "memory": "--memory"}
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]")

log = logging.getLogger("gpush.ray")

Shape = Mapping[str, float]
# What the Ray cluster waits for, as resource shapes; None when it cannot be read.
DemandReader = Callable[[], "list[Shape] | None"]
# The addresses of the raylets alive in the Ray cluster, as the autoscaler keys its nodes
# (the IP; with use_node_id_as_ip, NODE_ID_AS_RESOURCE); None when they cannot be read.
RayletReader = Callable[[], "set[str] | None"]
NOT_JOINED = "running in gpush: ray start has not joined the Ray cluster yet"


class ProviderConfigError(ValueError):
    """The cluster YAML's provider section or a node type's node_config is wrong."""


def _label_value(text: str) -> str:
    """``text`` as a valid label value (63 characters of A-Z a-z 0-9 - _ ., alphanumeric ends)."""
    value = _LABEL_VALUE_BAD.sub("-", text)[:63].strip("-_.")
    return value or "x"


@dataclass
class ProviderSettings:
    """The provider section of the cluster YAML, checked."""

    gpush_url: str
    head_address: str
    token_env: str = "GPUSH_TOKEN"
    tenant: str | None = None
    ray_command: str = "ray"
    worker_ip: str = "loopback"
    worker_temp_dir: str = "/tmp/ray-gpush"
    extra_ray_start_args: list[str] = field(default_factory=list)
    # None: the cluster's idle_timeout_minutes.
    queued_idle_timeout_minutes: float | None = None

    @classmethod
    def from_provider_config(cls, config: Mapping[str, Any]) -> ProviderSettings:
        missing = [k for k in ("gpush_url", "head_address") if not config.get(k)]
        if missing:
            raise ProviderConfigError(
                f"the gpush node provider needs {' and '.join(missing)} in the cluster YAML's provider section "
                "(gpush_url: the broker's URL; head_address: the Ray head's GCS address, host:port)"
            )
        worker_ip = config.get("worker_ip", "loopback")
        if worker_ip not in WORKER_IP_MODES:
            raise ProviderConfigError(f"provider.worker_ip {worker_ip!r}: use one of {', '.join(WORKER_IP_MODES)}")
        if worker_ip == "node-id" and not config.get("use_node_id_as_ip"):
            raise ProviderConfigError("provider.worker_ip node-id needs use_node_id_as_ip: true beside it")
        queued_idle = config.get("queued_idle_timeout_minutes")
        if queued_idle is not None:
            try:
                queued_idle = float(queued_idle)
            except (TypeError, ValueError):
                queued_idle = -1.0
            if queued_idle < 0:
                raise ProviderConfigError(
                    f"provider.queued_idle_timeout_minutes {config['queued_idle_timeout_minutes']!r}: "
                    "give a number of minutes, 0 or more"
                )
        return cls(
            gpush_url=config["gpush_url"],
            head_address=config["head_address"],
            token_env=config.get("token_env", "GPUSH_TOKEN"),
            tenant=config.get("tenant"),
            ray_command=config.get("ray_command", "ray"),
            worker_ip=worker_ip,
            worker_temp_dir=config.get("worker_temp_dir", "/tmp/ray-gpush"),
            extra_ray_start_args=[str(a) for a in config.get("extra_ray_start_args", [])],
            queued_idle_timeout_minutes=queued_idle,
        )

    def client(self) -> GpushClient:
        token = os.environ.get(self.token_env)
        if not token:
            raise ProviderConfigError(
                f"the gpush node provider reads its token from ${self.token_env}, which is not set in the "
                "environment of `ray start --head` (create one with: gpush admin token create --user ray "
                "--tenant <tenant>)"
            )
        return GpushClient(self.gpush_url, token)


@dataclass(frozen=True)
class WorkerNode:
    """One worker as Ray's autoscaler sees it, read off its gpush job."""

    node_id: str
    job: JobOut
    tags: dict[str, str]
    internal_ip: str

    @property
    def running(self) -> bool:
        return self.job.state == JobState.RUNNING

    @property
    def node_type(self) -> str:
        return self.tags.get(TAG_USER_NODE_TYPE, "")

    @property
    def resources(self) -> dict[str, float] | None:
        """The node type's resources as launched; None for a worker launched without them."""
        try:
            return json.loads(self.job.spec.get("env", {})[ENV_RESOURCES])
        except (KeyError, TypeError, ValueError):
            return None


def serves(resources: Mapping[str, float] | None, shape: Shape) -> bool:
    """Whether a node with ``resources`` could hold ``shape`` (unknown resources: any shape)."""
    if resources is None:
        return True
    return all(float(amount) <= float(resources.get(name, 0)) + 1e-9 for name, amount in shape.items())


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo else at.replace(tzinfo=UTC)


def worker_status(job: JobOut, joined: bool = True) -> str:
    """The node's ``ray-node-status``: ``up-to-date`` once running and joined, else why not."""
    if job.state == JobState.RUNNING:
        return STATUS_UP_TO_DATE if joined else NOT_JOINED
    why = f": {job.state_reason}" if job.state_reason else ""
    return f"{job.state.value} in gpush{why}"


class GpushWorkers:
    """The worker nodes of one Ray cluster, kept as gpush jobs (see the module docstring)."""

    def __init__(
        self,
        settings: ProviderSettings,
        cluster_name: str,
        client: GpushClient | None = None,
        *,
        demand: DemandReader | None = None,
        raylets: RayletReader | None = None,
        idle_timeout_minutes: float = RAY_DEFAULT_IDLE_TIMEOUT_MINUTES,
        min_workers: Mapping[str, int] | None = None,
        now: Clock = utcnow,
    ):
        self.settings = settings
        self.cluster_name = cluster_name
        self.cluster_label = _label_value(cluster_name)
        self._client = client
        self._lock = threading.RLock()
        self._nodes: dict[str, WorkerNode] = {}
        # Tags the autoscaler set that gpush does not keep; the status always comes from gpush.
        self._extra_tags: dict[str, dict[str, str]] = {}
        # Cancelling queued workers that no demand wants (reap).
        self._demand = demand
        self._now = now
        # Up-to-date only once joined (module docstring); None: unknown, every running job is.
        self._raylets = raylets
        self._joined: set[str] | None = None
        minutes = settings.queued_idle_timeout_minutes
        self.queued_idle_timeout_s = 60 * float(idle_timeout_minutes if minutes is None else minutes)
        self.min_workers = dict(min_workers or {})
        self._started = now()
        # Per node type: when the Ray cluster last had demand it could serve. In memory
        # only (see the module docstring); until seen, the time this provider started.
        self._demand_seen: dict[str, datetime] = {}

    @property
    def client(self) -> GpushClient:
        with self._lock:
            if self._client is None:
                self._client = self.settings.client()
            return self._client

    # -- reading --------------------------------------------------------------------

    def head_ip(self) -> str:
        if self.settings.worker_ip == "node-id":
            return "1"
        return self.settings.head_address.rsplit(":", 1)[0]

    def refresh(self) -> dict[str, WorkerNode]:
        """Every live worker of this cluster, from gpush (one list call, by label)."""
        jobs = self.client.iter_jobs(labels={LABEL_CLUSTER: self.cluster_label}, states=LIVE_STATES, limit=1000)
        if self._raylets is not None:
            # Read after the jobs: a worker that joined meanwhile is up-to-date already.
            self._joined = self._raylets()
        nodes = {}
        for job in jobs:
            if job.cancel_requested_at is not None:
                continue  # the autoscaler terminated it: terminated at once, as Ray expects
            node = self._node_of(job)
            nodes[node.node_id] = node
        with self._lock:
            self._nodes = nodes
        return nodes

    def reap(self) -> dict[str, WorkerNode]:
        """``refresh()``, less the queued workers no demand has wanted for the grace
        period, which are cancelled in gpush (see the module docstring)."""
        nodes = self.refresh()
        waiting = [n for n in nodes.values() if not n.running]
        if self._demand is None or not waiting:
            return nodes
        shapes = self._demand()
        now = self._now()
        if shapes is not None:
            shapes = [s for s in shapes if any(float(v) > 0 for v in s.values())]
        for node in waiting:
            if shapes is None or any(serves(node.resources, s) for s in shapes):
                self._demand_seen[node.node_type] = now
        live = Counter(n.node_type for n in nodes.values())
        # Newest first: the workers queued longest are the nearest to starting.
        for node in sorted(waiting, key=lambda n: n.job.created_at, reverse=True):
            kind = node.node_type
            quiet_since = max(self._demand_seen.get(kind, self._started), _aware(node.job.created_at))
            quiet = (now - quiet_since).total_seconds()
            if quiet < self.queued_idle_timeout_s or live[kind] <= self.min_workers.get(kind, 0):
                continue
            try:
                self.client.cancel(int(node.node_id))
            except NotFound:
                pass
            except GpushError as exc:
                log.warning("gpush: could not cancel queued worker %s: %s", node.node_id, exc)
                continue
            live[kind] -= 1
            nodes.pop(node.node_id)
            with self._lock:
                self._nodes.pop(node.node_id, None)
                self._extra_tags.pop(node.node_id, None)
            log.info(
                "gpush: cancelled queued worker %s (%s, %s): the Ray cluster has had no pending demand a %s "
                "could serve for %.0f s (queued_idle_timeout_minutes: %g), and Ray's autoscaler never "
                "terminates a worker that has not joined",
                node.node_id,
                kind,
                node.tags[TAG_NODE_STATUS],
                kind,
                quiet,
                self.queued_idle_timeout_s / 60,
            )
        return nodes

    def _node_of(self, job: JobOut) -> WorkerNode:
        labels = job.spec.get("labels", {})
        node_id = str(job.id)
        address = labels.get(LABEL_NODE_IP, "")
        joined = self._joined is None or address in self._joined
        tags = {
            **self._extra_tags.get(node_id, {}),
            TAG_NODE_KIND: KIND_WORKER,
            TAG_NODE_NAME: f"gpush-{job.id}",
            TAG_USER_NODE_TYPE: job.spec.get("env", {}).get(ENV_NODE_TYPE) or labels.get(LABEL_NODE_TYPE, ""),
            TAG_LAUNCH_CONFIG: labels.get(LABEL_LAUNCH_CONFIG, ""),
            TAG_LAUNCH_REQUEST: labels.get(LABEL_LAUNCH_REQUEST, ""),
            TAG_NODE_STATUS: worker_status(job, joined),
        }
        return WorkerNode(node_id, job, tags, address)

    def node(self, node_id: str) -> WorkerNode | None:
        """A worker from the last refresh, or read from gpush if it is newer than that."""
        with self._lock:
            node = self._nodes.get(node_id)
        if node is not None or node_id == HEAD_NODE_ID:
            return node
        try:
            job = self.client.get(int(node_id))
        except (NotFound, ValueError):
            return None
        if JobState(job.state) in TERMINAL or job.cancel_requested_at is not None:
            return None
        node = self._node_of(job)
        with self._lock:
            self._nodes[node_id] = node
        return node

    def set_tags(self, node_id: str, tags: Mapping[str, str]) -> None:
        with self._lock:
            self._extra_tags.setdefault(node_id, {}).update({k: v for k, v in tags.items() if k != TAG_NODE_STATUS})

    # -- launching ------------------------------------------------------------------

    def launch(
        self,
        node_type: str,
        node_config: Mapping[str, Any],
        resources: Mapping[str, float],
        count: int,
        *,
        launch_config: str = "",
        request_id: str | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> list[WorkerNode]:
        """Submit ``count`` workers of ``node_type``; idempotent by ``request_id``."""
        request = _label_value(request_id or uuid.uuid4().hex)
        fields = dict(node_config.get("gpush") or {})
        if not fields:
            raise ProviderConfigError(
                f"node type {node_type!r} has no node_config.gpush: give the gpush job fields its workers "
                "ask for, such as {kind: inference, isolation: hardware, gpu_memory_gb: 5}"
            )
        for reserved in ("command", "idempotency_key"):
            if reserved in fields:
                raise ProviderConfigError(
                    f"node type {node_type!r}: node_config.gpush.{reserved} is set by the provider; remove it"
                )
        launched = []
        with self._lock:  # one address per worker: allocate under the lock, from gpush's view
            live = self.refresh().values()
            taken = {n.internal_ip for n in live}
            by_key = {n.job.spec.get("idempotency_key"): n for n in live}
            for index in range(count):
                key = f"ray-{self.cluster_label}-{request}-{index}"[:128]
                if key in by_key:  # a retried request: the worker exists, with its address
                    launched.append(by_key[key])
                    continue
                address = self._free_address(taken)
                taken.add(address)
                spec = self._spec(node_type, fields, resources, address, launch_config, request, labels or {})
                try:
                    job = self.client.submit(spec, idempotency_key=key)
                except GpushError as exc:
                    raise ProviderConfigError(f"gpush refused a {node_type} worker: {exc}") from exc
                node = self._node_of(job)
                self._nodes[node.node_id] = node
                launched.append(node)
        return launched

    def _free_address(self, taken: set[str]) -> str:
        if self.settings.worker_ip == "node-id":
            n = 2  # 1 is the head
            while str(n) in taken:
                n += 1
            return str(n)
        for n in range(256, 256 * 255):
            address = f"127.0.{n // 256}.{n % 256}"
            if n % 256 not in (0, 255) and address not in taken:
                return address
        raise ProviderConfigError("no loopback address left for another worker (over 65,000 live workers)")

    def _spec(
        self,
        node_type: str,
        fields: dict[str, Any],
        resources: Mapping[str, float],
        address: str,
        launch_config: str,
        request: str,
        ray_labels: Mapping[str, str],
    ) -> JobSpec:
        argv = [self.settings.ray_command, "start", f"--address={self.settings.head_address}", "--block"]
        custom = {}
        for name, amount in resources.items():
            if name in _FLAG_RESOURCES:
                argv.append(f"{_FLAG_RESOURCES[name]}={_number(amount)}")
            elif name != "object_store_memory":
                custom[name] = amount
        if self.settings.worker_ip == "node-id":
            custom["NODE_ID_AS_RESOURCE"] = int(address)
        else:
            argv.append(f"--node-ip-address={address}")
        if custom:
            argv.append(f"--resources={json.dumps(custom, sort_keys=True)}")
        if ray_labels:
            argv.append("--labels=" + ",".join(f"{k}={v}" for k, v in sorted(ray_labels.items())))
        # Several workers may share a host: ports that are free, not Ray's fixed defaults, and
        # a temp dir each (Ray numbers its sockets in a shared one, and two raylets starting at
        # once take the same number). Short: Ray's unix socket paths are limited to 107 bytes.
        temp_dir = f"{self.settings.worker_temp_dir}/{self.cluster_label[:16]}-{address}"
        argv += [
            f"--temp-dir={temp_dir}",
            "--dashboard-agent-listen-port=0",
            "--disable-usage-stats",
            *self.settings.extra_ray_start_args,
        ]
        labels = {
            **fields.get("labels", {}),
            LABEL_CLUSTER: self.cluster_label,
            LABEL_NODE_TYPE: _label_value(node_type),
            LABEL_LAUNCH_CONFIG: _label_value(launch_config) if launch_config else "",
            LABEL_LAUNCH_REQUEST: request,
            LABEL_NODE_IP: address,
        }
        env = {
            **fields.get("env", {}),
            ENV_NODE_TYPE: node_type,
            ENV_RESOURCES: json.dumps(dict(resources), sort_keys=True),
        }
        body = {
            "name": _label_value(f"ray-{self.cluster_label}-{node_type}")[:64],
            **fields,
            "command": argv,
            "env": env,
            "labels": labels,
        }
        if self.settings.tenant and "tenant" not in fields:
            body["tenant"] = self.settings.tenant
        try:
            return JobSpec.model_validate(body)
        except ValueError as exc:
            raise ProviderConfigError(f"node type {node_type!r}: node_config.gpush is not a valid job: {exc}") from exc

    # -- terminating ----------------------------------------------------------------

    def terminate(self, node_ids: Iterable[str]) -> None:
        """Cancel the workers' jobs: at once while queued, through their cluster once running."""
        for node_id in node_ids:
            if node_id == HEAD_NODE_ID:
                continue
            try:
                self.client.cancel(int(node_id))
            except NotFound:
                pass  # gone already: terminated is what was asked
            with self._lock:
                self._nodes.pop(node_id, None)
                self._extra_tags.pop(node_id, None)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
