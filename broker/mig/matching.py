"""Which waiting MIG jobs fit which instances, and the matching that places the most weight.

This module owns the demand side of ``gpush mig plan``: a waiting job that wants one
MIG slice (:class:`SliceDemand`), the instance types (GPU model, profile) each job
accepts, ranked smallest fitting profile first, with the reason a job no GPU here could
ever take, jobs grouped into classes of equal weight and acceptance
(:func:`group_demand`), and the weight-optimal assignment of those classes to a supply
of free instances (:func:`match_jobs`). The planner (broker.mig.plan) scores every
layout it considers with it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from broker.core.gpus import MODELS, GpuModel, MigProfile, gpu_model

# Weights become integers (micro-units) so that the flow's costs compare exactly.
_WEIGHT_SCALE = 1_000_000


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


InstanceType = tuple[str, str]  # (model name, profile)


@dataclass
class GroupedDemand:
    """Jobs grouped by what they accept and their weight, in queue order."""

    jobs: list[SliceDemand]
    accepts: list[dict[InstanceType, int]]  # per job: acceptable instance type -> preference rank
    classes: list[tuple[int, dict[InstanceType, int], list[int]]]  # (weight, accepts, job indices)
    reasons: dict[int, str]  # jobs no GPU here could ever take, with why


def _profile_rank(profile: MigProfile) -> tuple[int, int, float]:
    return (profile.memory_slots, profile.compute_slices, profile.memory_gb)


def group_demand(jobs: Sequence[SliceDemand], models: Iterable[GpuModel]) -> GroupedDemand:
    """``jobs`` in classes, and what each accepts of the MIG-capable ``models`` (those of
    the GPUs being planned)."""
    here = {model.name: model for model in models if model.mig_capable}
    accepts: list[dict[InstanceType, int]] = []
    reasons: dict[int, str] = {}
    for i, job in enumerate(jobs):
        allowed, unknown = _allowed_models(job)
        ok: dict[InstanceType, int] = {}
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
    return GroupedDemand(list(jobs), accepts, classes, reasons)


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


def match_jobs(
    demand: GroupedDemand, supply: Counter[InstanceType], only: Sequence[int] | None = None
) -> dict[int, dict[InstanceType, int]]:
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
    flow: dict[int, dict[InstanceType, int]] = defaultdict(dict)
    holders: dict[InstanceType, dict[int, int]] = defaultdict(dict)  # type -> class -> jobs placed there
    prefs = {c: sorted(demand.classes[c][1], key=lambda t: (demand.classes[c][1][t], t)) for c in order}

    def path(c: int, seen_types: set[InstanceType], seen_classes: set[int]) -> list[tuple[int, InstanceType]] | None:
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


def matched_weight(demand: GroupedDemand, assignment: dict[int, dict[InstanceType, int]]) -> int:
    return sum(demand.classes[c][0] * n for c, per in assignment.items() for n in per.values())
