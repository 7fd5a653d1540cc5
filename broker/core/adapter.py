"""The adapter protocol: the one boundary between the broker and a cluster.

Every cluster kind (the simulated fleet, Slurm, Kubernetes) implements
:class:`ClusterAdapter`. The broker imports adapters only through
:func:`adapter_class`, which maps a cluster's ``kind`` to its class.

What callers may assume of every adapter:

- **Idempotent by gpush job id.** ``submit(job, placement)`` twice for the same job
  id creates one backend job and returns the same backend id. Every backend job
  carries the gpush job id (a label, a name, a comment), so ``find(job_id)`` answers
  after a broker crash, and the broker never submits a job twice.
- **Asynchronous and eventually consistent.** ``submit`` returns once the cluster has
  accepted the job, not when it runs. ``statuses`` and ``inventory`` are the
  cluster's view at the time of the call and may lag the broker's own decisions.
- **Typed failures.** :class:`Rejected` means the cluster refused this job for a
  reason retrying will not fix (the job fails); :class:`Unreachable` means the call
  may be retried later (the job goes back to the queue, or the cycle skips the
  cluster). Anything else is a bug.
- **No user work in the broker.** Adapters talk to a cluster; they never run jobs.
- **Whose job it is.** ``submit`` gets the job's :class:`Owner`: the user and tenant of
  the token that submitted it, never anything the job spec says. An adapter that runs
  jobs under their users' own identities (Slurm's ``run_as=owner``, a namespace per
  tenant on Kubernetes) takes it from there, and refuses (:class:`Rejected`, saying
  why) a job whose owner it cannot map rather than running it as someone else.
  ``owner`` is None only where no user is involved (the simulator's own replays,
  adapter tests): the cluster's configured service identity then applies.

Optional capabilities. Beyond the protocol an adapter may offer a few more things,
each a small Protocol here, and it says which in its ``capabilities`` class attribute
(``capabilities: ClassVar[frozenset[type]] = frozenset({BatchSubmitter, Closable})``;
none declared means none offered):

- :class:`BatchSubmitter`: ``submit_many(items)``, items being ``(job_id, spec,
  placement, owner)``, returning per item the backend id or the :class:`AdapterError` it met,
  with ``submit``'s guarantees for each. The scheduler uses it (:func:`submit_batch`),
  so a cluster that serves submissions in parallel (Slurm) gets a cycle's jobs at once
  rather than one after another.
- :class:`Scaler`: ``scale(job_id, replicas)`` changes a running elastic job's
  replicas (broker.scheduling.scaling).
- :class:`TimesliceConfigurator`: ``timeslice(replicas, node_label)`` renders the
  cluster's GPU time-slicing configuration and ``apply_timeslice(plan)`` applies it.
- :class:`Closable`: ``close()`` stops the adapter's threads and connections when the
  broker drops it (a configuration change, shutdown).
- :class:`LogReader`: ``logs(job_id, backend_id, ...)`` reads a job's output (``gpush
  logs``), or says where it is when the broker cannot read it (:class:`JobOutput`).
- :class:`ChangeNotifier`: ``notify_changes(callback)``: the cluster pushes events (the
  Kubernetes watch), and the adapter calls ``callback()`` when one of the broker's jobs
  changes, so the scheduler reads statuses at once rather than at its next cycle.
- :class:`NodeFencer`: ``fence(node, reason)``/``unfence(node)``/``fenced()``: stop new
  work landing on a node and let it land again (a MIG layout change drains its GPU first).
- :class:`MigPublisher`: ``publish_mig(node, gpu, instances)``/``mig_published(node, gpu)``:
  the cluster offers a GPU's new MIG layout (broker.fleet.mig_changes).
- :class:`NodeConfigurer`: ``configure_node(node, setup)``/``node_configured(node, setup)``:
  a node lent to the cluster is set up as the lending pool says (broker.fleet.lending).
- :class:`TenantQuotaKeeper`: ``tenant_quotas(quotas)`` renders the cluster's own limits for
  the tenants' GPU quotas (Kubernetes: a ResourceQuota in each tenant's namespace) and
  ``apply_tenant_quotas(plan)`` applies what changed. The broker's ledger enforces the
  quotas; these are the cluster's backstop for work that does not pass the broker. The
  scheduler hands the quotas over every cycle (broker.scheduling.cycle, step 4);
  ``gpush tenant quota-yaml CLUSTER`` shows them.

Callers ask with :func:`capability` (the adapter typed as that Protocol, or None) or
:func:`supports`, never with ``hasattr``: ``isinstance`` against a ``runtime_checkable``
Protocol only looks for attribute names, so a wrapper forwarding ``__getattr__`` would claim
every capability. A declaration is a promise in one visible line; tests check each declared
adapter has the methods (:func:`undeclared_or_missing`), and a wrapper such as the metrics'
(broker.core.metrics) passes on exactly what the adapter it wraps declares.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

from broker.core.schemas import JobSpec
from broker.core.topology import GpuTopology, Position


class Sharing(StrEnum):
    """How a job shares a GPU on a cluster: the ``sharing`` of a routing rule."""

    SLURM_EXCLUSIVE = "slurm/exclusive"  # whole GPUs as typed GRES
    SLURM_MIG = "slurm/mig"  # a MIG instance as typed GRES (gpu:1g.5gb)
    SLURM_MPS = "slurm/mps"  # a share of an MPS GPU (gres/mps)
    K8S_TIMESLICE = "k8s/timeslice"  # a time-slicing replica of nvidia.com/gpu
    K8S_MIG = "k8s/mig"  # nvidia.com/mig-<profile> under the mixed strategy
    K8S_EXCLUSIVE = "k8s/exclusive"  # whole nvidia.com/gpu on a node without time-slicing

    @property
    def flavor(self) -> str:
        """The cluster kind that offers this mode: ``slurm`` or ``k8s``."""
        return self.value.split("/", 1)[0]

    @property
    def isolation(self) -> str:
        """The isolation class this mode gives (broker.core.schemas.Isolation values)."""
        return {
            "exclusive": "exclusive",
            "mig": "hardware",
            "mps": "process",
            "timeslice": "none",
        }[self.value.split("/", 1)[1]]


@dataclass(frozen=True)
class Owner:
    """Who a job belongs to: the user and tenant of the token that submitted it."""

    user: str
    tenant: str


@dataclass(frozen=True)
class Placement:
    """Where the broker decided a job runs. ``units`` is per replica: whole GPUs,
    MIG instances, time-slice replicas, or MPS shares (percent of one GPU).

    ``gpus``: device indexes on ``node`` the broker chose, when it chose them. For MPS
    shares and time-slice replicas there is one index per replica (a replica's units
    all live on one physical GPU; two replicas may name the same GPU); a cluster that
    honours them runs each replica on its GPU, or keeps the job waiting until that GPU
    has room. Whole GPUs: those the broker chose by topology, where the cluster said which
    are free (a cluster picks them itself: Slurm by gres.conf Links=, the device plugin by
    NVLink). Empty: the cluster picks (MIG instances, replicas over several nodes).
    Placements stored before this field existed load with it empty.

    ``nodes``: a multi-node job's (a gang's) nodes, rank 0 first (``node``), ``units`` on
    each (``gpu_equivalents`` is the gang's); empty for one node. A cluster starts a gang
    on all of them at once or not at all.
    """

    cluster: str
    sharing: Sharing
    units: int
    gpu_equivalents: float  # physical GPU-equivalents the whole job holds
    node: str | None = None  # the node the broker fitted it on; jobs are pinned there (elastic: preferred)
    mig_profile: str | None = None
    gpu_model: str | None = None
    gpu_memory_gb: float | None = None  # the job's memory limit per unit (time-slicing, MPS)
    replicas: int = 1
    partition: str | None = None
    gpus: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()

    @property
    def gang(self) -> bool:  # whether this places a job on several nodes at once
        return len(self.nodes) > 1

    def to_dict(self) -> dict[str, Any]:
        out = {k: (v.value if isinstance(v, StrEnum) else v) for k, v in self.__dict__.items()}
        out["gpus"] = list(self.gpus)  # JSON has no tuples; from_dict turns it back
        if nodes := out.pop("nodes"):  # one-node placements read as they did before gangs
            out["nodes"] = list(nodes)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Placement:
        # A stored placement is JSON: ``gpus`` comes back as a list (a tuple keeps the
        # placement hashable) or, from before the field existed, not at all.
        tuples = {name: tuple(data.get(name) or ()) for name in ("gpus", "nodes")}
        return cls(**{**data, "sharing": Sharing(data["sharing"]), **tuples})


class BackendState(StrEnum):
    PENDING = "pending"  # accepted, waiting in the cluster
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # The cluster no longer has the job and did not end it (a controller that crashed
    # before saving it, whether or not it had started): the broker puts it back in the queue.
    LOST = "lost"


@dataclass(frozen=True)
class BackendJob:
    """A cluster's view of one gpush job."""

    job_id: int
    backend_id: str
    state: BackendState
    reason: str | None = None  # in the user's terms: "waiting for a 1g.5gb slice: all 7 busy"
    node: str | None = None
    exit_code: int | None = None
    at: datetime | None = None


@dataclass(frozen=True)
class StatusPage:
    """Status changes since a cursor; pass ``cursor`` back to get only newer ones."""

    jobs: list[BackendJob]
    cursor: str | None


@dataclass(frozen=True)
class CapacityUnit:
    """One kind of schedulable GPU unit on one node, as a cluster reports it.

    For whole GPUs and MIG instances a unit is one device; for time-slicing it is one
    replica (``gpu_equivalent`` = 1/replicas); for MPS it is one percent of a GPU
    (``capacity`` = 100 per GPU, ``gpu_equivalent`` = 0.01).

    What an adapter should report:

    - **Whole GPUs and MIG instances:** one record per node and kind (model, MIG
      profile), ``capacity`` counting the devices, ``gpus`` listing the GPUs they are on.
    - **Time-slice replicas and MPS shares:** one record *per physical GPU* when the
      cluster can say which GPU holds what: ``gpus=(index,)``, ``capacity`` the GPU's
      replicas (or 100 for MPS), ``allocated`` what is taken on that GPU, and for
      time-slicing ``memory_allocated_gb``, the GPU memory its jobs asked for. A replica
      or a share lives on one GPU, so only per-GPU counts tell whether a job fits, and
      the broker then fits each job on a GPU (fragmentation-aware) and names it in
      ``Placement.gpus``. A cluster that knows only per-node counts (a device plugin
      that does not say which GPU a replica is on) reports one record per node with
      ``capacity`` over all its GPUs and ``gpus`` listing them; the broker then fits by
      node, as the cluster itself will.
    """

    cluster: str
    node: str
    sharing: Sharing
    gpu_model: str
    unit_memory_gb: float  # memory one unit may use (a slice's memory; a whole GPU's)
    capacity: int
    allocated: int
    gpu_equivalent: float  # physical GPU-equivalents of one unit
    mig_profile: str | None = None
    gpus: tuple[int, ...] = ()  # device indexes on the node this unit lives on
    gpu_memory_gb: float | None = None  # memory of the physical GPU (time-slicing guard)
    # GPU memory the jobs on this unit's GPU(s) asked for, when the cluster knows it
    # (time-slicing guard); None: the broker counts its own jobs' memory per node.
    memory_allocated_gb: float | None = None
    in_mig_mode: bool = False
    broken: str | None = None  # why nothing may be placed here (a drift finding), or None
    labels: Mapping[str, str] = field(default_factory=dict)
    # Topology (broker.core.topology): free ``gpus`` (None: unknown), how close, network domains.
    free_gpus: tuple[int, ...] | None = None
    gpu_topology: GpuTopology | None = None
    topology: Position = ()

    @property
    def free(self) -> int:
        return max(self.capacity - self.allocated, 0)


@dataclass(frozen=True)
class Health:
    ok: bool
    detail: str
    version: str | None = None


class AdapterError(Exception):
    """Base of the errors an adapter raises on purpose."""


class Rejected(AdapterError):
    """The cluster refused the job for a reason that retrying will not fix."""


class Unreachable(AdapterError):
    """The cluster did not answer; the call may be retried later."""


class Misconfigured(Unreachable):
    """The cluster's adapter cannot be built from its registered config (a setting it
    refuses, a fleet file or kubeconfig gone). An :class:`Unreachable`: the cycle skips
    the cluster and its jobs go back to the queue until an admin fixes the config."""


@runtime_checkable
class ClusterAdapter(Protocol):
    """What every cluster kind implements (see the module docstring for guarantees)."""

    name: str

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        """Hand the job to the cluster as ``owner``'s; returns the backend id. Idempotent
        by ``job_id``."""

    def cancel(self, job_id: int) -> None:
        """Stop the job if the cluster has it; no error if it does not."""

    def find(self, job_id: int) -> BackendJob | None:
        """The cluster's job tagged with this gpush id, finished ones included, or None."""

    def statuses(self, cursor: str | None = None) -> StatusPage:
        """Jobs whose state changed since ``cursor`` (all known jobs when None)."""

    def inventory(self) -> list[CapacityUnit]:
        """What the cluster offers now, per node and unit kind."""

    def health(self) -> Health:
        """Whether the cluster answers, and its version."""


# -- optional capabilities (see the module docstring) ------------------------------------

# (gpush job id, spec, placement[, owner]), as submit takes them
SubmitItem = tuple[int, JobSpec, Placement] | tuple[int, JobSpec, Placement, Owner]


class BatchSubmitter(Protocol):
    """Submits a batch at once (on several threads, in one request...)."""

    def submit_many(self, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
        """Per item, in order, the backend id or the :class:`AdapterError` it met; each
        with ``submit``'s guarantees (idempotent by job id)."""


class Scaler(Protocol):
    """Changes a running elastic job's replicas."""

    def scale(self, job_id: int, replicas: int) -> int:
        """Set job ``job_id`` to ``replicas``; returns the replicas the cluster now asks
        for. :class:`Rejected` when the job cannot scale there (not elastic, gone)."""


# The signals a job may ask to be told of a preemption with (its checkpoint hook).
PREEMPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


class Preemptor(Protocol):
    """Asks a running job to stop for a preemption, so that it can save its state first."""

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """Send ``signal`` (one of :data:`PREEMPT_SIGNALS`) to job ``job_id`` now; it has
        ``grace_seconds`` to save its state and exit before the broker cancels it. A job
        that has already ended is no error. The broker queues the job again afterwards:
        its next ``submit`` is a new run, not the one preempted (idempotency holds per run)."""


class NodeFencer(Protocol):
    """Stops new work landing on a node, and lets it land again (Slurm: drain and resume;
    Kubernetes: cordon and uncordon; the simulator: its own flag). Work already running
    there is not touched."""

    def fence(self, node: str, reason: str) -> None:
        """No new job starts on ``node`` from now on; ``reason`` is shown where the
        cluster shows one (Slurm's drain reason). Fencing a fenced node is no error."""

    def unfence(self, node: str) -> None:
        """New jobs may start on ``node`` again. Unfencing a node not fenced is no error."""

    def fenced(self) -> dict[str, str]:
        """The nodes fenced now, with their reasons."""


class MigPublisher(Protocol):
    """Makes the cluster offer a GPU's new MIG layout once the GPU has it (Slurm: the
    node's gres.conf and a reconfigure; Kubernetes: the ``nvidia.com/mig.config`` label
    and the MIG manager's ``nvidia.com/mig.config.state``). ``changes_gpus``: publishing
    makes the cluster change the GPU itself (Kubernetes, whose MIG manager applies the
    layout), so no node agent may change it; otherwise the node's agent changes the GPU
    first and publishing only tells the cluster (Slurm, the simulator)."""

    changes_gpus: ClassVar[bool]
    # The cluster aborts the jobs on a node whose GPUs change under them (Slurm: a node that
    # registers another GRES count), so a change waits for the whole node to be empty.
    needs_empty_node: ClassVar[bool] = False

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Offer GPU ``gpu`` of ``node`` as ``instances`` (profile names with their first
        memory slot, ``"3g.20gb@0"``; empty: MIG mode on, no instance). The GPU must hold
        no job on an instance that is not in ``instances`` (:class:`Rejected` otherwise).
        ``reported``: the node agent's report of that GPU
        (:class:`broker.inventory.agent_report.GpuReport`) once the agent has re-cut it, for
        a cluster that names the instances' devices (Slurm's gres.conf); None before."""

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances the cluster offers on that GPU now (as ``publish_mig`` takes
        them), or None while it is still taking a change in (Kubernetes' MIG manager
        ``pending``)."""


class NodeConfigurer(Protocol):
    """Sets a node's GPUs up as the cluster takes them when a lending pool moves the node
    there (Kubernetes: the GPU Operator's device plugin config, time-slicing replicas or MPS,
    and its MIG manager config). ``setup`` holds ``device_plugin`` and ``mig``, each a config
    name the cluster knows, or either alone."""

    def configure_node(self, node: str, setup: Mapping[str, str]) -> None:
        """Ask the cluster to set ``node`` up as ``setup`` says (the node is fenced there)."""

    def node_configured(self, node: str, setup: Mapping[str, str]) -> bool | None:
        """True once ``node`` is set up so; None while the cluster takes it in; False when
        the cluster failed to (the MIG manager's ``failed``)."""


class RenderedConfig(Protocol):
    """A configuration an adapter rendered and may apply; shown to the admin as YAML."""

    def to_yaml(self) -> str: ...


class TimesliceConfigurator(Protocol):
    """Configures GPU time-slicing on the cluster (the GPU Operator's device plugin)."""

    def timeslice(self, replicas: int, node_label: str | None = None) -> RenderedConfig:
        """The configuration for ``replicas`` per GPU (on nodes with ``node_label``), not applied."""

    def apply_timeslice(self, plan: Any) -> list[str]:
        """Apply a plan from :meth:`timeslice`; returns what changed."""


class Closable(Protocol):
    """Holds threads or connections that should stop when the broker drops the adapter."""

    def close(self) -> None:
        """Stop them; the adapter is not used afterwards."""


# The most output one ``logs`` call returns; ``gpush logs -f`` reads on from ``offset``.
MAX_LOG_CHUNK = 1 << 20


@dataclass(frozen=True)
class JobOutput:
    """What a job printed, as far as the broker can read it, and where it is.

    ``text`` is the output from ``offset`` on (at most :data:`MAX_LOG_CHUNK`), or its last
    ``tail`` lines; ``next_offset`` is where the next read continues (``gpush logs -f``
    polls with it). When the broker cannot read the output (a node-local file, a pod
    already gone), ``readable`` is False and ``location`` says where it is, for the user
    to look there; ``note`` says why, in the user's words.
    """

    location: str  # "node mig01: /home/alice/gpush-logs/gpush-42.out", "pod gpush-42-0 (namespace gpush)"
    text: str = ""
    next_offset: int = 0
    readable: bool = True
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "location": self.location,
            "text": self.text,
            "next_offset": self.next_offset,
            "readable": self.readable,
            "note": self.note,
        }


