"""Fragmentation-aware placement at trace scale: GPU-sharing nodes by the thousand.

This module owns :class:`SharedGpuNodes`: nodes whose GPUs take whole-GPU and
fractional tasks alike (milli-GPU sharing, as in Alibaba's cluster), and placement on
them by FGD's rule (:func:`broker.placement.fgd.choose`, after Weng et al., ATC '23),
best fit or first fit, fast enough to replay a production trace: each node's score for
every task shape is kept, vectorised, and only the node a placement changed is scored
again (FGD's score of a node depends on that node alone). The measure and the rule it
scores by, on plain node records, are :mod:`broker.placement.fgd`; the replays of
broker.simulation (``shared``, ``inflation``) place through this module.

Quantities are integers in milli-GPU, milli-CPU and MiB, as in the Alibaba trace, so
that equal states compare equal and ties are exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from broker.placement.fgd import DECIMALS, MILLI, TOLERANCE_MILLI, NodeState, TaskShape, WorkloadDistribution

PLACEMENTS = ("fgd", "best-fit", "first-fit")
# How strongly work that may run anywhere avoids the GPUs of a model that pinned work
# needs (milli-GPU of fragmentation per milli-GPU taken, at a pressure of 1: pinned work
# alone would fill that model); see SharedGpuNodes.
PINNED_AVOIDANCE = 3.0
# The same for work that fits only some node kinds by its size (GPUs per node, CPU):
# weaker, since such work can still go to several kinds. Both tuned on the generated
# families (broker.simulation.variants), 3 seeds a list: 3.0 for pinned work took gpuspec33
# from 93.7% to 95.4%; 0.3 for size moved the default list +0.15 and gpushare40 +0.2,
# multigpu20 +0.15, cpu250 -0.1 (larger values did worse).
SIZE_AVOIDANCE = 0.3
_UNTRACKED = 1 << 60  # CPU or memory a node does not account: room for any task


@dataclass(frozen=True)
class SharedNode:
    """A node whose GPUs take whole-GPU and fractional tasks alike (GPU sharing by
    milli-GPU, as in Alibaba's cluster). ``cpu_milli``/``memory_mib`` None: not accounted."""

    name: str
    gpus: int
    model: str = ""
    gpu_memory_gb: float | None = None
    cpu_milli: int | None = None
    memory_mib: int | None = None


@dataclass(frozen=True)
class Slot:
    """A task placed on :class:`SharedGpuNodes`: node index, GPU indexes, the shape it took."""

    node: int
    gpus: tuple[int, ...]
    task: TaskShape


@dataclass
class _Classes:
    """The distribution folded for vectorised scoring: per (per-GPU share, GPU count)
    class, the probability of its shapes as a step function of the node's free CPU, for
    each GPU model of the nodes (a shape pinned to other models never lands there)."""

    mu: np.ndarray  # (K,) per-GPU share of each class
    num: np.ndarray  # (K,) GPUs each class needs
    thresholds: np.ndarray  # (L,) sorted CPU requests of the distribution's shapes
    probability: np.ndarray = field(repr=False)  # (M, L+1, K): P[model, level(cpu), k]

    @classmethod
    def of(cls, distribution: WorkloadDistribution, models: Sequence[str] = ("",)) -> _Classes:
        keys = sorted({(s.gpu_milli, s.gpus) for s in distribution.shapes})
        column = {key: k for k, key in enumerate(keys)}
        thresholds = sorted({s.cpu_milli for s in distribution.shapes})
        level = {cpu: i for i, cpu in enumerate(thresholds)}
        probability = np.zeros((len(models), len(thresholds) + 1, len(keys)))
        for shape, weight in distribution:
            for m, model in enumerate(models):
                if shape.allows(model):
                    # A node with at least this shape's CPU free may host it: every level above.
                    probability[m, level[shape.cpu_milli] + 1 :, column[(shape.gpu_milli, shape.gpus)]] += weight
        return cls(
            np.array([mu for mu, _ in keys], dtype=np.float64),
            np.array([num for _, num in keys], dtype=np.int64),
            np.array(thresholds, dtype=np.int64),
            probability,
        )

    def weights_at(self, cpu: np.ndarray | int, model: np.ndarray | int = 0) -> np.ndarray:
        return self.probability[model, np.searchsorted(self.thresholds, cpu, side="right")]


class SharedGpuNodes:
    """GPU-sharing nodes with per-GPU free milli, and placement on them by ``placement``:

    - ``fgd``: :func:`broker.placement.fgd.choose`'s rule (against ``distribution``, with ``tolerance_milli``).
    - ``best-fit``: the node left with the least free GPU, then the lower node index
      (:mod:`broker.placement.capacity`'s rule for whole GPUs).
    - ``first-fit``: the first node where the task fits, the first GPUs with room there.

    **GPU models.** A task pinned to models (``TaskShape.models``) goes only to nodes of
    those models, under every rule. For ``fgd`` the measure knows them too: a shape
    pinned to other models cannot use a node at all, so, as for a shape the node has too
    little CPU for, all the node's free GPU is a fragment to it. And a task that may run
    anywhere pays, on a node of model m, ``pinned_avoidance`` x its demand x m's
    *pressure*: the pinned work still to come for m (m's share of the distribution's GPU
    demand, times the cluster's free GPUs, the demand still to come if the cluster
    fills) over m's free GPUs. Pressure rises as m fills faster than the cluster; above 1,
    m's free GPUs are all spoken for. So work that can go elsewhere leaves a scarce,
    pinned-for model to the work that cannot, and packs there only when it fits nowhere
    better by more than that. (A pressure fixed at the start, from the capacities
    alone, did not help: pinned T4 work still failed while G2 had 300 GPUs free.) Work
    that only some *kinds* of node (model, GPUs, CPU) can hold by its size, such as
    eight-GPU pods that need 120 cores, weighs on those kinds the same way, with
    ``size_avoidance``, for every task that more kinds could hold.

    **CPU-only tasks** (:meth:`place_cpu`) take CPU and memory of a GPU node: ``fgd``
    puts one where it raises fragmentation least (a node whose CPU is then too short
    for a GPU shape loses those GPUs for it), best fit by free CPU among near-equals.

    On the chosen node a fractional task takes the GPU that FGD prefers (best fit on
    ties), a multi-GPU task the fullest GPUs with room. Each node's score for every
    task shape is cached and recomputed only for the node a placement or a release
    changed, so one placement costs one node's scoring plus a pass over one row.
    With a ``distribution``, :meth:`fragmentation_milli` reports the cluster's
    fragmentation whatever the placement rule.
    """

    def __init__(
        self,
        nodes: Sequence[SharedNode],
        *,
        placement: str = "fgd",
        distribution: WorkloadDistribution | None = None,
        shapes: Iterable[TaskShape] = (),
        tolerance_milli: float = TOLERANCE_MILLI,
        pinned_avoidance: float = PINNED_AVOIDANCE,
        size_avoidance: float = SIZE_AVOIDANCE,
    ) -> None:
        if placement not in PLACEMENTS:
            raise ValueError(f"unknown placement {placement!r}: use one of {', '.join(PLACEMENTS)}")
        if placement == "fgd" and distribution is None:
            raise ValueError("fgd placement needs the workload distribution it measures fragmentation against")
        if not nodes:
            raise ValueError("no GPU nodes to place on")
        self.nodes = tuple(nodes)
        self.placement = placement
        self.distribution = distribution
        self.tolerance_milli = tolerance_milli
        self.models = sorted({node.model for node in nodes})
        model_index = {model: m for m, model in enumerate(self.models)}
        self._model = np.array([model_index[node.model] for node in nodes], dtype=np.int64)
        self._classes = _Classes.of(distribution, self.models) if distribution is not None else None
        count, width = len(nodes), max(node.gpus for node in nodes)
        self.free = np.zeros((count, width), dtype=np.int64)  # absent GPUs stay 0: nothing fits there
        for i, node in enumerate(nodes):
            self.free[i, : node.gpus] = MILLI
        self.cpu = np.array([_UNTRACKED if n.cpu_milli is None else n.cpu_milli for n in nodes], dtype=np.int64)
        self.memory = np.array([_UNTRACKED if n.memory_mib is None else n.memory_mib for n in nodes], dtype=np.int64)
        self.capacity_milli = int(self.free.sum())
        self._gpu_capacity = self.free.sum(axis=1)
        self._cpu_capacity = self.cpu.copy()
        self._total_free = self.free.sum(axis=1)
        self._frag = np.zeros(count)
        self._usable_now = np.zeros((count, len(self._classes.mu) if self._classes else 0))
        # Per node: what a task that may run anywhere pays per milli-GPU it takes there.
        self.pinned_avoidance = pinned_avoidance if placement == "fgd" else 0.0
        self._pinned_share = self._pinned_shares() if self.pinned_avoidance else np.zeros(len(self.models))
        # Node kinds (model, GPUs, CPU): which shapes an empty node can hold.
        kinds = sorted({(n.model, n.gpus, -1 if n.cpu_milli is None else n.cpu_milli) for n in nodes})
        kind_index = {kind: k for k, kind in enumerate(kinds)}
        self._kinds = kinds
        self._kind = np.array(
            [kind_index[(n.model, n.gpus, -1 if n.cpu_milli is None else n.cpu_milli)] for n in nodes], dtype=np.int64
        )
        self._feasible_memo: dict[tuple, frozenset[int]] = {}
        self.size_avoidance = size_avoidance if placement == "fgd" else 0.0
        self._restricted = self._restricted_shares() if self.size_avoidance else {}
        self._share_memo: dict[frozenset[int], np.ndarray] = {}
        self._keys: list[tuple[int, int, int]] = []  # scoring shapes: (gpu_milli, gpus, cpu_milli)
        self._key_index: dict[tuple[int, int, int], int] = {}
        self._memo: dict[tuple[bytes, int], tuple[np.ndarray, np.ndarray, float]] = {}
        self._allowed: dict[frozenset[str], np.ndarray] = {}
        self._holdable: dict[tuple[int, int, int, frozenset[str]], bool] = {}  # (GPUs, CPU, memory, models)
        for shape in shapes:
            self._register(shape, rebuild=False)
        self._rebuild()

    # -- what callers read ------------------------------------------------------------

    @property
    def held_milli(self) -> int:
        """Milli-GPU taken by placed tasks."""
        return self.capacity_milli - int(self._total_free.sum())

    def fragmentation_milli(self) -> float:
        """The cluster's fragmentation (sum over nodes) against the distribution, or 0 without one."""
        return float(self._frag.sum())

    def state(self, index: int) -> NodeState:
        node = self.nodes[index]
        return NodeState(
            node.name,
            tuple(int(f) for f in self.free[index, : node.gpus]),
            None if node.cpu_milli is None else int(self.cpu[index]),
            None if node.memory_mib is None else int(self.memory[index]),
        )

    def could_ever_hold(self, task: TaskShape, models: Iterable[str] = ()) -> bool:
        """Whether some node, empty, could run ``task`` (else it would wait forever)."""
        return self._holds_when_empty(task.gpus, task.cpu_milli, task.memory_mib, frozenset(models))

    def could_ever_hold_cpu(self, cpu_milli: int, memory_mib: int = 0) -> bool:
        """Whether some node, empty, has the CPU and memory of a task that takes no GPU."""
        return self._holds_when_empty(0, cpu_milli, memory_mib, frozenset())

    def _holds_when_empty(self, gpus: int, cpu_milli: int, memory_mib: int, allowed: frozenset[str]) -> bool:
        key = (gpus, cpu_milli, memory_mib, allowed)
        known = self._holdable.get(key)
        if known is None:
            known = self._holdable[key] = any(
                node.gpus >= gpus
                and (node.cpu_milli is None or node.cpu_milli >= cpu_milli)
                and (node.memory_mib is None or node.memory_mib >= memory_mib)
                and (not allowed or node.model in allowed)
                for node in self.nodes
            )
        return known

    # -- placing and releasing --------------------------------------------------------

    def place(self, task: TaskShape, models: Iterable[str] = ()) -> Slot | None:
        """Place ``task`` (only on nodes of ``models`` when given), or None if it fits nowhere now."""
        s = self._key_index.get((task.gpu_milli, task.gpus, task.cpu_milli))
        if s is None:
            s = self._register(task, rebuild=True)
        row = self._score[s]
        mask = None
        if task.memory_mib:
            mask = self.memory >= task.memory_mib
        wanted = frozenset(models) | frozenset(task.models)
        if wanted:
            allowed = self._allowed.get(wanted)
            if allowed is None:
                allowed = np.array([node.model in wanted for node in self.nodes])
                self._allowed[wanted] = allowed
            mask = allowed if mask is None else mask & allowed
        if mask is not None:
            row = np.where(mask, row, np.inf)
        if not wanted and self._pinned_share.any():
            row = row + self._avoidance() * task.demand_milli
        if self._restricted:
            row = row + self._size_avoidance(task) * task.demand_milli
        i = int(row.argmin())
        best = row[i]
        if best == np.inf:
            return None
        if self.placement == "fgd":
            near = np.flatnonzero(row <= best + self.tolerance_milli)
            if len(near) > 1:  # best fit among near-equals; argmin keeps the lowest index on ties
                i = int(near[self._total_free[near].argmin()])
        if task.gpus == 1:
            gpus = (int(self._pick[s, i]),)
        elif self.placement == "first-fit":
            gpus = _first_with_room(self.free[i], task)
        else:
            gpus = _fullest_with_room(self.free[i], task)
        slot = Slot(i, gpus, task)
        self._apply(slot, -1)
        return slot

    def release(self, slot: Slot) -> None:
        """Give back what ``slot`` took (the task ended)."""
        self._apply(slot, +1)

    def place_cpu(self, cpu_milli: int, memory_mib: int = 0) -> int | None:
        """Place a task that takes no GPU (CPU and host memory only) by this placement's
        rule; the node's index, or None if no node has the room."""
        fits = (self.cpu >= cpu_milli) & (self.memory >= memory_mib)
        if not fits.any():
            return None
        if self.placement == "first-fit":
            i = int(np.flatnonzero(fits)[0])
        else:
            cpu_left = np.where(fits, self.cpu - cpu_milli, np.iinfo(np.int64).max)
            if self.placement == "fgd" and self._classes is not None:
                classes = self._classes
                # Only a node whose CPU drops below some shape's request changes its measure.
                level_now = np.searchsorted(classes.thresholds, self.cpu, side="right")
                level_after = np.searchsorted(classes.thresholds, self.cpu - cpu_milli, side="right")
                changed = np.flatnonzero(fits & (level_now != level_after))
                increase = np.where(fits, 0.0, np.inf)
                if len(changed):
                    models = self._model[changed]
                    lost = (
                        classes.probability[models, level_now[changed]]
                        - classes.probability[models, level_after[changed]]
                    )
                    increase[changed] = np.round((self._usable_now[changed] * lost).sum(axis=1), DECIMALS)
                near = np.flatnonzero(increase <= increase.min() + self.tolerance_milli)
                # Among near-equals, the node with the least free GPU (CPU beside GPUs
                # that are taken serves only CPU work), then the least CPU left, so that
                # large blocks of CPU stay whole (on the cpu250 list, 25% of the pods CPU
                # only: 94.2% placed against 93.5% taking the most CPU left).
                i = int(near[np.lexsort((cpu_left[near], self._total_free[near]))[0]])
            else:
                # Best fit as FGD's baseline measures it: the node left with the least free
                # CPU and GPU, each as a share of the node's.
                gpu_share = self._total_free / np.maximum(self._gpu_capacity, 1)
                cpu_share = cpu_left / np.maximum(self._cpu_capacity, 1)
                i = int(np.where(fits, gpu_share + cpu_share, np.inf).argmin())
        self.cpu[i] -= cpu_milli
        self.memory[i] -= memory_mib
        self._refresh(i)
        return i

    def release_cpu(self, node: int, cpu_milli: int, memory_mib: int = 0) -> None:
        """Give back what :meth:`place_cpu` took on ``node``."""
        self.cpu[node] += cpu_milli
        self.memory[node] += memory_mib
        self._refresh(node)

    def _pinned_shares(self) -> np.ndarray:
        """Per GPU model (index of ``self.models``): the share of all GPU demand that is
        pinned to it, each pinned shape's demand spread over its models by their GPUs."""
        capacity = self._gpus_by(self._model, len(self.models))
        pinned = np.zeros(len(self.models))
        total = 0.0
        for shape, weight in self.distribution:
            total += weight * shape.demand_milli
            if shape.models:
                allowed = np.array([shape.allows(model) for model in self.models])
                if capacity[allowed].sum():
                    pinned[allowed] += weight * shape.demand_milli * capacity[allowed] / capacity[allowed].sum()
        return pinned / total if total else pinned

    def _avoidance(self) -> np.ndarray:
        """Per node, what a task that may run anywhere pays per milli-GPU it takes there:
        ``pinned_avoidance`` x the *pressure* on the node's model, the pinned work still
        to come for it (its share of the demand that would fill the cluster's free GPUs)
        over its free GPUs. It rises as a model fills faster than the cluster."""
        return self.pinned_avoidance * self._pressure(self._pinned_share, self._model)

    def _feasible(self, task: TaskShape) -> frozenset[int]:
        """The node kinds an empty node of which can hold ``task`` (GPUs, CPU, model)."""
        key = (task.gpus, task.cpu_milli, task.models)
        kinds = self._feasible_memo.get(key)
        if kinds is None:
            kinds = self._feasible_memo[key] = frozenset(
                k
                for k, (model, gpus, cpu) in enumerate(self._kinds)
                if gpus >= task.gpus and (cpu < 0 or cpu >= task.cpu_milli) and task.allows(model)
            )
        return kinds

    def _restricted_shares(self) -> dict[frozenset[int], np.ndarray]:
        """For each set of node kinds that is all some unpinned shapes of the distribution
        fit by their size (nodes with enough GPUs or CPU for them): the share of the
        distribution's GPU demand in those shapes, spread over the kinds by their GPUs.
        Shapes every node kind fits are not in it; pinned ones are _avoidance's."""
        capacity = self._gpus_by(self._kind, len(self._kinds))
        everywhere = frozenset(range(len(self._kinds)))
        total = sum(weight * shape.demand_milli for shape, weight in self.distribution)
        shares: dict[frozenset[int], np.ndarray] = {}
        for shape, weight in self.distribution:
            kinds = self._feasible(shape)
            if shape.models or not kinds or kinds == everywhere or not total:
                continue
            mask = np.zeros(len(self._kinds), dtype=bool)
            mask[list(kinds)] = True
            share = shares.setdefault(kinds, np.zeros(len(self._kinds)))
            share[mask] += weight * shape.demand_milli / total * capacity[mask] / capacity[mask].sum()
        return shares

    def _size_avoidance(self, task: TaskShape) -> np.ndarray:
        """Per node, what ``task`` pays per milli-GPU it takes there: ``size_avoidance`` x
        the *pressure* on the node's kind from the work that fits fewer kinds than the
        task does by its size (more GPUs or CPU than most nodes have): that work's share
        of the demand still to come (the cluster's free GPUs, if it fills) over the kind's
        free GPUs, as :meth:`_avoidance` for pinned work."""
        mine = self._feasible(task)
        share = self._share_memo.get(mine)
        if share is None:
            share = self._share_memo[mine] = sum(
                (spread for kinds, spread in self._restricted.items() if kinds < mine), np.zeros(len(self._kinds))
            )
        if not share.any():
            return np.zeros(len(self.nodes))
        return self.size_avoidance * self._pressure(share, self._kind)

    def _gpus_by(self, group: np.ndarray, groups: int) -> np.ndarray:
        """The GPUs (milli) of the nodes of each group (``group``: each node's group)."""
        return np.bincount(group, weights=[node.gpus * MILLI for node in self.nodes], minlength=groups)

    def _pressure(self, share: np.ndarray, group: np.ndarray) -> np.ndarray:
        """Per node, the pressure on its group (model or kind): the group's ``share`` of the
        demand still to come (the cluster's free GPUs, if it fills) over the group's free GPUs."""
        free = np.bincount(group, weights=self._total_free, minlength=len(share))
        with np.errstate(divide="ignore", invalid="ignore"):
            pressure = np.where(free > 0, share * free.sum() / free, 0.0)
        return pressure[group]

    def _apply(self, slot: Slot, sign: int) -> None:
        i, task = slot.node, slot.task
        for g in slot.gpus:
            self.free[i, g] += sign * task.gpu_milli
        self.cpu[i] += sign * task.cpu_milli
        self.memory[i] += sign * task.memory_mib
        self._total_free[i] += sign * task.demand_milli
        self._refresh(i)

    # -- scoring ----------------------------------------------------------------------

    def _register(self, shape: TaskShape, *, rebuild: bool) -> int:
        key = (shape.gpu_milli, shape.gpus, shape.cpu_milli)
        if key in self._key_index:
            return self._key_index[key]
        self._key_index[key] = len(self._keys)
        self._keys.append(key)
        if rebuild:
            self._rebuild()
        return self._key_index[key]

    def _rebuild(self) -> None:
        keys = np.array(self._keys, dtype=np.int64).reshape(-1, 3)
        self._d, self._k, self._c = keys[:, 0], keys[:, 1], keys[:, 2]
        self._single = np.flatnonzero(self._k == 1)
        self._multi = [int(s) for s in np.flatnonzero(self._k > 1)]
        self._memo.clear()
        count = len(self.nodes)
        self._score = np.full((len(self._keys), count), np.inf)
        self._pick = np.full((len(self._keys), count), -1, dtype=np.int64)
        for i in range(count):
            self._refresh(i)

    def _refresh(self, i: int) -> None:
        cpu, model = int(self.cpu[i]), int(self._model[i])
        key = (self.free[i].tobytes(), cpu, model)
        column = self._memo.get(key)
        if column is None:
            if len(self._memo) > 200_000:  # states seen once rarely come back: keep memory bounded
                self._memo.clear()
            column = self._column(self.free[i].astype(np.float64), cpu, model)
            self._memo[key] = column
        self._score[:, i], self._pick[:, i], self._frag[i], usable = column
        if self._classes is not None:
            self._usable_now[i] = usable

    def _usable(self, v: np.ndarray) -> np.ndarray:
        """Per class: the free milli on GPUs big enough for it, if enough such GPUs."""
        classes = self._classes
        ge = v[:, None] >= classes.mu[None, :]
        usable = (v[:, None] * ge).sum(axis=0)
        return usable * (ge.sum(axis=0) >= classes.num)

    def _column(self, v: np.ndarray, cpu: int, model: int) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
        """One node's score for every task shape, the GPU each would take, the node's
        fragmentation and its usable free milli per class. Scores: fragmentation
        increase (fgd), free milli left (best fit) or 0 (first fit); inf where the shape
        does not fit."""
        d, k, c = self._d, self._k, self._c
        size = len(d)
        score = np.full(size, np.inf)
        pick = np.full(size, -1, dtype=np.int64)
        total = float(v.sum())
        cpu_after = cpu - c
        cpu_ok = cpu_after >= 0
        classes = self._classes
        frag = 0.0
        usable_now = np.zeros(0)
        if classes is not None:
            ge = v[:, None] >= classes.mu[None, :]  # (G, K)
            v_ge = v[:, None] * ge
            usable, count = v_ge.sum(axis=0), ge.sum(axis=0)
            usable_now = usable * (count >= classes.num)
            frag = total - float(usable_now @ classes.weights_at(cpu, model))
        fgd = self.placement == "fgd"
        first = self.placement == "first-fit"

        single = self._single
        if len(single):
            ds = d[single].astype(np.float64)
            after = v[None, :] - ds[:, None]  # (S1, G): each GPU's free after taking the share
            ok = (after >= 0) & cpu_ok[single][:, None]
            if fgd:
                ge_after = after[:, :, None] >= classes.mu  # (S1, G, K)
                usable_after = usable - v_ge[None] + after[:, :, None] * ge_after
                count_after = count - ge[None] + ge_after
                kept = usable_after * (count_after >= classes.num)
                expected = np.einsum("sgk,sk->sg", kept, classes.weights_at(cpu_after[single], model))
                increase = np.round((total - ds[:, None] - expected) - frag, DECIMALS)
                increase = np.where(ok, increase, np.inf)
                best = increase.min(axis=1)
                # Among GPUs with the least increase, the one left fullest (best fit).
                tied = (increase == best[:, None]) & ok
                score[single] = best
                pick[single] = np.where(tied, after, np.inf).argmin(axis=1)
            elif first:
                pick[single] = ok.argmax(axis=1)  # the first GPU with room
                score[single] = np.where(ok.any(axis=1), 0.0, np.inf)
            else:
                left = np.where(ok, after, np.inf)
                pick[single] = left.argmin(axis=1)
                score[single] = np.where(np.isfinite(left.min(axis=1)), total - ds, np.inf)

        for s in self._multi:
            if not cpu_ok[s]:
                continue
            gpus = _fullest_with_room(v, TaskShape(int(d[s]), int(k[s])))
            if len(gpus) < k[s]:
                continue
            if fgd:
                after = v.copy()
                after[list(gpus)] -= d[s]
                expected = float(self._usable(after) @ classes.weights_at(int(cpu_after[s]), model))
                score[s] = round((total - d[s] * k[s] - expected) - frag, DECIMALS)
            elif first:
                score[s] = 0.0
            else:
                score[s] = total - d[s] * k[s]
        return score, pick, frag, usable_now


def _first_with_room(free: np.ndarray, task: TaskShape) -> tuple[int, ...]:
    """The first ``task.gpus`` GPUs with room for its share (fewer when not enough have)."""
    return tuple(int(g) for g in np.flatnonzero(free >= task.gpu_milli)[: task.gpus])


def _fullest_with_room(free: np.ndarray, task: TaskShape) -> tuple[int, ...]:
    """The ``task.gpus`` GPUs with room for its share that are fullest (lowest index
    among equals); fewer when not enough have room."""
    able = sorted((float(f), g) for g, f in enumerate(free) if f >= task.gpu_milli)
    return tuple(sorted(g for _, g in able[: task.gpus]))
