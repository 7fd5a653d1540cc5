"""Pod-list variants of the openb trace, derived from its default pod list the way the
FGD paper (Weng et al., "Beware of Fragmentation", USENIX ATC '23) derives the
workloads of its sensitivity experiments.

This module owns making those variants: pure functions from a ``list[TracePod]``
(and, for pinning, the node list) to a new ``list[TracePod]``, deterministic for a
seed (one ``random.Random(seed)`` per call) and never changing their input; the
statistics that describe a list (:func:`pod_list_stats`); and writing a list in the
trace's CSV format (:func:`write_pods`, read back by
:func:`broker.simulation.traces.read_pods`). Reading the trace stays in
:mod:`broker.simulation.traces`.

GPU demand is the README's: ``gpu_milli`` for a one-GPU pod, 1000 per GPU otherwise.
A share is a fraction (0.4 for 40%). The families, each a list of variants in
:data:`FAMILIES` (labels as the FGD artifact names its lists, ``openb_pod_list_<label>.csv``):

- **gpushare** (:func:`gpushare`, share 0.2..1.0): fractional-GPU pods (one GPU,
  ``gpu_milli`` < 1000) carry ``share`` of the GPU demand (28.5% in the default
  list). The CPU-only pods stay as they are and the number of GPU pods stays the
  same; every GPU pod is drawn again, with replacement, from the default's
  fractional pods or from its other GPU pods (whole- and multi-GPU). How many of
  each: first from the two groups' mean demands, then, while the drawn list misses
  the target by more than 0.1 percentage point, one drawn pod of the group that is
  over is traded for a new draw from the other group. The result is within
  :data:`SHARE_TOLERANCE` (±0.5 point) of the target, in practice ±0.1. At 1.0
  every GPU pod is fractional. As upstream's ``gpushare40``, the list is the
  CPU-only pods, then the fractional pods, then the others, named
  ``openb-pod-0000`` on in that order; the total GPU demand falls as the share rises
  (upstream gpushare40: 5641 GPUs against the default's 6087).
- **multigpu** (:func:`multigpu`, share 0.2..0.5): multi-GPU pods (``num_gpu`` > 1)
  carry ``share`` of the GPU demand (7.3% in the default list). As upstream's
  ``multigpu20``: the list unchanged, then multi-GPU pods drawn with replacement
  from its multi-GPU pods appended under new names (``openb-pod-8152``, ...) until
  the share reaches the target (the last draw is kept only if that is closer).
  Total demand grows (upstream multigpu20: 172 pods appended, 8324 in all).
- **gpuspec** (:func:`gpuspec`, share 0.05..0.33): GPU pods carrying ``share`` of the
  GPU demand accept only some GPU models (``gpu_spec``). Pods are taken in a random
  order until their demand reaches the target; nothing else changes (names, order,
  shapes). Each pinned pod gets one model, drawn among the models that have a node
  able to hold the pod alone (GPUs per node, CPU and memory), each weighted by its
  GPUs *on such nodes*. Weighting by the model's GPUs on those nodes rather than by
  all its GPUs keeps pins feasible in proportion: a 4-GPU pod can go only to the 17
  four-GPU T4 nodes (68 GPUs), not to T4's 842 GPUs, most of them on 2-GPU nodes.
  **Siblings**: ``V100M16`` and ``V100M32`` are the same chip with 16 or 32 GB; a pod
  pinned to one of them accepts both (``V100M16|V100M32``) with probability
  :data:`SIBLING_PROBABILITY` when a node of the other can hold it too, as a user
  who asks for "a V100" would. Alibaba's codes G1/G2/G3 are undisclosed, so they are
  no one's siblings; nor are P100 and T4 of anything.
- **cpu** (:func:`cpu_heavy`, share 0.05..0.25): CPU-only pods (``num_gpu`` 0) make
  up ``share`` of the pods, FGD's "proportion of non-GPU workloads, % of task
  number" (13.3% in the default list). GPU pods are unchanged; CPU-only pods are
  dropped at random (the others keep their names and order) or drawn with
  replacement from the list's CPU-only pods and appended under new names. The count
  is exact up to rounding (half a pod).

How this relates to FGD's published lists. The FGD artifact's experiments run the
lists gpushare40..100, multigpu20..50, gpuspec10..33 and cpu050..250, published as
CSV files (one draw each); the trace copy in the repository (``data/traces/alibaba-openb-2023``)
holds gpushare40 and multigpu20, whose layout these functions follow and whose statistics
they reproduce (compared by ``integration/bench/variants.py``). What is deliberately
different:

- Every share is met within a stated tolerance, and the lists are reproducible from
  a seed; upstream's are one draw each (its gpushare40 is at 40.07%, its multigpu20
  at 20.38%).
- Drawn copies keep every column of the pod they copy (QoS, phase, times); upstream's
  multigpu20 has only the columns ``name``..``gpu_milli``.
- gpuspec pins to one model or to the V100 pair. Upstream's gpuspec lists (seen in
  ``openb_pod_list_gpuspec33_cpu0.csv`` of the FGD simulator's repository) also pin
  to larger sets (``P100|T4|V100M16|V100M32``, ``G2|P100|T4|V100M16|V100M32``); a
  set that wide barely constrains placement on this cluster, so one model measures
  what pinning costs more directly.
- :data:`FAMILIES` adds gpushare20 (below the default's 28.5%) and gpuspec05 to
  upstream's labels.
"""

