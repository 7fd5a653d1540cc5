"""MIG layouts from the queue: which partition of each GPU places the most waiting work.

This module owns the planning half of ``gpush mig plan``: given the GPUs (their model,
today's MIG layout, which instances run work) and the waiting jobs that want one MIG
slice each, :func:`plan_mig` proposes a layout per GPU and says what it would place
compared with today. It reads no database and prints nothing; broker.mig.config turns a
plan into the nvidia-mig-parted config, gres.conf lines and a readable summary.

How a plan is made (every step deterministic: GPUs in (node, index) order, jobs in the
order given, ties broken by a fixed candidate order):

1. Every valid *placed* layout of a model (instances with their first memory slot, no
   overlap, starts among the profile's placements, compute within the GPU's) is
   enumerated once and cached; the maximal ones (nothing more fits) are the candidates.
   An A100 has a few dozen distinct maximal profile multisets.
2. GPUs that may not change keep today's layout: not MIG-capable, MIG mode off (unless
   ``enable_mig``), work running outside a MIG instance, or work running on an instance
   (unless ``repartition_busy``; then busy instances stay where they are and only the
   rest of the GPU is re-cut).
3. A start is built greedily: the GPU whose current layout serves the most remaining
   demand goes first and keeps its layout when no candidate serves more; otherwise it
   takes the candidate that serves the most. Then single-GPU changes are tried from
   that start and from today's layouts (hill climbing), accepting one only if it places
   more weight, or the same weight with fewer GPUs changed. The better result wins.
4. Jobs are matched to instances over (model, profile) instance types, the most weight
   first (a greedy over a transversal matroid, which is optimal), each job on the
   smallest profile that covers it where it can.
   Busy instances are not capacity, today or in the plan.

Weights are the caller's: 1 per job counts jobs, a job's GPU-equivalents counts work,
a priority-scaled weight favours urgent jobs. The plan reports GPU-equivalents anyway.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from broker.core.gpus import MODELS, GpuModel, MigProfile, gpu_model, mig_layout_problem, model_of_nvml_product
from broker.inventory.agent_report import GpuReport, NodeReport

# Weights become integers (micro-units) so that the flow's costs compare exactly.
_WEIGHT_SCALE = 1_000_000
_MAX_SWEEPS = 6


# --- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class MigSlot:
    """One MIG instance: its profile and first memory slot (None: not known yet; the
    planner then places it at the first start that fits). ``busy``: work runs on it."""

    profile: str
    start: int | None = None
    busy: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return self.profile if self.start is None else f"{self.profile}@{self.start}"


@dataclass(frozen=True)
class MigGpu:
    """One physical GPU as the planner sees it.

    ``mig_enabled``: MIG mode is on (else the GPU is used whole and ``instances`` is
    empty). ``busy``: work runs on the GPU that is not tied to one of ``instances``
    (whole-GPU use, or processes NVML did not place on an instance).
    """

    node: str
    index: int
    model: GpuModel
    mig_enabled: bool = True
    instances: tuple[MigSlot, ...] = ()
    busy: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.index)

    @property
    def name(self) -> str:
        return f"{self.node} GPU {self.index}"


@dataclass(frozen=True)
class SliceDemand:
    """A waiting job that wants one MIG slice: of ``profile``, or of at least
    ``memory_gb`` (then any profile that covers it, the smallest preferred).
    ``models``: the GPU models it accepts (names or aliases; empty: any)."""

    job: str
    profile: str | None = None
    memory_gb: float | None = None
    weight: float = 1.0
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.profile is None) == (self.memory_gb is None):
            raise ValueError(f"job {self.job}: give a MIG profile or a minimum memory_gb, exactly one of them")
        if not self.weight > 0:
            raise ValueError(f"job {self.job}: weight must be positive, not {self.weight}")

    @property
    def wants(self) -> str:
        return self.profile if self.profile is not None else f"≥{self.memory_gb:g} GB"


# --- outputs ----------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuPlan:
    """Today's and the proposed layout of one GPU.

    ``action``: ``keep`` (nothing to do), ``create`` (today's instances stay where they
    are; instances are only added), ``repartition`` (instances are destroyed and
    created), ``enable-mig`` (MIG mode goes on: a GPU reset, then the instances).
    ``reason`` says why it is kept or what the change gains.
    """

    node: str
    index: int
    model: GpuModel
    today: tuple[MigSlot, ...]
    planned: tuple[MigSlot, ...]
    mig_enabled_today: bool
    mig_enabled_planned: bool
    action: str
    reason: str

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.index)

    @property
    def changed(self) -> bool:
        return self.action != "keep"

    @property
    def busy_instances(self) -> tuple[MigSlot, ...]:
        return tuple(s for s in self.planned if s.busy)


@dataclass(frozen=True)
class JobPlacement:
    job: str
    node: str
    index: int
    profile: str
    start: int
    gpu_equivalent: float
    weight: float


@dataclass(frozen=True)
class Outcome:
    """The waiting jobs one set of layouts places, each on its instance."""

    placements: tuple[JobPlacement, ...]

    @property
    def jobs(self) -> int:
        return len(self.placements)

    @property
    def weight(self) -> float:
        return sum(p.weight for p in self.placements)

    @property
    def gpu_equivalents(self) -> float:
        return sum(p.gpu_equivalent for p in self.placements)

    @property
    def per_profile(self) -> dict[str, int]:
        return dict(sorted(Counter(p.profile for p in self.placements).items()))


@dataclass(frozen=True)
class Unplaced:
    job: str
    wants: str
    reason: str


@dataclass(frozen=True)
class MigPlan:
    gpus: tuple[GpuPlan, ...]
    waiting: int
    today: Outcome
    planned: Outcome
    unplaced: tuple[Unplaced, ...]  # waiting jobs the plan does not place, with the reason

    @property
    def changed(self) -> tuple[GpuPlan, ...]:
        return tuple(g for g in self.gpus if g.changed)

    @property
    def nodes_to_drain(self) -> tuple[str, ...]:
        """Nodes with a GPU to re-cut: drain them first (Slurm drains per node, and its
        gres.conf changes with the layout)."""
        return tuple(sorted({g.node for g in self.changed}))

    def gpu(self, node: str, index: int) -> GpuPlan:
        for g in self.gpus:
            if g.key == (node, index):
                return g
        raise KeyError(f"no GPU {index} on {node} in this plan")


# --- MIG geometry -----------------------------------------------------------------------

Layout = tuple[MigSlot, ...]  # sorted by start
_LAYOUTS: dict[str, tuple[tuple[Layout, ...], tuple[Layout, ...]]] = {}


def _span(model: GpuModel, slot: MigSlot) -> range:
    assert slot.start is not None
    start = slot.start
    return range(start, start + model.profile(slot.profile).memory_slots)


def layout_problem(model: GpuModel, instances: Iterable[MigSlot]) -> str | None:
    """Why placed ``instances`` cannot live on one GPU of ``model`` together, or None.

    Stricter than broker.core.gpus.mig_layout_problem, which only asks whether *some*
    placement exists: here every start must be one of its profile's placements and no
    two instances may share a memory slot.
    """
    instances = list(instances)
    problem = mig_layout_problem(model, [s.profile for s in instances]) if instances else None
    if problem:
        return problem
    taken: dict[int, MigSlot] = {}
    for slot in instances:
        profile = model.profile(slot.profile)
        if slot.start is None:
            return f"{slot.profile} has no placement start"
        if slot.start not in profile.placements:
            starts = ", ".join(map(str, profile.placements))
            return f"{slot.profile} cannot start at memory slot {slot.start} on {model.name} (only at {starts})"
        for s in _span(model, slot):
            if s in taken:
                return f"{slot} and {taken[s]} overlap at memory slot {s} on {model.name}"
            taken[s] = slot
    return None


def _options(model: GpuModel) -> list[MigSlot]:
    order = list(model.mig_profiles)
    opts = [MigSlot(p.name, start) for p in model.mig_profiles.values() for start in p.placements]
    return sorted(opts, key=lambda s: (s.start, -model.profile(s.profile).memory_slots, order.index(s.profile)))


def _enumerate(model: GpuModel) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    cached = _LAYOUTS.get(model.name)
    if cached is not None:
        return cached
    opts = _options(model)
    masks = [sum(1 << s for s in _span(model, o)) for o in opts]
    compute = [model.profile(o.profile).compute_slices for o in opts]
    every: list[Layout] = []
    maximal: list[Layout] = []

    def fits(mask: int, used: int, i: int) -> bool:
        return not (mask & masks[i]) and used + compute[i] <= model.compute_slices

    def walk(i: int, mask: int, used: int, chosen: list[MigSlot]) -> None:
        if i == len(opts):
            if chosen:
                layout = tuple(chosen)
                every.append(layout)
                if not any(fits(mask, used, j) for j in range(len(opts))):
                    maximal.append(layout)
            return
        if fits(mask, used, i):
            chosen.append(opts[i])
            walk(i + 1, mask | masks[i], used + compute[i], chosen)
            chosen.pop()
        walk(i + 1, mask, used, chosen)

    if model.mig_capable:
        walk(0, 0, 0, [])
    _LAYOUTS[model.name] = (tuple(every), tuple(maximal))
    return _LAYOUTS[model.name]


def valid_layouts(model: GpuModel) -> tuple[Layout, ...]:
    """Every non-empty valid placed layout of ``model`` (cached per model)."""
    return _enumerate(model)[0]


def maximal_layouts(model: GpuModel) -> tuple[Layout, ...]:
    """The valid placed layouts of ``model`` to which no further instance can be added."""
    return _enumerate(model)[1]


def layout_counts(model: GpuModel, layout: Iterable[MigSlot]) -> dict[str, int]:
    """Instances per profile, in NVIDIA's profile order (largest last)."""
    counts = Counter(s.profile for s in layout)
    return {p: counts[p] for p in model.mig_profiles if counts[p]}


