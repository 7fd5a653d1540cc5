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
   An A100 has a few dozen distinct maximal profile multisets. (broker.mig.layouts)
2. GPUs that may not change keep today's layout: on a node a multi-node job keeps
   (``MigGpu.kept``: reserved for a waiting gang, or running a rank of one), not
   MIG-capable, MIG mode off (unless ``enable_mig``), work running outside a MIG
   instance, or work running on an instance (unless ``repartition_busy``; then busy
   instances stay where they are and only the rest of the GPU is re-cut).
3. A start is built greedily: the GPU whose current layout serves the most remaining
   demand goes first and keeps its layout when no candidate serves more; otherwise it
   takes the candidate that serves the most. Then single-GPU changes are tried from
   that start and from today's layouts (hill climbing), accepting one only if it places
   more weight, or the same weight with fewer GPUs changed. The better result wins.
4. Jobs are matched to instances over (model, profile) instance types, the most weight
   first (a greedy over a transversal matroid, which is optimal), each job on the
   smallest profile that covers it where it can (broker.mig.matching).
   Busy instances are not capacity, today or in the plan.

Weights are the caller's: 1 per job counts jobs, a job's GPU-equivalents counts work,
a priority-scaled weight favours urgent jobs. The plan reports GPU-equivalents anyway.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from broker.core.gpus import GpuModel, model_of_nvml_product
from broker.inventory.agent_report import GpuReport, NodeReport
from broker.mig.layouts import Layout, MigSlot, layout_problem, maximal_layouts, place_instances, same_layout
from broker.mig.matching import GroupedDemand, InstanceType, SliceDemand, group_demand, match_jobs, matched_weight

_MAX_SWEEPS = 6


# --- inputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MigGpu:
    """One physical GPU as the planner sees it.

    ``mig_enabled``: MIG mode is on (else the GPU is used whole and ``instances`` is
    empty). ``busy``: work runs on the GPU that is not tied to one of ``instances``
    (whole-GPU use, or processes NVML did not place on an instance). ``kept``: why its
    node may not be re-cut now, whatever the queue wants (a multi-node job keeps the
    node: broker.core.gangs), or None.
    """

    node: str
    index: int
    model: GpuModel
    mig_enabled: bool = True
    instances: tuple[MigSlot, ...] = ()
    busy: bool = False
    kept: str | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.index)

    @property
    def name(self) -> str:
        return f"{self.node} GPU {self.index}"


def keep_nodes(gpus: Iterable[MigGpu], kept: Mapping[str, str]) -> list[MigGpu]:
    """``gpus`` with those of the nodes in ``kept`` (node -> why) kept as they are."""
    return [replace(g, kept=kept[g.node]) if g.node in kept else g for g in gpus]


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


def mark_held(gpus: Iterable[MigGpu], held: Mapping[tuple[str, str], int]) -> list[MigGpu]:
    """``gpus`` with the instances jobs hold marked busy: ``held`` counts, per (node,
    profile), the instances the scheduler's placed jobs hold there (clusters count them per
    node, not per GPU, so the first such instances of the node are marked, after those a
    process already marks)."""
    gpus = list(gpus)
    left = dict(held)
    for gpu in gpus:
        for slot in gpu.instances:
            if slot.busy and left.get((gpu.node, slot.profile), 0) > 0:
                left[(gpu.node, slot.profile)] -= 1
    out = []
    for gpu in gpus:
        slots = []
        for slot in gpu.instances:
            key = (gpu.node, slot.profile)
            if not slot.busy and left.get(key, 0) > 0:
                left[key] -= 1
                slot = MigSlot(slot.profile, slot.start, busy=True)
            slots.append(slot)
        out.append(replace(gpu, instances=tuple(slots)))
    return out


def gpus_from_reports(reports: Iterable[NodeReport]) -> list[MigGpu]:
    """Every GPU of ``reports`` whose model gpush knows, in (node, index) order."""
    out = [g for r in reports for gpu in r.gpus if (g := gpu_from_report(r.node, gpu)) is not None]
    return sorted(out, key=lambda g: g.key)


# --- the planner -------------------------------------------------------------------------


@dataclass
class _Gpu:
    gpu: MigGpu
    today: Layout
    fixed: Layout  # instances that must stay (busy ones)
    frozen: str | None  # why the GPU keeps today's layout, or None
    candidates: list[Layout]

    def free(self, layout: Layout) -> Counter[InstanceType]:
        return Counter((self.gpu.model.name, s.profile) for s in layout if not s.busy)