from __future__ import annotations

import csv
import math
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from numbers import Real

from broker.core.errors import InvalidRequest
from broker.simulation.traces import TraceNode, TracePod

# The promise on every share a family targets: within half a percentage point.
SHARE_TOLERANCE = 0.005
# What gpushare aims for before it stops trading pods (well inside the promise).
_GPUSHARE_AIM = 0.001
# Chance that a pod pinned to a V100 accepts its sibling too (see the module docstring).
SIBLING_PROBABILITY = 0.5
SIBLINGS: dict[str, str] = {"V100M16": "V100M32", "V100M32": "V100M16"}
NAME_PREFIX = "openb-pod-"

# The range of each family's share (a fraction).
SHARE_RANGES: dict[str, tuple[float, float]] = {
    "gpushare": (0.2, 1.0),
    "multigpu": (0.2, 0.5),
    "gpuspec": (0.05, 0.33),
    "cpu": (0.05, 0.25),
}

# Each family's variants in order: (label, share). The label names the list as the
# FGD artifact does (openb_pod_list_<label>.csv).
FAMILIES: dict[str, list[tuple[str, float]]] = {
    "gpushare": [
        ("gpushare20", 0.2),
        ("gpushare40", 0.4),
        ("gpushare60", 0.6),
        ("gpushare80", 0.8),
        ("gpushare100", 1.0),
    ],
    "multigpu": [("multigpu20", 0.2), ("multigpu30", 0.3), ("multigpu40", 0.4), ("multigpu50", 0.5)],
    "gpuspec": [("gpuspec05", 0.05), ("gpuspec10", 0.1), ("gpuspec20", 0.2), ("gpuspec25", 0.25), ("gpuspec33", 0.33)],
    "cpu": [("cpu050", 0.05), ("cpu100", 0.1), ("cpu200", 0.2), ("cpu250", 0.25)],
}

# The trace's pod columns, in its order (openb_pod_list_default.csv).
POD_COLUMNS = (
    "name",
    "cpu_milli",
    "memory_mib",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)


def variant_file(label: str) -> str:
    """The file name upstream gives a list: ``openb_pod_list_<label>.csv``."""
    return f"openb_pod_list_{label}.csv"


# -- what a list is made of -------------------------------------------------------------


@dataclass(frozen=True)
class PodListStats:
    """What the families move: shares of GPU demand, and the CPU-only share of pods."""

    pods: int
    gpu_demand_milli: int
    fractional: float  # fractional-GPU pods' share of GPU demand
    multi_gpu: float  # multi-GPU pods' share of GPU demand
    pinned: float  # share of GPU demand of pods with a gpu_spec
    cpu_only: float  # CPU-only pods' share of the pods

    @property
    def gpu_demand(self) -> float:
        """GPU demand in GPUs."""
        return self.gpu_demand_milli / 1000


def pod_list_stats(pods: Sequence[TracePod]) -> PodListStats:
    demand = sum(p.demand_milli for p in pods)

    def share(selected: Iterable[TracePod]) -> float:
        return sum(p.demand_milli for p in selected) / demand if demand else 0.0

    return PodListStats(
        pods=len(pods),
        gpu_demand_milli=demand,
        fractional=share(p for p in pods if p.fractional),
        multi_gpu=share(p for p in pods if p.num_gpu > 1),
        pinned=share(p for p in pods if p.gpu_spec and not p.cpu_only),
        cpu_only=sum(p.cpu_only for p in pods) / len(pods) if pods else 0.0,
    )