def place_instances(model: GpuModel, instances: Iterable[MigSlot]) -> Layout:
    """``instances`` with a start for those that have none, around those that have one
    (largest first, lowest start first). Raises ValueError if they do not fit."""
    instances = list(instances)
    fixed = [s for s in instances if s.start is not None]
    problem = layout_problem(model, fixed)
    if problem:
        raise ValueError(problem)
    loose = sorted((s for s in instances if s.start is None), key=lambda s: -model.profile(s.profile).memory_slots)
    taken = [False] * model.memory_slots
    for slot in fixed:
        for s in _span(model, slot):
            taken[s] = True
    compute = sum(model.profile(s.profile).compute_slices for s in instances)
    if compute > model.compute_slices:
        raise ValueError(f"{', '.join(s.profile for s in instances)} need {compute} compute slices on {model.name}")
    placed: list[MigSlot] = []

    def place(i: int) -> bool:
        if i == len(loose):
            return True
        profile = model.profile(loose[i].profile)
        for start in profile.placements:
            span = range(start, start + profile.memory_slots)
            if all(not taken[s] for s in span):
                for s in span:
                    taken[s] = True
                placed.append(MigSlot(profile.name, start, loose[i].busy))
                if place(i + 1):
                    return True
                placed.pop()
                for s in span:
                    taken[s] = False
        return False

    if not place(0):
        raise ValueError(f"{', '.join(str(s) for s in instances)} do not fit {model.name}'s MIG placements together")
    return tuple(sorted(fixed + placed, key=lambda s: (s.start, s.profile)))