def _normalize(gpu: MigGpu, enable_mig: bool, repartition_busy: bool) -> _Gpu:
    # A fleet is mostly GPUs of a few models in a few layouts: each shape is worked out once.
    key = (
        gpu.model.name,
        tuple((s.profile, s.start, s.busy) for s in gpu.instances),
        gpu.mig_enabled,
        gpu.busy,
        gpu.kept,
        enable_mig,
        repartition_busy,
    )
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) > 10_000:  # a long-lived broker: keep the cache bounded
            _SHAPES.clear()
        shape = _SHAPES[key] = _shape(
            gpu.model, gpu.instances, gpu.mig_enabled, gpu.busy, enable_mig, repartition_busy, gpu.name, gpu.kept
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
    kept: str | None = None,
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
    if kept is not None:
        frozen = f"its node {kept}"
    elif not model.mig_capable:
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
            marked = tuple(MigSlot(s.profile, s.start, busy=any(same_layout([s], [f]) for f in busy)) for s in layout)
            key = tuple(sorted(Counter(s.profile for s in layout).items()))
            kept = sum(1 for s in layout if any(same_layout([s], [o]) for o in today))
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
    dem = group_demand(demand, (g.model for g in gpus))
    movable = [k for k, st in enumerate(states) if st.frozen is None]

    memo: dict[tuple, tuple[int, int, int]] = {}
    usable = {ty for _, accepts, _ in dem.classes for ty in accepts}

    def score(supply: Counter[InstanceType]) -> tuple[int, int, int]:
        """(weight placed, minus the preference ranks used, free instances some waiting
        job could use): on equal weight, smaller fitting slices and more of them."""
        # only types some waiting job accepts matter: the key drops the rest
        key = tuple(sorted((t, n) for t, n in supply.items() if n > 0 and t in usable))
        if key not in memo:
            assignment = match_jobs(dem, Counter(dict(key)))
            rank = sum(dem.classes[c][1][ty] * n for c, per in assignment.items() for ty, n in per.items())
            spare = sum(n for ty, n in key if ty in usable)
            memo[key] = (matched_weight(dem, assignment), -rank, spare)
        return memo[key]

    def rated(supply: Counter[InstanceType], changes: int) -> tuple[int, int, int, int]:
        weight, rank, spare = score(supply)
        return (weight, -changes, rank, spare)

    def value(config: list[Layout]) -> tuple[int, int, int, int]:
        supply: Counter[InstanceType] = Counter()
        for st, layout in zip(states, config):
            supply.update(st.free(layout))
        return rated(supply, sum(1 for st, layout in zip(states, config) if not same_layout(st.today, layout)))

    def climb(config: list[Layout]) -> list[Layout]:
        """Single-GPU changes while one places more weight, or as much with fewer
        changes (then smaller fitting slices, then more usable spare ones)."""
        config = list(config)
        supply: Counter[InstanceType] = Counter()
        for st, layout in zip(states, config):
            supply.update(st.free(layout))
        changed = [not same_layout(st.today, layout) for st, layout in zip(states, config)]
        for _ in range(_MAX_SWEEPS):
            improved = False
            for k in movable:
                st = states[k]
                options = [(st.today if st.gpu.mig_enabled else (), False)]
                options += [(c, not same_layout(st.today, c)) for c in st.candidates]
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


def _distinct(options: list[tuple[Layout, bool]], usable: set[InstanceType], st: _Gpu) -> list[tuple[Layout, bool]]:
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


def _greedy(states: list[_Gpu], dem: GroupedDemand, movable: list[int]) -> list[Layout]:
    """A start for the climb: GPUs that serve the most with today's layout go first and
    keep it unless a candidate serves more of what remains."""
    config = [st.today for st in states]
    left = [list(idx) for _, _, idx in dem.classes]

    def serve(supply: Counter[InstanceType], take: bool) -> int:
        live = [c for c in range(len(dem.classes)) if left[c]]
        sub = GroupedDemand(dem.jobs, dem.accepts, [(w, a, left[c]) for c, (w, a, _) in enumerate(dem.classes)], {})
        assignment = match_jobs(sub, supply, only=live)
        if take:
            for c, per in assignment.items():
                del left[c][: sum(per.values())]
        return matched_weight(sub, assignment)

    frozen_supply: Counter[InstanceType] = Counter()
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


def _outcome(dem: GroupedDemand, states: list[_Gpu], config: list[Layout]) -> Outcome:
    supply: Counter[InstanceType] = Counter()
    slots: dict[InstanceType, list[tuple[_Gpu, MigSlot]]] = defaultdict(list)
    for st, layout in zip(states, config):
        supply.update(st.free(layout))
        for s in layout:
            if not s.busy:
                slots[(st.gpu.model.name, s.profile)].append((st, s))
    assignment = match_jobs(dem, supply)
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


def _why_not_now(job: SliceDemand, accepts: dict[InstanceType, int], states: list[_Gpu], config: list[Layout]) -> str:
    able = [st for st in states if any((st.gpu.model.name, p) in accepts for p in st.gpu.model.mig_profiles)]
    frozen = [st for st in able if st.frozen is not None]
    if able and len(frozen) == len(able):
        why = sorted({st.frozen for st in frozen})
        return f"the GPUs that could offer it keep their layout: {'; '.join(why)}"
    return "the GPUs that could offer it are given to other waiting jobs of more weight (or earlier in the queue)"


def _gpu_plan(st: _Gpu, layout: Layout, dem: GroupedDemand) -> GpuPlan:
    gpu = st.gpu
    planned_mig = gpu.mig_enabled or bool(layout)
    if same_layout(st.today, layout) and planned_mig == gpu.mig_enabled:
        action = "keep"
    elif not gpu.mig_enabled:
        action = "enable-mig"
    elif all(any(same_layout([t], [s]) for s in layout) for t in st.today):
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
