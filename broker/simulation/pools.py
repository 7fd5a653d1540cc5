"""GPU accounting inside a simulated cluster: pools of units, the queues jobs wait in, and
how a job's units are taken and given back.

A node's GPUs are grouped into pools, one per kind of unit (whole GPUs of a model, one MIG
profile, MPS GPUs, time-sliced GPUs); a unit class gathers the pools across the cluster
that can serve one kind of request. :class:`broker.simulation.cluster.SimulatedCluster`
decides when a job starts; this module decides where it fits and what it holds:

- **Node choice.** Without a node in the placement, a job takes the first node, in
  fleet-file order, with room (:class:`_FirstFit` finds it without scanning every node).
  Replicas (``placement.replicas``) are placed together on one node.
- **Fencing.** A fenced pool (its node fenced) reports no room to its unit classes and
  fits no job, so nothing new starts there; the jobs it holds run on, and its inventory
  is unchanged.
- **Whole GPUs by device.** A whole-GPU pool knows which of its GPUs are free: a job
  takes those its placement names (``gpus``, when all are free), else the ones
  :func:`broker.core.topology.choose_gpus` picks on its node's topology (as Slurm picks
  by gres.conf ``Links=``, the device plugin by NVLink). Its inventory says which are
  free (``free_gpus``), with the node's ``gpu_topology`` and network ``topology``.
- **Inventory.** Whole GPUs and MIG instances: one unit per node and kind. MPS and
  time-slicing: one unit per physical GPU (``gpus=(index,)``, capacity 100 or the GPU's
  replicas), time-sliced ones with the memory their jobs asked (``memory_allocated_gb``).
- **MPS.** Units are percent of one GPU; each replica's share lives on one GPU: the
  one its placement names, else the lowest-indexed GPU with room.
- **Time-slicing.** Replicas go to the GPUs their placement names; without, they are
  handed out least-loaded first (the physical GPU with the most free replicas, lowest
  index on ties), so jobs spread over the GPUs. There is no memory isolation: the
  ``gpu_memory_gb`` of the jobs on one physical GPU is summed, and :meth:`Pool.take`
  reports the GPUs a job pushed over what they have (the cluster then fails that job).
"""

from __future__ import annotations

from collections import deque

from broker.core.adapter import BackendState, CapacityUnit, Placement, Rejected, Sharing
from broker.core.gpus import GpuModel
from broker.core.topology import choose_gpus
from broker.simulation.fleet import FleetGpu, FleetNode

DEFAULT_DURATION_S = 300

UnitKey = tuple[Sharing, str | None, str | None]  # (sharing, MIG profile, GPU model or None for any)

MIG_SHARINGS = (Sharing.SLURM_MIG, Sharing.K8S_MIG)
SHARING_BY_MODE = {
    ("slurm", "whole"): Sharing.SLURM_EXCLUSIVE,
    ("slurm", "mig"): Sharing.SLURM_MIG,
    ("slurm", "mps"): Sharing.SLURM_MPS,
    ("k8s", "whole"): Sharing.K8S_EXCLUSIVE,
    ("k8s", "mig"): Sharing.K8S_MIG,
    ("k8s", "timeslice"): Sharing.K8S_TIMESLICE,
}
SHARED_SHARINGS = (Sharing.SLURM_MPS, Sharing.K8S_TIMESLICE)  # units per physical GPU


class _FirstFit:
    """A max segment tree over the pools of one unit kind: the first pool with room for
    ``need`` units in O(log pools), so placing a job does not scan every node."""

    __slots__ = ("_size", "_tree")

    def __init__(self, count: int) -> None:
        size = 1
        while size < count:
            size *= 2
        self._size = size
        self._tree = [0] * (2 * size)

    @property
    def most(self) -> int:
        """The most room any one pool has."""
        return self._tree[1]

    def set(self, slot: int, room: int) -> None:
        tree = self._tree
        i = slot + self._size
        if tree[i] == room:
            return
        tree[i] = room
        i >>= 1
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            top = left if left >= right else right
            if tree[i] == top:
                return
            tree[i] = top
            i >>= 1

    def first(self, need: int, after: int = -1) -> int:
        """The lowest slot after ``after`` with room for ``need``, or -1."""
        tree, size = self._tree, self._size
        if after < 0:
            if tree[1] < need:
                return -1
            i = 1
            while i < size:
                i *= 2
                if tree[i] < need:
                    i += 1
            return i - size
        # Only MPS jobs with several replicas get here (room fits one share, not all): rare.
        for slot in range(after + 1, size):
            if tree[slot + size] >= need:
                return slot
        return -1