def _same(a: Iterable[MigSlot], b: Iterable[MigSlot]) -> bool:
    return sorted((s.profile, s.start) for s in a) == sorted((s.profile, s.start) for s in b)


# --- GPUs from the node agent's report -----------------------------------------------------


def gpu_from_report(node: str, gpu: GpuReport, model: GpuModel | None = None) -> MigGpu | None:
    """The planner's view of one reported GPU, or None when its model is unknown or NVML
    could not read it. An instance is busy when a process runs on it; a process that NVML
    tied to no instance makes the whole GPU busy."""
    model = model or model_of_nvml_product(gpu.product)
    if model is None or gpu.error:
        return None
    on_instance = {p.mig_uuid for p in gpu.processes if p.mig_uuid}
    loose = any(not p.mig_uuid for p in gpu.processes)
    slots = tuple(
        MigSlot(i.profile, i.placement_start, busy=bool(i.uuid and i.uuid in on_instance))
        for i in sorted(gpu.mig_instances, key=lambda i: i.placement_start)
    )
    return MigGpu(node, gpu.index, model, bool(gpu.mig_mode_current), slots, busy=loose)


def gpus_from_reports(reports: Iterable[NodeReport]) -> list[MigGpu]:
    """Every GPU of ``reports`` whose model gpush knows, in (node, index) order."""
    out = [g for r in reports for gpu in r.gpus if (g := gpu_from_report(r.node, gpu)) is not None]
    return sorted(out, key=lambda g: g.key)