# -- checks and names ------------------------------------------------------------------


def _checked_share(family: str, share: object) -> float:
    low, high = SHARE_RANGES[family]
    if isinstance(share, bool) or not isinstance(share, Real) or not math.isfinite(share):
        raise InvalidRequest(f"{family}: the share must be a number from {low} to {high}, not {share!r}")
    if not low - 1e-9 <= share <= high + 1e-9:
        hint = f" (a fraction: {share / 100:g} for {share:g}%)" if 1 < share <= 100 else ""
        raise InvalidRequest(f"{family}: share {share:g} is outside {low:g}..{high:g}{hint}")
    return float(share)


def _checked_pods(family: str, pods: Sequence[TracePod]) -> list[TracePod]:
    pods = list(pods)
    if not pods:
        raise InvalidRequest(f"{family}: the pod list is empty; give the trace's default pod list")
    return pods


def _fresh_names(taken: Iterable[str], count: int, start: int) -> list[str]:
    """``count`` names ``openb-pod-NNNN`` from ``start`` on, skipping names in use."""
    used = set(taken)
    names: list[str] = []
    number = start
    while len(names) < count:
        name = f"{NAME_PREFIX}{number:04d}"
        if name not in used:
            names.append(name)
        number += 1
    return names


def _renamed(pods: Sequence[TracePod], names: Sequence[str]) -> list[TracePod]:
    return [replace(pod, name=name) for pod, name in zip(pods, names, strict=True)]


def _closer_without_last(part: int, total: int, last: int, target: float) -> bool:
    """Whether the share ``part/total`` is closer to ``target`` without the last pod
    added (of demand ``last``, counted in both)."""
    if total - last <= 0:
        return False
    return abs((part - last) / (total - last) - target) < abs(part / total - target)


# -- the families ------------------------------------------------------------------------


def gpushare(pods: Sequence[TracePod], share: float, seed: int) -> list[TracePod]:
    """Fractional-GPU pods carry ``share`` of the GPU demand (see the module docstring)."""
    share = _checked_share("gpushare", share)
    pods = _checked_pods("gpushare", pods)
    cpu_only = [p for p in pods if p.cpu_only]
    fractional = [p for p in pods if p.fractional]
    others = [p for p in pods if not p.cpu_only and not p.fractional]
    count = len(fractional) + len(others)
    if not fractional:
        raise InvalidRequest("gpushare: the pod list has no fractional-GPU pods to draw from")
    if share < 1.0 and not others:
        raise InvalidRequest("gpushare: the pod list has only fractional GPU pods; a share below 1 needs others")
    rng = random.Random(seed)

    if share >= 1.0:
        n_fractional = count
    else:
        # n·mF / (n·mF + (count-n)·mO) = share, with the groups' mean demands.
        mean_f = sum(p.demand_milli for p in fractional) / len(fractional)
        mean_o = sum(p.demand_milli for p in others) / len(others)
        n_fractional = round(count * share * mean_o / (share * mean_o + (1 - share) * mean_f))
        n_fractional = min(max(n_fractional, 1), count - 1)
    drawn_f = rng.choices(fractional, k=n_fractional)
    drawn_o = rng.choices(others, k=count - n_fractional) if count > n_fractional else []
    demand_f = sum(p.demand_milli for p in drawn_f)
    demand_o = sum(p.demand_milli for p in drawn_o)

    # Sampling noise (a few 8-GPU pods more or less) moves the share by tenths of a
    # point: trade one pod at a time toward the target. Each trade moves it by less
    # than 0.1 point on the default list, so it cannot jump over the aim's window.
    for _ in range(count):
        current = demand_f / (demand_f + demand_o)
        if abs(current - share) <= _GPUSHARE_AIM:
            break
        if current < share and drawn_o:
            demand_o -= drawn_o.pop(rng.randrange(len(drawn_o))).demand_milli
            drawn_f.append(rng.choice(fractional))
            demand_f += drawn_f[-1].demand_milli
        elif current > share and drawn_f:
            demand_f -= drawn_f.pop(rng.randrange(len(drawn_f))).demand_milli
            drawn_o.append(rng.choice(others))
            demand_o += drawn_o[-1].demand_milli
        else:
            break
    reached = demand_f / (demand_f + demand_o)
    if abs(reached - share) > SHARE_TOLERANCE:
        raise InvalidRequest(
            f"gpushare: {count} GPU pods cannot bring fractional pods to {share:.1%} of the GPU "
            f"demand (reached {reached:.1%}); the list is too small or too uniform for this share"
        )
    out = [*cpu_only, *drawn_f, *drawn_o]
    return _renamed(out, _fresh_names((), len(out), 0))


