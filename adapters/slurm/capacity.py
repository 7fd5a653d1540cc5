"""A Slurm cluster's GPUs as gpush's capacity units (the rules: "Inventory" in
adapters.slurm.adapter's docstring), the MPS its running jobs hold, and whether the
cluster answers (``health``)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from adapters.slurm.context import SlurmContext
from adapters.slurm.records import MIG_TYPE, Gres, SlurmJob, SlurmNode, held_indexes
from adapters.slurm.restarts import RestartRecovery, phantom_words
from adapters.slurm.topology import GresGpu, free_indexes, gpu_topology
from broker.core.adapter import AdapterError, CapacityUnit, Health, Sharing
from broker.core.gpus import GpuModel
from broker.core.topology import Position


class Capacity:
    """What one Slurm cluster offers and holds (``inventory``) and its ``health``."""

    def __init__(self, ctx: SlurmContext, restarts: RestartRecovery):
        self.ctx = ctx
        self.restarts = restarts

    def health(self) -> Health:
        try:
            self.ctx.client.ping()
            version = self.ctx.client.version()
            nodes = self.ctx.nodes()
        except AdapterError as exc:
            return Health(False, f"Slurm cluster {self.ctx.name} does not answer: {exc}")
        down = [n.unavailable for n in nodes if n.unavailable]
        gpus = sum(g.count for n in nodes for g in n.gres if g.name == "gpu")
        detail = f"Slurm {version}: {len(nodes)} nodes, {gpus} GPU GRES"
        if down:
            detail += f"; {len(down)} unavailable ({'; '.join(down[:3])})"
        if stale := self.restarts.stale_foreign_runs():
            detail += "; " + phantom_words(stale)
        return Health(True, detail, version)

    def inventory(self) -> list[CapacityUnit]:
        nodes = self.ctx.nodes()
        mps_used = mps_in_use(self.ctx.jobs())
        network = self.ctx.network()
        layout = self.ctx.gres_layout()
        units: list[CapacityUnit] = []
        for node in nodes:
            units.extend(
                self._node_units(
                    node, mps_used.get(node.name, 0), network.position(node.name), layout.get(node.name, [])
                )
            )
        return units

    def _node_units(
        self, node: SlurmNode, mps_used: int, position: Position = (), layout: Sequence[GresGpu] = ()
    ) -> list[CapacityUnit]:
        used = {(g.name, g.type): g.count for g in node.gres_used}
        unavailable = node.unavailable
        labels = {"state": "+".join(s.lower() for s in node.states), "partitions": ",".join(node.partitions)}
        gpus = [g for g in node.gres if g.name == "gpu"]
        mps = [g for g in node.gres if g.name == "mps"]
        whole_types = [g.type for g in gpus if g.type and not MIG_TYPE.match(g.type)]
        units: list[CapacityUnit] = []

        def unit(sharing: Sharing, gres: Gres, model: GpuModel | None, **fields: Any) -> CapacityUnit:
            capacity = fields.pop("capacity")
            allocated = capacity if unavailable else min(fields.pop("allocated"), capacity)
            fields.pop("allocated", None)
            return CapacityUnit(
                cluster=self.ctx.name,
                node=node.name,
                sharing=sharing,
                gpu_model=model.name if model else (gres.type or "unknown"),
                capacity=capacity,
                allocated=allocated,
                gpu_memory_gb=float(model.memory_gb) if model else None,
                labels={**labels, "gres": gres.spec()} | ({"unavailable": unavailable} if unavailable else {}),
                topology=position,
                **fields,
            )

        mps_gpus = 0
        for share in mps:
            mps_gpus = max(1, math.ceil(share.count / self.ctx.settings.mps_per_gpu))
            model = self.ctx.model_of(share.type or (whole_types[0] if whole_types else None))
            per_gpu = self.ctx.settings.mps_per_gpu
            units.append(
                unit(
                    Sharing.SLURM_MPS,
                    share,
                    model,
                    # Capacity in percent of one GPU, as the broker counts MPS shares.
                    capacity=100 * mps_gpus,
                    allocated=math.ceil(mps_used * 100 / per_gpu),
                    unit_memory_gb=(model.memory_gb / 100) if model else 0.0,
                    gpu_equivalent=0.01,
                )
            )
        for gres in gpus:
            model = self.ctx.model_of(gres.type)
            taken = used.get(("gpu", gres.type), 0)
            if gres.type and MIG_TYPE.match(gres.type):
                units.append(
                    unit(
                        Sharing.SLURM_MIG,
                        gres,
                        model,
                        capacity=gres.count,
                        allocated=taken,
                        unit_memory_gb=float(model.profile(gres.type).memory_gb) if model else 0.0,
                        gpu_equivalent=model.gpu_equivalent(gres.type) if model else 1 / 7,
                        mig_profile=gres.type,
                        in_mig_mode=True,
                    )
                )
                continue
            # GPUs that back MPS are not also offered whole (one job would take the GPU
            # from under every MPS client).
            count = gres.count - (mps_gpus if mps else 0)
            if count <= 0:
                continue
            units.append(
                unit(
                    Sharing.SLURM_EXCLUSIVE,
                    gres,
                    model,
                    capacity=count,
                    allocated=taken,
                    unit_memory_gb=float(model.memory_gb) if model else 0.0,
                    gpu_equivalent=1.0,
                    free_gpus=None if mps else _free_gpus(node, gres, gpus, layout),
                    gpu_topology=gpu_topology(layout, node.cores_per_socket),
                )
            )
        return units


def _free_gpus(node: SlurmNode, gres: Gres, gpus: Sequence[Gres], layout: Sequence[GresGpu]) -> tuple[int, ...] | None:
    """Which of the node's GPUs of ``gres``'s type are free: Slurm's indexes of that type
    (gres.conf's, else 0..n-1 when it is the node's one GPU GRES) less those GresUsed holds
    (IDX). None when either is not known."""
    if node.unavailable:
        return ()
    indexes = [g.index for g in layout if g.type == gres.type and not g.mig]
    if not indexes and len(gpus) == 1:
        indexes = list(range(gres.count))
    held = held_indexes(node.gres_used_text, "gpu", gres.type)
    if not indexes or len(indexes) != gres.count or held is None:
        return None
    return free_indexes(held, indexes)


def mps_in_use(jobs: Sequence[SlurmJob]) -> dict[str, int]:
    """MPS units held per node: the running jobs' requests (GresUsed does not tell)."""
    used: dict[str, int] = defaultdict(int)
    for job in jobs:
        if job.state not in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED") or not job.nodes:
            continue
        for gres in job.tres_per_node:
            if gres.name == "mps":
                used[job.nodes] += gres.count
    return used