# --- matching jobs to instances ---------------------------------------------------------------

_Type = tuple[str, str]  # (model name, profile)


@dataclass
class _Demand:
    """Jobs grouped by what they accept and their weight, in queue order."""

    jobs: list[SliceDemand]
    accepts: list[dict[_Type, int]]  # per job: acceptable instance type -> preference rank
    classes: list[tuple[int, dict[_Type, int], list[int]]]  # (weight, accepts, job indices)
    reasons: dict[int, str]  # jobs no GPU here could ever take, with why


def _profile_rank(profile: MigProfile) -> tuple[int, int, float]:
    return (profile.memory_slots, profile.compute_slices, profile.memory_gb)


def _demand(jobs: Sequence[SliceDemand], gpus: Sequence[MigGpu]) -> _Demand:
    here = {g.model.name: g.model for g in gpus if g.model.mig_capable}
    accepts: list[dict[_Type, int]] = []
    reasons: dict[int, str] = {}
    for i, job in enumerate(jobs):
        allowed, unknown = _allowed_models(job)
        ok: dict[_Type, int] = {}
        for model in here.values():
            if allowed is not None and model.name not in allowed:
                continue
            if job.profile is not None:
                if job.profile in model.mig_profiles:
                    ok[(model.name, job.profile)] = 0
            else:
                fits = sorted(
                    (p for p in model.mig_profiles.values() if p.memory_gb >= job.memory_gb), key=_profile_rank
                )
                ok.update({(model.name, p.name): rank for rank, p in enumerate(fits)})
        accepts.append(ok)
        if not ok:
            reasons[i] = _why_never(job, allowed, unknown, here)
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, job in enumerate(jobs):
        if accepts[i]:
            key = (round(job.weight * _WEIGHT_SCALE), tuple(sorted(accepts[i].items())))
            groups[key].append(i)
    classes = [(w, dict(acc), idx) for (w, acc), idx in groups.items()]
    classes.sort(key=lambda c: (-c[0], c[2][0]))
    return _Demand(list(jobs), accepts, classes, reasons)


def _allowed_models(job: SliceDemand) -> tuple[set[str] | None, list[str]]:
    if not job.models:
        return None, []
    allowed, unknown = set(), []
    for name in job.models:
        try:
            allowed.add(gpu_model(name).name)
        except ValueError:
            unknown.append(name)
    return allowed, unknown


def _why_never(job: SliceDemand, allowed: set[str] | None, unknown: list[str], here: dict[str, GpuModel]) -> str:
    if unknown and not allowed:
        return f"it asks for GPU model {', '.join(unknown)}, which gpush does not know"
    if job.profile is not None:
        offering = [m.name for m in MODELS if job.profile in m.mig_profiles]
        if not offering:
            known = sorted({p for m in MODELS for p in m.mig_profiles}, key=lambda p: (int(p.split("g")[0]), p))
            return f"no GPU model offers MIG profile {job.profile} (profiles: {', '.join(known)})"
        if allowed is not None and not allowed & set(offering):
            return f"it accepts only {', '.join(sorted(allowed))}, which do not offer {job.profile}"
        return f"{job.profile} is a profile of {', '.join(offering)}, and no GPU here is one"
    largest = max((p.memory_gb for m in MODELS for p in m.mig_profiles.values()), default=0)
    if job.memory_gb > largest:
        return f"no MIG profile has {job.memory_gb:g} GB (the largest has {largest:g} GB): it needs a whole GPU"
    if allowed is not None:
        return f"no {', '.join(sorted(allowed))} GPU here has a MIG profile of {job.memory_gb:g} GB or more"
    return f"no MIG-capable GPU here has a profile of {job.memory_gb:g} GB or more"