class SimJob:
    """A job as a simulated cluster tracks it: what it asked for, how it runs and ends,
    and where it runs or waits."""

    __slots__ = (
        "job_id",
        "seq",
        "placement",
        "sharing",
        "units",
        "replicas",
        "need",
        "memory_gb",
        "duration_us",
        "limit_us",
        "exit_at_end",
        "pinned",
        "pins",
        "state",
        "reason",
        "node",
        "exit_code",
        "at_us",
        "pool",
        "unit_class",
        "holdings",
        "started_us",
        "ends_us",
        "gang",
        "tasks",
    )

    def __init__(self, job_id: int, seq: int, placement: Placement, unit_class: UnitClass) -> None:
        self.job_id = job_id
        self.seq = seq
        self.placement = placement
        self.sharing = placement.sharing
        self.units = placement.units
        self.replicas = placement.replicas
        self.need = placement.units * placement.replicas
        self.memory_gb = 0.0
        self.duration_us = DEFAULT_DURATION_S * 1_000_000
        self.limit_us: int | None = None
        self.exit_at_end = 0
        self.pinned = placement.node is not None
        # (GPU position in its pool, units) per replica its placement pins to a GPU, or None.
        self.pins: tuple[tuple[int, int], ...] | None = None
        self.state = BackendState.PENDING
        self.reason: str | None = None
        self.node: str | None = placement.node
        self.exit_code: int | None = None
        self.at_us = 0
        self.pool: Pool | None = None  # where it runs, or waits if pinned
        self.unit_class = unit_class  # the cluster-wide queue it waits in if not pinned
        self.holdings: tuple[tuple[int, int], ...] = ()  # (GPU position in pool, units) for MPS, time-slicing
        self.started_us: int | None = None
        self.ends_us: int | None = None
        # A multi-node job: the pools of its other nodes (ranks 1..N-1; ``pool`` is rank 0's),
        # taken and given back together with ``pool``; and its processes per node.
        self.gang: tuple[Pool, ...] = ()
        self.tasks = 1

    @property
    def pools(self) -> tuple[Pool, ...]:
        """Every pool the job holds (or waits for) units in: its node's, and a gang's others."""
        return (self.pool, *self.gang) if self.pool is not None else self.gang