def multigpu(pods: Sequence[TracePod], share: float, seed: int) -> list[TracePod]:
    """Multi-GPU pods carry ``share`` of the GPU demand: the list, then multi-GPU pods
    drawn from it appended under new names (see the module docstring)."""
    share = _checked_share("multigpu", share)
    pods = _checked_pods("multigpu", pods)
    pool = [p for p in pods if p.num_gpu > 1]
    if not pool:
        raise InvalidRequest("multigpu: the pod list has no multi-GPU pods to draw from")
    total = sum(p.demand_milli for p in pods)
    multi = sum(p.demand_milli for p in pool)
    if multi / total > share + SHARE_TOLERANCE:
        raise InvalidRequest(
            f"multigpu: multi-GPU pods already carry {multi / total:.1%} of the GPU demand, above "
            f"{share:.1%}; this family only adds multi-GPU pods"
        )
    rng = random.Random(seed)
    added: list[TracePod] = []
    while multi / total < share:
        added.append(rng.choice(pool))
        multi += added[-1].demand_milli
        total += added[-1].demand_milli
    if added and _closer_without_last(multi, total, added[-1].demand_milli, share):
        added.pop()
    return [*pods, *_renamed(added, _fresh_names((p.name for p in pods), len(added), len(pods)))]


def _holding_gpus(nodes: Sequence[TraceNode]) -> Callable[[TracePod], dict[str, int]]:
    """For a pod, each GPU model's GPUs on the nodes that can hold the pod alone."""
    gpu_nodes = [n for n in nodes if n.gpus and n.model]
    cache: dict[tuple[int, int, int], dict[str, int]] = {}

    def holding(pod: TracePod) -> dict[str, int]:
        key = (pod.num_gpu, pod.cpu_milli, pod.memory_mib)
        if key not in cache:
            weights: dict[str, int] = {}
            for node in gpu_nodes:
                if node.gpus >= pod.num_gpu and node.cpu_milli >= pod.cpu_milli and node.memory_mib >= pod.memory_mib:
                    weights[node.model] = weights.get(node.model, 0) + node.gpus
            cache[key] = dict(sorted(weights.items()))  # sorted: the draw must not hang on node order
        return cache[key]

    return holding


def gpuspec(pods: Sequence[TracePod], nodes: Sequence[TraceNode], share: float, seed: int) -> list[TracePod]:
    """GPU pods carrying ``share`` of the GPU demand are pinned to GPU models a node of
    ``nodes`` can hold them on (see the module docstring for the draw and siblings)."""
    share = _checked_share("gpuspec", share)
    pods = _checked_pods("gpuspec", pods)
    if not any(n.gpus for n in nodes or ()):
        raise InvalidRequest("gpuspec: pinning needs the trace's node list, and it has no GPU nodes")
    holding = _holding_gpus(nodes)
    total = sum(p.demand_milli for p in pods)
    if not total:
        raise InvalidRequest("gpuspec: the pod list has no GPU pods to pin")
    pinned = sum(p.demand_milli for p in pods if p.gpu_spec and not p.cpu_only)
    if pinned / total > share + SHARE_TOLERANCE:
        raise InvalidRequest(
            f"gpuspec: pinned pods already carry {pinned / total:.1%} of the GPU demand, above {share:.1%}"
        )
    candidates = [i for i, p in enumerate(pods) if not p.cpu_only and not p.gpu_spec and holding(p)]
    rng = random.Random(seed)
    rng.shuffle(candidates)
    chosen: list[int] = []
    for index in candidates:
        if pinned / total >= share:
            break
        chosen.append(index)
        pinned += pods[index].demand_milli
    if pinned / total < share - SHARE_TOLERANCE:
        raise InvalidRequest(
            f"gpuspec: the pods that some node can hold carry only {pinned / total:.1%} of the GPU "
            f"demand, below {share:.1%}"
        )
    if chosen and _closer_without_last(pinned, total, pods[chosen[-1]].demand_milli, share):
        chosen.pop()

    out = list(pods)
    for index in chosen:
        pod = pods[index]
        weights = holding(pod)
        model = rng.choices(list(weights), weights=list(weights.values()))[0]
        sibling = SIBLINGS.get(model)
        spec = (model,)
        if sibling in weights and rng.random() < SIBLING_PROBABILITY:
            spec = tuple(sorted((model, sibling)))
        out[index] = replace(pod, gpu_spec=spec)
    return out