def _match(demand: _Demand, supply: Counter[_Type], only: Sequence[int] | None = None) -> dict[int, dict[_Type, int]]:
    """How many jobs of each demand class (index into ``demand.classes``) go to each
    instance type.

    The sets of jobs that can all be placed form a transversal matroid, so taking the
    classes by weight, most first, and placing as many of each as augmenting paths
    allow (a path may move earlier jobs to other instance types, never drop them)
    places the most weight. Paths try the smallest fitting profile first.
    """
    order = list(only) if only is not None else list(range(len(demand.classes)))
    left = {t: n for t, n in supply.items() if n > 0}
    if not order or not left:
        return {}
    flow: dict[int, dict[_Type, int]] = defaultdict(dict)
    holders: dict[_Type, dict[int, int]] = defaultdict(dict)  # type -> class -> jobs placed there
    prefs = {c: sorted(demand.classes[c][1], key=lambda t: (demand.classes[c][1][t], t)) for c in order}

    def path(c: int, seen_types: set[_Type], seen_classes: set[int]) -> list[tuple[int, _Type]] | None:
        seen_classes.add(c)
        for t in prefs[c]:
            if left.get(t, 0) > 0 and t not in seen_types:
                return [(c, t)]
        for t in prefs[c]:
            if t in seen_types or t not in holders:
                continue
            seen_types.add(t)
            for c2, n in sorted(holders[t].items()):
                if n > 0 and c2 not in seen_classes:
                    rest = path(c2, seen_types, seen_classes)
                    if rest is not None:
                        return [(c, t), *rest]
        return None

    for c in order:
        need = len(demand.classes[c][2])
        while need:
            steps = path(c, set(), set())
            if steps is None:
                break
            # each later step's class gives up one unit of the previous step's type
            push = min(need, left[steps[-1][1]])
            for (_, t), (c2, _) in zip(steps, steps[1:]):
                push = min(push, holders[t][c2])
            for i, (ci, t) in enumerate(steps):
                flow[ci][t] = flow[ci].get(t, 0) + push
                holders[t][ci] = holders[t].get(ci, 0) + push
                if i + 1 < len(steps):
                    c2 = steps[i + 1][0]
                    flow[c2][t] -= push
                    holders[t][c2] -= push
            left[steps[-1][1]] -= push
            need -= push
    return {c: {t: n for t, n in per.items() if n} for c, per in flow.items() if any(per.values())}


def _matched_weight(demand: _Demand, assignment: dict[int, dict[_Type, int]]) -> int:
    return sum(demand.classes[c][0] * n for c, per in assignment.items() for n in per.values())


# --- the planner -------------------------------------------------------------------------


@dataclass
class _Gpu:
    gpu: MigGpu
    today: Layout
    fixed: Layout  # instances that must stay (busy ones)
    frozen: str | None  # why the GPU keeps today's layout, or None
    candidates: list[Layout]

    def free(self, layout: Layout) -> Counter[_Type]:
        return Counter((self.gpu.model.name, s.profile) for s in layout if not s.busy)


def _normalize(gpu: MigGpu, enable_mig: bool, repartition_busy: bool) -> _Gpu:
    # A fleet is mostly GPUs of a few models in a few layouts: each shape is worked out once.
    key = (
        gpu.model.name,
        tuple((s.profile, s.start, s.busy) for s in gpu.instances),
        gpu.mig_enabled,
        gpu.busy,
        enable_mig,
        repartition_busy,
    )
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) > 10_000:  # a long-lived broker: keep the cache bounded
            _SHAPES.clear()
        shape = _SHAPES[key] = _shape(
            gpu.model, gpu.instances, gpu.mig_enabled, gpu.busy, enable_mig, repartition_busy, gpu.name
        )
    today, busy, frozen, candidates = shape
    return _Gpu(gpu, today, busy, frozen, list(candidates))