class LogReader(Protocol):
    """Reads a job's output: Slurm's output files, Kubernetes' pod logs, the simulation's."""

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
        """Job ``job_id``'s output (``stream``: ``stdout`` or ``stderr`` where the cluster
        keeps them apart; of replica ``replica`` of an elastic job, the first when None):
        from character ``offset`` on, or its last ``tail`` lines when ``tail`` is given.
        :class:`Rejected` when the job has no output there (never started, unknown
        replica); :class:`Unreachable` when the cluster does not answer."""


class ChangeNotifier(Protocol):
    """Says when the cluster reports a change of one of the broker's jobs."""

    def notify_changes(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` (no arguments; quick; from any thread) whenever the cluster
        reports that one of this broker's jobs changed; None stops it."""


class TenantQuotaKeeper(Protocol):
    """Holds tenants to their GPU quotas on the cluster's side too, behind the broker's ledger."""

    def tenant_quotas(self, quotas: Mapping[str, float]) -> RenderedConfig:
        """The cluster's limits for ``quotas`` (tenant -> physical GPU-equivalents; a tenant
        not named has no quota), rendered, not applied."""

    def apply_tenant_quotas(self, plan: Any) -> list[str]:
        """Bring the cluster in line with a plan from :meth:`tenant_quotas`, writing only what
        differs from what it has; returns what changed (empty when nothing did)."""


# Every optional capability, and the methods each adds to the protocol.
CAPABILITIES: dict[type, tuple[str, ...]] = {
    BatchSubmitter: ("submit_many",),
    Scaler: ("scale",),
    TimesliceConfigurator: ("timeslice", "apply_timeslice"),
    Closable: ("close",),
    LogReader: ("logs",),
    ChangeNotifier: ("notify_changes",),
    TenantQuotaKeeper: ("tenant_quotas", "apply_tenant_quotas"),
    Preemptor: ("preempt",),
    NodeFencer: ("fence", "unfence", "fenced"),
    MigPublisher: ("publish_mig", "mig_published"),
    NodeConfigurer: ("configure_node", "node_configured"),
}

_C = TypeVar("_C")


def declared(adapter: object) -> frozenset[type]:
    """The capabilities ``adapter`` declares (its ``capabilities``; none when it has none)."""
    return frozenset(getattr(adapter, "capabilities", ()))


def supports(adapter: object, capability: type) -> bool:
    """Whether ``adapter`` declares ``capability`` (one of :data:`CAPABILITIES`)."""
    if capability not in CAPABILITIES:
        raise ValueError(f"{capability.__name__} is not an adapter capability: use one of {_names(CAPABILITIES)}")
    return capability in declared(adapter)


def capability(adapter: object, wanted: type[_C]) -> _C | None:
    """``adapter`` as the capability Protocol ``wanted`` when it declares it, else None::

    scaler = capability(adapter, Scaler)
    if scaler is None: ...  # refuse, saying what the user can do instead
    """
    return adapter if supports(adapter, wanted) else None  # type: ignore[return-value]


def undeclared_or_missing(cls: type) -> list[str]:
    """What is wrong with an adapter class's declaration: capabilities declared without
    their methods, and capabilities whose methods it has but does not declare (so the
    broker would never use them). Empty when the declaration is true."""
    problems = []
    for protocol, methods in CAPABILITIES.items():
        has = [m for m in methods if callable(getattr(cls, m, None))]
        if protocol in declared(cls) and len(has) < len(methods):
            missing = ", ".join(m for m in methods if m not in has)
            problems.append(f"{cls.__name__} declares {protocol.__name__} but has no {missing}")
        elif protocol not in declared(cls) and has:
            problems.append(f"{cls.__name__} has {', '.join(has)} but does not declare {protocol.__name__}")
    unknown = declared(cls) - CAPABILITIES.keys()
    if unknown:
        problems.append(f"{cls.__name__} declares {_names(unknown)}, which are not adapter capabilities")
    return problems


def _names(protocols: Iterable[type]) -> str:
    return ", ".join(sorted(p.__name__ for p in protocols))


def submit_batch(adapter: ClusterAdapter, items: Sequence[SubmitItem]) -> list[str | AdapterError]:
    """Submit ``items``: through ``submit_many`` when the adapter declares
    :class:`BatchSubmitter`, else one ``submit`` after another (:func:`submit_each`)."""
    batch = capability(adapter, BatchSubmitter)
    if batch is not None:
        return batch.submit_many(items)
    return submit_each(adapter, items)


class Submitter(Protocol):
    """What :func:`submit_each` calls: an adapter, or the part of one that submits."""

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str: ...


def submit_each(adapter: Submitter, items: Sequence[SubmitItem], *, threads: int = 1) -> list[str | AdapterError]:
    """``adapter.submit`` for each ``(job_id, spec, placement[, owner])`` on up to ``threads`` threads:
    per item the backend id or the :class:`AdapterError` it raised, in order. What the
    scheduler does for an adapter without ``submit_many``, and what adapters that have
    one run after their own preparation (their submitting part is handed in)."""

    def one(item: SubmitItem) -> str | AdapterError:
        try:
            return adapter.submit(*item)
        except AdapterError as exc:
            return exc

    if min(threads, len(items)) <= 1:
        return [one(item) for item in items]
    with ThreadPoolExecutor(min(threads, len(items))) as pool:
        return list(pool.map(one, items))


# The one place the broker names adapter modules: kind -> "module:Class".
ADAPTERS: dict[str, str] = {
    "sim": "broker.simulation.cluster:SimulatedCluster",
    "slurm": "adapters.slurm:SlurmAdapter",
    "k8s": "adapters.k8s:KubernetesAdapter",
}


def adapter_class(kind: str) -> type:
    """The adapter class for a cluster kind, imported on first use (SDKs stay optional)."""
    try:
        target = ADAPTERS[kind]
    except KeyError:
        raise ValueError(f"unknown cluster kind {kind!r}: use one of {', '.join(ADAPTERS)}") from None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
