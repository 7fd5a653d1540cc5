"""MIG layouts of a simulated cluster, as Slurm is told of a GPU a node agent re-cut.

This module owns :class:`MigPublishing`: publishing a GPU's new layout (and refusing one
that would take instances from running or waiting jobs), the layout each GPU offers
now, and the instances jobs hold per node (see MIG layouts in the package docstring).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from broker.core.adapter import Rejected
from broker.mig.layouts import MigSlot, layout_problem, place_instances, same_layout
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import ClusterState, laid_out, mig_slot
from broker.simulation.fleet import FleetGpu
from broker.simulation.pools import pools_of


def _placed(gpu: FleetGpu) -> tuple[str, ...]:
    """The instances of a GPU as the fleet file lays it out (profiles only), placed where
    they fit: largest first, lowest start first."""
    return tuple(map(str, place_instances(gpu.model, [MigSlot(profile) for profile in gpu.mig])))


class MigPublishing:
    """The MIG layouts of one simulated cluster's GPUs."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Give GPU ``gpu`` of ``node`` the MIG layout ``instances`` (``"3g.20gb@0"``) at
        once: the node's pools and inventory change, and jobs waiting for the new
        instances start. Rejected when the layout is not one the GPU can hold, the GPU is
        not in MIG mode, or the change would take instances from running or waiting jobs
        (see the package docstring). Publishing the layout the GPU has is no error."""
        with self.store.hold():
            self.engine.answer()
            state = self.state
            fleet_gpu = self._mig_gpu(node, gpu)
            slots = sorted((mig_slot(text) for text in instances), key=lambda s: (s.start, s.profile))
            problem = layout_problem(fleet_gpu.model, slots)
            if problem:
                raise Rejected(f"GPU {gpu} of node {node} cannot hold {', '.join(instances)}: {problem}")
            if same_layout(slots, map(mig_slot, self._published(node, fleet_gpu))):
                self.store.save()
                return
            overrides = dict(state.mig_overrides)
            overrides.pop((node, gpu), None)
            if not same_layout(slots, map(mig_slot, _placed(fleet_gpu))):
                overrides[(node, gpu)] = tuple(map(str, slots))
            problem = self._mig_change_problem(node, overrides)
            if problem:
                raise Rejected(f"cannot change the MIG layout of GPU {gpu} of node {node} now: {problem}")
            # Rebuild the pools with the new layout and put every job back where it was.
            saved = self.store.snapshot()
            state.mig_overrides = overrides
            state.build()
            self.store.restore(saved)
            state.dirty = True
            self.store.save()

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers now: never None, the simulator
        takes a change in at once."""
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            return self._published(node, self._mig_gpu(node, gpu))

    def mig_in_use(self, node: str) -> dict[str, int]:
        """MIG instances of ``node`` that jobs hold now, by profile (the simulator counts
        them per node, not per GPU)."""
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            pools = self.state.node_pools[self.state.fleet_node(node).name]
            return {p.profile: p.capacity - p.free for p in pools if p.profile is not None and p.capacity > p.free}

    def _published(self, node: str, gpu: FleetGpu) -> tuple[str, ...]:
        """The instances ``gpu`` of ``node`` offers now: as published, else as the fleet file has them."""
        published = self.state.mig_overrides.get((node, gpu.index))
        return _placed(gpu) if published is None else published

    def _mig_gpu(self, node: str, gpu: int) -> FleetGpu:
        """GPU ``gpu`` of ``node`` as the fleet file has it, or Rejected unless it is in MIG mode."""
        gpus = self.state.fleet_node(node).gpus
        if not 0 <= gpu < len(gpus):
            raise Rejected(f"node {node} of {self.state.name} has no GPU {gpu}: its GPUs are 0 to {len(gpus) - 1}")
        if gpus[gpu].mode != "mig":
            raise Rejected(
                f"GPU {gpu} of node {node} is not in MIG mode ({gpus[gpu].mode}, {gpus[gpu].model.name}): "
                "only a GPU the fleet file gives a mig layout can change it"
            )
        return gpus[gpu]

    def _mig_change_problem(self, node: str, overrides: Mapping[tuple[str, int], tuple[str, ...]]) -> str | None:
        """What the MIG layouts ``overrides`` would take from jobs on ``node``, or None:
        instances its running jobs hold (counted per pool, as the simulator counts them),
        or the last instances of a kind that jobs wait for."""
        layout = laid_out(self.state.file_layout, overrides)
        new_node = next(n for n in layout.nodes if n.name == node)
        capacity = {(p.sharing, p.profile, p.model.name): p.capacity for p in pools_of(new_node, layout.flavor)}
        for pool in self.state.node_pools[node]:
            if pool.profile is None:
                continue
            left = capacity.get((pool.sharing, pool.profile, pool.model.name), 0)
            held = pool.capacity - pool.free
            if held > left:
                return (
                    f"its running jobs hold {held} {pool.profile} instance(s) there, and the node would have {left}; "
                    "wait for them to end, or keep enough of them"
                )
            if left:
                continue
            if pool.waiting_count:
                return f"{pool.waiting_count} job(s) wait there for {pool.profile}, and the node would have none"
            for unit_class, _slot in pool.slots:
                others = [p for p in unit_class.pools if p.node != node]
                if unit_class.waiting_count and not others:
                    return f"{unit_class.waiting_count} job(s) wait for {pool.profile}, and no node would have any"
        return None