_SHAPES: dict[tuple, tuple[Layout, Layout, str | None, tuple[Layout, ...]]] = {}


def _shape(
    model: GpuModel,
    instances: tuple[MigSlot, ...],
    mig_enabled: bool,
    gpu_busy: bool,
    enable_mig: bool,
    repartition_busy: bool,
    name: str,
) -> tuple[Layout, Layout, str | None, tuple[Layout, ...]]:
    """Today's placed layout, its busy instances, why the GPU may not change (or None),
    and the candidate layouts, for one GPU shape (``name`` only names it in errors)."""
    today: Layout = ()
    if mig_enabled and instances and model.mig_capable:
        try:
            today = place_instances(model, instances)
        except ValueError as exc:
            raise ValueError(f"{name}: today's MIG layout is not valid: {exc}") from None
    busy = tuple(s for s in today if s.busy)
    frozen = None
    if not model.mig_capable:
        frozen = f"{model.name} is not MIG-capable"
    elif gpu_busy:
        frozen = "work runs on it outside a MIG instance"
    elif not mig_enabled and not enable_mig:
        frozen = "MIG mode is off (the GPU is used whole; turning MIG on is not allowed in this plan)"
    elif busy and not repartition_busy:
        frozen = f"work runs on {', '.join(str(s) for s in busy)} (re-partitioning busy GPUs is not allowed)"
    candidates: list[Layout] = []
    if frozen is None:
        by_counts: dict[tuple, tuple[tuple[int, int], Layout]] = {}
        for order, layout in enumerate(maximal_layouts(model)):
            if not all(any(s.profile == f.profile and s.start == f.start for s in layout) for f in busy):
                continue
            marked = tuple(MigSlot(s.profile, s.start, busy=any(_same([s], [f]) for f in busy)) for s in layout)
            key = tuple(sorted(Counter(s.profile for s in layout).items()))
            kept = sum(1 for s in layout if any(_same([s], [o]) for o in today))
            best = by_counts.get(key)
            if best is None or (-kept, order) < best[0]:
                by_counts[key] = ((-kept, order), marked)
        candidates = [layout for _, layout in sorted(by_counts.values(), key=lambda v: v[0][1])]
    return today, busy, frozen, tuple(candidates)


