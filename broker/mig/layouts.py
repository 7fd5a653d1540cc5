"""MIG geometry: the valid placed layouts of each GPU model.

This module owns what may live on one MIG-capable GPU: an instance is a profile at a
first memory slot (:class:`MigSlot`); a layout is a set of them that do not overlap,
start only where their profile may start, and use no more compute than the GPU has.
It checks a layout (:func:`layout_problem`), places instances whose start is not known
yet (:func:`place_instances`), and enumerates every valid layout of a model once
(:func:`valid_layouts`), with the maximal ones the planner (broker.mig.plan) chooses
among (:func:`maximal_layouts`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from broker.core.gpus import GpuModel, mig_layout_problem


@dataclass(frozen=True, order=True)
class MigSlot:
    """One MIG instance: its profile and first memory slot (None: not known yet; the
    planner then places it at the first start that fits). ``busy``: work runs on it."""

    profile: str
    start: int | None = None
    busy: bool = field(default=False, compare=False)

    def __str__(self) -> str:
        return self.profile if self.start is None else f"{self.profile}@{self.start}"

    @classmethod
    def parse(cls, text: str) -> MigSlot:
        """``"3g.20gb@4"`` (a profile at its first memory slot), as ``str`` writes it."""
        profile, at, start = str(text).strip().partition("@")
        if not profile or not at or not start.isdigit():
            raise ValueError(f"MIG instance {text!r}: write it as PROFILE@SLOT, such as 3g.20gb@0")
        return cls(profile, int(start))


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


def same_layout(a: Iterable[MigSlot], b: Iterable[MigSlot]) -> bool:
    return sorted((s.profile, s.start) for s in a) == sorted((s.profile, s.start) for s in b)