class Pool:
    """One kind of unit on one node (whole GPUs of a model, one MIG profile, MPS GPUs,
    time-sliced GPUs) with its free counters and the FIFO of jobs pinned to it."""

    __slots__ = (
        "node",
        "sharing",
        "model",
        "profile",
        "gpus",
        "capacity",
        "free",
        "per_gpu",
        "gpu_room",
        "gpu_memory",
        "labels",
        "fenced",
        "waiting",
        "waiting_count",
        "slots",
        "_units",
        "topology",
        "position",
        "free_gpus",
        "taken",
    )

    def __init__(
        self,
        node: FleetNode,
        sharing: Sharing,
        model: GpuModel,
        profile: str | None,
        gpus: tuple[int, ...],
        units: int,
        per_gpu: int,
    ) -> None:
        self.node = node.name
        self.sharing = sharing
        self.model = model
        self.profile = profile
        self.gpus = gpus
        self.capacity = units
        self.free = units
        self.per_gpu = per_gpu
        shared = sharing in (Sharing.SLURM_MPS, Sharing.K8S_TIMESLICE)
        self.gpu_room = [per_gpu] * len(gpus) if shared else None
        self.gpu_memory = [0.0] * len(gpus) if sharing is Sharing.K8S_TIMESLICE else None
        self.labels = node.labels
        self.fenced: str | None = None  # why its node takes no new job, while it is fenced
        self.waiting: deque[SimJob] = deque()
        self.waiting_count = 0
        self.slots: list[tuple[UnitClass, int]] = []
        self._units: list[CapacityUnit] | None = None  # what inventory() reports, until it changes
        self.topology = node.gpu_topology
        self.position = node.position
        # Whole GPUs: the free device indexes, and those each job holds here (by job id).
        whole = sharing in (Sharing.SLURM_EXCLUSIVE, Sharing.K8S_EXCLUSIVE)
        self.free_gpus: list[int] | None = list(gpus) if whole else None
        self.taken: dict[int, tuple[int, ...]] = {}

    def set_fenced(self, reason: str | None) -> None:
        """Fence the pool's node (``reason``) or unfence it (None)."""
        self.fenced = reason
        self._units = None
        self.refresh()

    def inventory(self, cluster: str) -> list[CapacityUnit]:
        """This pool's inventory records: one per physical GPU for MPS and time-slicing,
        one for the pool otherwise. Kept until an allocation changes them. A fenced node's
        units are all taken, with why (``labels["unavailable"]``), as Slurm's and
        Kubernetes' adapters report a drained or cordoned node."""
        if self._units is not None:
            return self._units
        model, sharing = self.model, self.sharing
        if sharing in MIG_SHARINGS:
            memory, equivalent = model.profile(self.profile).memory_gb, model.gpu_equivalent(self.profile)
        elif sharing is Sharing.SLURM_MPS:
            memory, equivalent = model.memory_gb / 100, 0.01
        elif sharing is Sharing.K8S_TIMESLICE:
            # Nothing stops a replica from using the whole GPU's memory; the guard
            # against over-commit is gpu_memory_gb, summed over the GPU's jobs.
            memory, equivalent = float(model.memory_gb), 1 / self.per_gpu
        else:
            memory, equivalent = float(model.memory_gb), 1.0
        common = {
            "cluster": cluster,
            "node": self.node,
            "sharing": sharing,
            "gpu_model": model.name,
            "unit_memory_gb": memory,
            "gpu_equivalent": equivalent,
            "gpu_memory_gb": float(model.memory_gb),
            "labels": self.labels if self.fenced is None else {**self.labels, "unavailable": f"fenced: {self.fenced}"},
            "gpu_topology": self.topology,
            "topology": self.position,
        }
        fenced = self.fenced is not None
        if self.gpu_room is not None:
            # A share or a replica lives on one GPU: one record per physical GPU.
            self._units = [
                CapacityUnit(
                    **common,
                    capacity=self.per_gpu,
                    allocated=self.per_gpu if fenced else self.per_gpu - self.gpu_room[pos],
                    gpus=(gpu,),
                    memory_allocated_gb=None if self.gpu_memory is None else self.gpu_memory[pos],
                )
                for pos, gpu in enumerate(self.gpus)
            ]
        else:
            self._units = [
                CapacityUnit(
                    **common,
                    capacity=self.capacity,
                    allocated=self.capacity if fenced else self.capacity - self.free,
                    mig_profile=self.profile,
                    gpus=self.gpus,
                    in_mig_mode=sharing in MIG_SHARINGS,
                    free_gpus=None if self.free_gpus is None else () if fenced else tuple(self.free_gpus),
                )
            ]
        return self._units

    def refresh(self) -> None:
        """Tell the unit classes this pool serves how much room unpinned jobs may use
        here now: none while jobs pinned to this pool wait, so they are not starved, and
        none while its node is fenced."""
        if self.waiting_count or self.fenced is not None:
            room = 0
        elif self.gpu_room is not None and self.sharing is Sharing.SLURM_MPS:
            room = max(self.gpu_room)
        else:
            room = self.free
        for unit_class, slot in self.slots:
            unit_class.tree.set(slot, room)

    def blocked(self, job: SimJob) -> bool:
        """Whether a job waiting here first could take what ``job`` needs: any job not
        pinned to GPUs (FIFO), or one pinned to a GPU ``job`` is pinned to."""
        if job.pins is None:
            return self.waiting_count > 0
        wanted = {pos for pos, _ in job.pins}
        for other in self.waiting:
            if other.state is not BackendState.PENDING:
                continue
            if other.pins is None or any(pos in wanted for pos, _ in other.pins):
                return True
        return False

    def could_ever_hold(self, job: SimJob) -> bool:
        if job.pins is not None:
            if len(job.pins) == 1:
                return job.pins[0][1] <= self.per_gpu
            return all(units <= self.per_gpu for units in pinned_units(job.pins).values())
        if self.sharing is Sharing.SLURM_MPS:
            return job.units <= 100 and job.replicas <= len(self.gpus) * (100 // job.units)
        return job.need <= self.capacity

    def fits(self, job: SimJob) -> bool:
        if self.fenced is not None:
            return False
        if job.pins is not None:
            room = self.gpu_room
            if len(job.pins) == 1:
                pos, units = job.pins[0]
                return room[pos] >= units
            return all(room[pos] >= units for pos, units in pinned_units(job.pins).items())
        if self.sharing is not Sharing.SLURM_MPS:
            return self.free >= job.need
        if job.replicas == 1:
            return max(self.gpu_room) >= job.units
        return sum(room // job.units for room in self.gpu_room) >= job.replicas

    def take(self, job: SimJob) -> list[int]:
        """Allocate ``job``'s units; returns the GPU positions whose memory it over-committed."""
        self._units = None
        self.free -= job.need
        if self.free_gpus is not None:
            self._take_gpus(job)
        room = self.gpu_room
        if room is None:
            return []
        held: dict[int, int] = {}
        if job.pins is not None:
            for pos, units in job.pins:
                room[pos] -= units
                held[pos] = held.get(pos, 0) + units
        elif self.sharing is Sharing.SLURM_MPS:
            for _ in range(job.replicas):
                pos = next(p for p, r in enumerate(room) if r >= job.units)
                room[pos] -= job.units
                held[pos] = held.get(pos, 0) + job.units
        else:
            for _ in range(job.need):
                pos = max(range(len(room)), key=room.__getitem__)  # least loaded, lowest index
                room[pos] -= 1
                held[pos] = held.get(pos, 0) + 1
        job.holdings = tuple(held.items())
        return self._charge_memory(job)

    def _take_gpus(self, job: SimJob) -> None:
        """The whole GPUs ``job`` holds here: those its placement names when all are free
        on this node, else choose_gpus's on the node's topology."""
        free = self.free_gpus
        named = job.placement.gpus
        if job.placement.node == self.node and len(named) == job.need and set(named) <= set(free):
            chosen = tuple(named)
        else:
            chosen = choose_gpus(self.topology, free, min(job.need, len(free))) or ()
        gone = set(chosen)
        self.free_gpus = [g for g in free if g not in gone]
        self.taken[job.job_id] = chosen

    def _give_gpus(self, job: SimJob) -> None:
        back = self.taken.pop(job.job_id, ())
        if back:
            self.free_gpus = sorted({*self.free_gpus, *back})

    def _charge_memory(self, job: SimJob) -> list[int]:
        if self.gpu_memory is None:
            return []
        over = []
        for pos, units in job.holdings:
            self.gpu_memory[pos] += units * job.memory_gb
            if self.gpu_memory[pos] > self.model.memory_gb + 1e-9:
                over.append(pos)
        return over

    def restore(self, job: SimJob) -> None:
        """Re-take a running job's recorded allocation (after a reload); whole GPUs as
        :meth:`take` picks them (the state file does not keep which)."""
        self._units = None
        self.free -= job.need
        if self.free_gpus is not None:
            self._take_gpus(job)
        if self.gpu_room is not None:
            for pos, units in job.holdings:
                self.gpu_room[pos] -= units
            self._charge_memory(job)

    def release(self, job: SimJob) -> None:
        self._units = None
        self.free += job.need
        if self.free_gpus is not None:
            self._give_gpus(job)
        if self.gpu_room is not None:
            for pos, units in job.holdings:
                self.gpu_room[pos] += units
                if self.gpu_memory is not None:
                    self.gpu_memory[pos] = max(self.gpu_memory[pos] - units * job.memory_gb, 0.0)
        job.holdings = ()

    def waiting_reason(self, job: SimJob) -> str:
        """Why ``job``, pinned to this pool, waits: the reason its status shows."""
        p = job.placement
        head = (
            f"waiting for {describe_request(job.sharing, p.mig_profile, self.model.name, job.units, job.replicas)} "
            f"on {self.node}"
        )
        if self.fenced is not None:
            return f"{head}: the node is fenced ({self.fenced})"
        if self.fits(job) and self.waiting_count:
            return f"{head}: {self.waiting_count} earlier job(s) waiting first"
        if job.pins is not None:
            on = pinned_units(job.pins)
            gpus = ", ".join(str(self.gpus[pos]) for pos in on)
            room = min(self.gpu_room[pos] for pos in on)
            if self.sharing is Sharing.SLURM_MPS:
                return f"{head}, GPU {gpus}: {room}% free there"
            return f"{head}, GPU {gpus}: {room} of {self.per_gpu} replicas free there"
        if self.sharing is Sharing.SLURM_MPS:
            return f"{head}: at most {max(self.gpu_room)}% free on one GPU"
        if self.free == 0:
            return f"{head}: all {self.capacity} busy"
        return f"{head}: {self.free} of {self.capacity} free"


def gpu_pins(pool: Pool, job: SimJob) -> tuple[tuple[int, int], ...]:
    """(GPU position in ``pool``, units) per replica for the GPUs ``job.placement.gpus``
    names: one per replica, or one for them all; Rejected otherwise."""
    gpus = job.placement.gpus
    if len(gpus) == 1:
        gpus = gpus * job.replicas
    if len(gpus) != job.replicas:
        raise Rejected(
            f"placement names {len(job.placement.gpus)} GPUs for {job.replicas} replicas: "
            "name one GPU per replica, or one for all of them"
        )
    return tuple((pool.gpus.index(g), job.units) for g in gpus)


def pinned_units(pins: tuple[tuple[int, int], ...]) -> dict[int, int]:
    """Units per GPU position of a job's pins (two replicas may share a GPU)."""
    units: dict[int, int] = {}
    for pos, n in pins:
        units[pos] = units.get(pos, 0) + n
    return units


class UnitClass:
    """The pools that can serve one kind of request, (sharing, MIG profile, model or any
    model), with the cluster-wide FIFO of unpinned jobs waiting for it."""

    __slots__ = ("key", "pools", "tree", "waiting", "waiting_count", "max_capacity", "max_gpus", "model_name")

    def __init__(self, key: UnitKey, pools: list[Pool]) -> None:
        self.key = key
        self.pools = pools
        self.tree = _FirstFit(len(pools))
        self.waiting: deque[SimJob] = deque()
        self.waiting_count = 0
        self.max_capacity = max(p.capacity for p in pools)
        self.max_gpus = max(len(p.gpus) for p in pools)
        models = {p.model.name for p in pools}
        self.model_name = models.pop() if len(models) == 1 else None  # to name it in reasons

    def head(self) -> SimJob | None:
        while self.waiting and self.waiting[0].state is not BackendState.PENDING:
            self.waiting.popleft()
        return self.waiting[0] if self.waiting else None

    def could_ever_hold(self, job: SimJob) -> bool:
        if job.sharing is Sharing.SLURM_MPS:
            return job.units <= 100 and job.replicas <= self.max_gpus * (100 // job.units)
        return job.need <= self.max_capacity

    def find_room(self, job: SimJob) -> Pool | None:
        """The first pool, in fleet-file order, that can start ``job`` now, or None."""
        need = job.units if job.sharing is Sharing.SLURM_MPS else job.need
        slot = self.tree.first(need)
        while slot >= 0:
            pool = self.pools[slot]
            if pool.fits(job):
                return pool
            slot = self.tree.first(need, slot)
        return None

    def waiting_reason(self, job: SimJob, cluster: str) -> str:
        """Why ``job``, not pinned to a node, waits in this queue of ``cluster``."""
        p = job.placement
        head = f"waiting for {describe_request(job.sharing, p.mig_profile, self.model_name, job.units, job.replicas)}"
        if self.waiting_count:
            return f"{head}: {self.waiting_count} earlier job(s) waiting first"
        most = self.tree.most
        if most == 0:
            return f"{head}: all busy on every node of {cluster}"
        unit = "%" if job.sharing is Sharing.SLURM_MPS else ""
        return f"{head}: at most {most}{unit} free on any one node of {cluster}"


def pools_of(node: FleetNode, flavor: str) -> list[Pool]:
    """A node's GPUs grouped into pools by (sharing, model, MIG profile); a MIG GPU joins
    one pool per instance it holds."""
    groups: dict[tuple[Sharing, str, str | None], list[FleetGpu]] = {}
    for gpu in node.gpus:
        sharing = SHARING_BY_MODE[(flavor, gpu.mode)]
        for profile in gpu.mig if gpu.mode == "mig" else (None,):
            groups.setdefault((sharing, gpu.model.name, profile), []).append(gpu)
    pools = []
    for (sharing, _model_name, profile), members in groups.items():
        first = members[0]
        if sharing is Sharing.SLURM_MPS:
            per_gpu = 100  # percent of one GPU, as Slurm counts gres/mps
        elif sharing is Sharing.K8S_TIMESLICE:
            per_gpu = first.replicas
        else:
            per_gpu = 1
        gpus = tuple(dict.fromkeys(gpu.index for gpu in members))
        pools.append(Pool(node, sharing, first.model, profile, gpus, len(members) * per_gpu, per_gpu))
    return pools


def describe_request(sharing: Sharing, profile: str | None, model: str | None, units: int, replicas: int) -> str:
    """A request in the user's terms: 'a 1g.5gb slice', '4 whole A100-SXM4-80GB GPUs'."""
    n = units * replicas
    gpu = f"{model} GPU" if model else "GPU"
    if sharing in MIG_SHARINGS:
        return f"a {profile} slice" if n == 1 else f"{n} {profile} slices"
    if sharing is Sharing.SLURM_MPS:
        share = f"{units}% of an MPS {gpu}"
        return share if replicas == 1 else f"{replicas} shares of {share}"
    if sharing is Sharing.K8S_TIMESLICE:
        return f"a time-slice replica of a {gpu}" if n == 1 else f"{n} time-slice replicas of {gpu}s"
    return f"a whole {gpu}" if n == 1 else f"{n} whole {gpu}s"