def plan_mig(
    gpus: Sequence[MigGpu],
    demand: Sequence[SliceDemand],
    *,
    repartition_busy: bool = False,
    enable_mig: bool = False,
) -> MigPlan:
    """The layout per GPU that places the most waiting weight, changing as few GPUs as
    that allows. See the module docstring for the steps."""
    keys = [g.key for g in gpus]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"GPU {dup[1]} of node {dup[0]} is listed twice")
    states = [_normalize(g, enable_mig, repartition_busy) for g in sorted(gpus, key=lambda g: g.key)]
    dem = _demand(demand, gpus)
    movable = [k for k, st in enumerate(states) if st.frozen is None]

    memo: dict[tuple, tuple[int, int, int]] = {}
    usable = {ty for _, accepts, _ in dem.classes for ty in accepts}

    def score(supply: Counter[_Type]) -> tuple[int, int, int]:
        """(weight placed, minus the preference ranks used, free instances some waiting
        job could use): on equal weight, smaller fitting slices and more of them."""
        # only types some waiting job accepts matter: the key drops the rest
        key = tuple(sorted((t, n) for t, n in supply.items() if n > 0 and t in usable))
        if key not in memo:
            assignment = _match(dem, Counter(dict(key)))
            rank = sum(dem.classes[c][1][ty] * n for c, per in assignment.items() for ty, n in per.items())
            spare = sum(n for ty, n in key if ty in usable)
            memo[key] = (_matched_weight(dem, assignment), -rank, spare)
        return memo[key]

    def rated(supply: Counter[_Type], changes: int) -> tuple[int, int, int, int]:
        weight, rank, spare = score(supply)
        return (weight, -changes, rank, spare)

    def value(config: list[Layout]) -> tuple[int, int, int, int]:
        supply: Counter[_Type] = Counter()
        for st, layout in zip(states, config):
            supply.update(st.free(layout))
        return rated(supply, sum(1 for st, layout in zip(states, config) if not _same(st.today, layout)))

    def climb(config: list[Layout]) -> list[Layout]:
        """Single-GPU changes while one places more weight, or as much with fewer
        changes (then smaller fitting slices, then more usable spare ones)."""
        config = list(config)
        supply: Counter[_Type] = Counter()
        for st, layout in zip(states, config):
            supply.update(st.free(layout))
        changed = [not _same(st.today, layout) for st, layout in zip(states, config)]
        for _ in range(_MAX_SWEEPS):
            improved = False
            for k in movable:
                st = states[k]
                options = [(st.today if st.gpu.mig_enabled else (), False)]
                options += [(c, not _same(st.today, c)) for c in st.candidates]
                options = _distinct(options, usable, st)
                supply.subtract(st.free(config[k]))
                base_changes = sum(changed) - changed[k]
                best = rated(supply + st.free(config[k]), base_changes + changed[k])
                pick = None
                for option, is_change in options:
                    v = rated(supply + st.free(option), base_changes + is_change)
                    if v > best:
                        best, pick = v, (option, is_change)
                if pick is not None:
                    config[k], changed[k] = pick
                    improved = True
                supply.update(st.free(config[k]))
            if not improved:
                break
        return config

    today = [st.today for st in states]
    placeable = sum(weight * len(jobs) for weight, accepts, jobs in dem.classes if accepts)
    if value(today)[0] >= placeable:
        config = today  # today's layouts already place every waiting job: nothing to change
    else:
        results = [climb(today), climb(_greedy(states, dem, movable))]
        config = max(results, key=value)  # max keeps the first of equals: today's start

    plans = tuple(_gpu_plan(st, layout, dem) for st, layout in zip(states, config))
    today_outcome = _outcome(dem, states, today)
    planned_outcome = _outcome(dem, states, config)
    placed = {p.job for p in planned_outcome.placements}
    unplaced = tuple(
        Unplaced(job.job, job.wants, dem.reasons.get(i) or _why_not_now(job, dem.accepts[i], states, config))
        for i, job in enumerate(dem.jobs)
        if job.job not in placed
    )
    plans = tuple(_with_gain(p, today_outcome, planned_outcome) for p in plans)
    return MigPlan(plans, len(dem.jobs), today_outcome, planned_outcome, unplaced)


def _distinct(options: list[tuple[Layout, bool]], usable: set[_Type], st: _Gpu) -> list[tuple[Layout, bool]]:
    """The first option of each kind: options that offer the same instances some waiting
    job accepts score alike, and an earlier one changes no more than a later one."""
    seen: dict[tuple, bool] = {}
    out = []
    for layout, is_change in options:
        key = tuple(sorted((t, n) for t, n in st.free(layout).items() if t in usable))
        if key in seen and (seen[key] is False or is_change):
            continue
        seen[key] = is_change
        out.append((layout, is_change))
    return out


def _greedy(states: list[_Gpu], dem: _Demand, movable: list[int]) -> list[Layout]:
    """A start for the climb: GPUs that serve the most with today's layout go first and
    keep it unless a candidate serves more of what remains."""
    config = [st.today for st in states]
    left = [list(idx) for _, _, idx in dem.classes]

    def serve(supply: Counter[_Type], take: bool) -> int:
        live = [c for c in range(len(dem.classes)) if left[c]]
        sub = _Demand(dem.jobs, dem.accepts, [(w, a, left[c]) for c, (w, a, _) in enumerate(dem.classes)], {})
        assignment = _match(sub, supply, only=live)
        if take:
            for c, per in assignment.items():
                del left[c][: sum(per.values())]
        return _matched_weight(sub, assignment)

    frozen_supply: Counter[_Type] = Counter()
    for k, st in enumerate(states):
        if k not in movable:
            frozen_supply.update(st.free(st.today))
    serve(frozen_supply, take=True)
    todo = list(movable)
    while todo:
        keep = {k: serve(states[k].free(states[k].today), take=False) for k in todo}
        k = max(todo, key=lambda k: keep[k])  # first of equals: (node, index) order
        todo.remove(k)
        st = states[k]
        best, best_value = st.today if st.gpu.mig_enabled else (), keep[k]
        for option in st.candidates:
            v = serve(st.free(option), take=False)
            if v > best_value:
                best, best_value = option, v
        config[k] = best
        serve(st.free(best), take=True)
    return config