def cpu_heavy(pods: Sequence[TracePod], share: float, seed: int) -> list[TracePod]:
    """CPU-only pods make up ``share`` of the pods: dropped at random, or drawn from the
    list's CPU-only pods and appended under new names (see the module docstring)."""
    share = _checked_share("cpu", share)
    pods = _checked_pods("cpu", pods)
    cpu_only = [i for i, p in enumerate(pods) if p.cpu_only]
    rng = random.Random(seed)
    # (C ± k) / (P ± k) = share, solved for k and rounded to the nearest pod.
    change = round((share * len(pods) - len(cpu_only)) / (1 - share))
    if change < 0:
        dropped = set(rng.sample(cpu_only, -change))
        return [p for i, p in enumerate(pods) if i not in dropped]
    if change and not cpu_only:
        raise InvalidRequest("cpu: the pod list has no CPU-only pods to draw from")
    added = [pods[i] for i in rng.choices(cpu_only, k=change)] if change else []
    return [*pods, *_renamed(added, _fresh_names((p.name for p in pods), len(added), len(pods)))]


# -- by name ----------------------------------------------------------------------------


def generate(
    family: str,
    parameter: float,
    pods: Sequence[TracePod],
    nodes: Sequence[TraceNode] | None = None,
    seed: int = 0,
) -> list[TracePod]:
    """The variant of ``family`` (a key of :data:`FAMILIES`) at ``parameter`` (its share);
    ``nodes`` is needed by gpuspec only."""
    if family == "gpushare":
        return gpushare(pods, parameter, seed)
    if family == "multigpu":
        return multigpu(pods, parameter, seed)
    if family == "gpuspec":
        if nodes is None:
            raise InvalidRequest("gpuspec: pinning needs the trace's node list (nodes)")
        return gpuspec(pods, nodes, parameter, seed)
    if family == "cpu":
        return cpu_heavy(pods, parameter, seed)
    raise InvalidRequest(f"unknown pod-list family {family!r}: the families are {', '.join(FAMILIES)}")


def variant(label: str) -> tuple[str, float]:
    """The family and share of a label of :data:`FAMILIES` (``gpushare40`` -> gpushare, 0.4)."""
    for family, variants in FAMILIES.items():
        for name, share in variants:
            if name == label:
                return family, share
    labels = ", ".join(name for variants in FAMILIES.values() for name, _ in variants)
    raise InvalidRequest(f"unknown pod-list variant {label!r}: the variants are {labels}")


# -- writing ----------------------------------------------------------------------------


def _cell(value: int | None) -> str:
    return "" if value is None else str(value)


def write_pods(pods: Iterable[TracePod], path: str | os.PathLike[str]) -> None:
    """Write a pod list in the trace's format (the columns of ``openb_pod_list_default.csv``,
    ``gpu_spec`` as ``|``-separated model codes, empty times for none)."""
    try:
        with open(path, "w", newline="") as handle:
            writer = csv.writer(handle, lineterminator="\n")
            writer.writerow(POD_COLUMNS)
            for pod in pods:
                writer.writerow(
                    (
                        pod.name,
                        pod.cpu_milli,
                        pod.memory_mib,
                        pod.num_gpu,
                        pod.gpu_milli,
                        "|".join(pod.gpu_spec),
                        pod.qos,
                        pod.phase,
                        _cell(pod.creation_time),
                        _cell(pod.deletion_time),
                        _cell(pod.scheduled_time),
                    )
                )
    except OSError as exc:
        raise InvalidRequest(f"cannot write pod list {str(path)!r}: {exc.strerror or exc}") from None