def _outcome(dem: _Demand, states: list[_Gpu], config: list[Layout]) -> Outcome:
    supply: Counter[_Type] = Counter()
    slots: dict[_Type, list[tuple[_Gpu, MigSlot]]] = defaultdict(list)
    for st, layout in zip(states, config):
        supply.update(st.free(layout))
        for s in layout:
            if not s.busy:
                slots[(st.gpu.model.name, s.profile)].append((st, s))
    assignment = _match(dem, supply)
    placements = []
    for c, per in sorted(assignment.items()):
        queue = list(dem.classes[c][2])
        for ty, n in sorted(per.items(), key=lambda kv: (dem.classes[c][1][kv[0]], kv[0])):
            for i in queue[:n]:
                st, s = slots[ty].pop(0)
                model = st.gpu.model
                placements.append(
                    JobPlacement(
                        dem.jobs[i].job,
                        st.gpu.node,
                        st.gpu.index,
                        s.profile,
                        s.start,
                        model.gpu_equivalent(s.profile),
                        dem.jobs[i].weight,
                    )
                )
            del queue[:n]
    order = {job.job: i for i, job in enumerate(dem.jobs)}
    return Outcome(tuple(sorted(placements, key=lambda p: order[p.job])))


def _why_not_now(job: SliceDemand, accepts: dict[_Type, int], states: list[_Gpu], config: list[Layout]) -> str:
    able = [st for st in states if any((st.gpu.model.name, p) in accepts for p in st.gpu.model.mig_profiles)]
    frozen = [st for st in able if st.frozen is not None]
    if able and len(frozen) == len(able):
        why = sorted({st.frozen for st in frozen})
        return f"the GPUs that could offer it keep their layout: {'; '.join(why)}"
    return "the GPUs that could offer it are given to other waiting jobs of more weight (or earlier in the queue)"


def _gpu_plan(st: _Gpu, layout: Layout, dem: _Demand) -> GpuPlan:
    gpu = st.gpu
    planned_mig = gpu.mig_enabled or bool(layout)
    if _same(st.today, layout) and planned_mig == gpu.mig_enabled:
        action = "keep"
    elif not gpu.mig_enabled:
        action = "enable-mig"
    elif all(any(_same([t], [s]) for s in layout) for t in st.today):
        action = "create"
    else:
        action = "repartition"
    for_check = layout if layout else ()
    problem = layout_problem(gpu.model, for_check) if for_check else None
    assert problem is None, f"{gpu.name}: planned layout {for_check}: {problem}"
    reason = st.frozen or ""
    return GpuPlan(gpu.node, gpu.index, gpu.model, st.today, layout, gpu.mig_enabled, planned_mig, action, reason)


def _with_gain(plan: GpuPlan, today: Outcome, planned: Outcome) -> GpuPlan:
    if plan.reason:
        return plan
    before = sum(1 for p in today.placements if (p.node, p.index) == plan.key)
    after = sum(1 for p in planned.placements if (p.node, p.index) == plan.key)
    if plan.changed:
        reason = f"places {after} waiting job{'s' * (after != 1)} (today {before})"
    elif after:
        reason = f"today's layout already serves {after} waiting job{'s' * (after != 1)}"
    else:
        reason = "no waiting job would gain from a change"
    return GpuPlan(**{**plan.__dict__, "reason": reason})
