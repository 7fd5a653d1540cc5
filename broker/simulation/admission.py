"""What a simulated cluster accepts: a placement checked against the cluster's pools,
turned into a job, or rejected with a reason that says what to change.

A job is rejected at submission only when the cluster can never run it (a sharing mode,
GPU model, MIG profile or node it does not have, more units than any node holds);
one that only has to wait for room is accepted and queued
(:class:`broker.simulation.cluster.SimulatedCluster`).

- **Durations.** ``labels["sim-duration"]`` in seconds; else half of ``time_limit``;
  else, for an elastic job (a service, as a Deployment runs), until it is cancelled
  (30 days); else 300 s. ``labels["sim-exit"]`` = ``failed`` (exit code 1) or an exit code makes the
  job fail at its end. A ``sim-duration`` longer than the ``time_limit`` is killed at
  the limit, as Slurm and ``activeDeadlineSeconds`` do.
- **GPUs named in a placement.** Under MPS and time-slicing a placement's ``gpus`` (one
  device index per replica, or one for all of them; only with a ``node``) pin each
  replica to its GPU. Whole GPUs are taken as named when they are all free when the job
  starts, else as the node's topology picks them (:mod:`broker.simulation.pools`); MIG
  instances are counted per node, not per device, so ``gpus`` is ignored there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from broker.core.adapter import Placement, Rejected, Sharing
from broker.core.gpus import gpu_model
from broker.core.schemas import JobSpec
from broker.core.spec_values import parse_time_limit
from broker.simulation.fleet import FleetCluster
from broker.simulation.pools import (
    MIG_SHARINGS,
    SHARED_SHARINGS,
    Pool,
    SimJob,
    UnitClass,
    UnitKey,
    describe_request,
    gpu_pins,
)


class Admission:
    """The submission checks of one simulated cluster, against its pools and unit classes."""

    def __init__(
        self,
        name: str,
        layout: FleetCluster,
        node_pools: Mapping[str, list[Pool]],
        classes: Mapping[UnitKey, UnitClass],
    ) -> None:
        self.name = name
        self._layout = layout
        self._node_pools = node_pools
        self._classes = classes
        self._sharings = {key[0] for key in classes}
        self._pinned_candidates: dict[tuple[str, UnitKey], list[Pool]] = {}
        self._where = f"{name} (simulated {layout.flavor} cluster)"

    def admit(self, job_id: int, spec: JobSpec, placement: Placement) -> SimJob:
        """A job for ``placement`` (not yet numbered: the cluster gives it its place in
        line), or Rejected saying why this cluster can never run it."""
        sharing = Sharing(placement.sharing)
        if placement.sharing is not sharing:  # a plain string from a caller that built the placement by hand
            placement = replace(placement, sharing=sharing)
        if sharing not in self._sharings:
            offered = ", ".join(sorted(s.value for s in self._sharings))
            raise Rejected(
                f"{self._where} offers {offered}, not {sharing.value}: route the job to a cluster that has it"
            )
        profile = placement.mig_profile
        if sharing in MIG_SHARINGS and not profile:
            raise Rejected(f"{sharing.value} needs a mig_profile (such as 1g.5gb) in the placement")
        if sharing not in MIG_SHARINGS and profile:
            raise Rejected(f"mig_profile {profile} makes no sense with {sharing.value}: use slurm/mig or k8s/mig")
        model_name = None
        if placement.gpu_model:
            try:
                model_name = gpu_model(placement.gpu_model).name
            except ValueError as exc:
                raise Rejected(str(exc)) from None
        unit_class = self._classes.get((sharing, profile, model_name))
        if unit_class is None:
            raise Rejected(self._missing_units(sharing, profile, model_name))
        if placement.units < 1 or placement.replicas < 1:
            raise Rejected(f"placement asks {placement.units} units × {placement.replicas} replicas: both must be ≥ 1")
        if sharing is Sharing.SLURM_MPS and placement.units > 100:
            raise Rejected(f"an MPS share is a percent of one GPU: {placement.units} is more than 100")

        if placement.gpus and placement.node is None:
            raise Rejected(
                f"placement names GPU {', '.join(map(str, placement.gpus))} but no node: "
                "device indexes are per node, so give the node as well"
            )
        job = SimJob(job_id, 0, placement, unit_class)
        if placement.gang:
            self._gang_pools(job, unit_class, model_name)
        elif placement.node is not None:
            job.pool = self._pinned_pool(job, unit_class, model_name)
        elif not unit_class.could_ever_hold(job):
            asked = describe_request(sharing, profile, unit_class.model_name, job.units, job.replicas)
            raise Rejected(
                f"no node of {self.name} can hold {asked} at once: the largest has "
                f"{unit_class.max_capacity} units of that kind; ask for fewer, or split the job"
            )
        _read_spec(job, spec, placement)
        return job

    def _gang_pools(self, job: SimJob, unit_class: UnitClass, model_name: str | None) -> None:
        """The pool of each node of a multi-node job (rank 0's in ``job.pool``); Rejected
        if a node is named twice or one can never hold its rank."""
        placement = job.placement
        if placement.sharing in SHARED_SHARINGS:
            raise Rejected(
                f"a job on {len(placement.nodes)} nodes needs whole GPUs or MIG slices on each, not "
                f"{placement.sharing.value}, which shares a GPU within one node"
            )
        if len(set(placement.nodes)) != len(placement.nodes):
            raise Rejected(f"placement names a node twice ({', '.join(placement.nodes)}): a gang's nodes are distinct")
        pools = []
        for node in placement.nodes:
            rank = SimJob(job.job_id, 0, replace(placement, node=node, nodes=()), unit_class)
            pools.append(self._pinned_pool(rank, unit_class, model_name))
        job.pool, job.gang = pools[0], tuple(pools[1:])

    def _pinned_pool(self, job: SimJob, unit_class: UnitClass, model_name: str | None) -> Pool:
        """The pool on ``placement.node`` the job runs or waits in; Rejected if it can never run there."""
        node = job.placement.node
        pools = self._node_pools.get(node)
        if pools is None:
            names = [n.name for n in self._layout.nodes]
            shown = ", ".join(names[:8]) + (f" ... ({len(names)} nodes)" if len(names) > 8 else "")
            raise Rejected(f"{self._where} has no node {node}: its nodes are {shown}")
        candidates = self._pinned_candidates.get((node, unit_class.key))
        if candidates is None:
            candidates = [pool for pool in pools if any(c is unit_class for c, _slot in pool.slots)]
            self._pinned_candidates[(node, unit_class.key)] = candidates
        asked = describe_request(job.sharing, job.placement.mig_profile, model_name, job.units, job.replicas)
        if not candidates:
            offers = ", ".join(describe_request(p.sharing, p.profile, p.model.name, 1, 1) for p in pools)
            raise Rejected(f"node {node} of {self.name} has no {asked}: it offers {offers}; pick another node")
        if job.placement.gpus and job.sharing in SHARED_SHARINGS:
            return self._pinned_gpus(job, candidates, asked)
        holding = [pool for pool in candidates if pool.could_ever_hold(job)]
        if not holding:
            raise Rejected(
                f"node {node} of {self.name} can never hold {asked}: "
                f"it has {candidates[0].capacity} units of that kind; ask for fewer, or pick another node"
            )
        return next((pool for pool in holding if pool.fits(job)), holding[0])

    def _pinned_gpus(self, job: SimJob, candidates: list[Pool], asked: str) -> Pool:
        """The pool holding the GPUs ``placement.gpus`` names (a GPU is in one pool), with
        the job pinned to them; Rejected if they are not there or can never hold it."""
        node, gpus = job.placement.node, job.placement.gpus
        pool = next((p for p in candidates if all(g in p.gpus for g in gpus)), None)
        if pool is None:
            offered = ", ".join(str(g) for p in candidates for g in p.gpus)
            raise Rejected(
                f"node {node} of {self.name} has no {asked} on GPU {', '.join(map(str, gpus))}: "
                f"its GPUs for {job.sharing.value} are {offered}; name one of them, or leave gpus out"
            )
        job.pins = gpu_pins(pool, job)
        if not pool.could_ever_hold(job):
            raise Rejected(
                f"GPU {', '.join(map(str, gpus))} of node {node} can never hold {asked}: a GPU there has "
                f"{pool.per_gpu} units of that kind; ask for less, or spread the replicas over GPUs"
            )
        return pool

    def _missing_units(self, sharing: Sharing, profile: str | None, model_name: str | None) -> str:
        offers = sorted(
            {
                f"{key[1]} on {key[2]}" if key[1] else str(key[2])
                for key in self._classes
                if key[0] is sharing and key[2]
            }
        )
        if sharing in MIG_SHARINGS:
            asked = f"MIG slices {profile}" + (f" on {model_name}" if model_name else "")
        else:
            asked = f"{model_name} GPUs"
        return (
            f"{self._where} has no {asked} under {sharing.value}: it offers {', '.join(offers)}; "
            "route the job to one of these, or to another cluster"
        )


# How long a simulated service (an elastic job with no time limit) runs: until cancelled.
SERVICE_DURATION_S = 30 * 86400


def _read_spec(job: SimJob, spec: JobSpec, placement: Placement) -> None:
    """How long ``job`` runs, how it ends, and the GPU memory it asks, from its spec."""
    labels = spec.labels
    limit_s = parse_time_limit(spec.time_limit) if spec.time_limit else None
    job.limit_us = limit_s * 1_000_000 if limit_s else None
    duration = labels.get("sim-duration")
    if duration is not None:
        try:
            seconds = float(duration)
        except ValueError:
            seconds = math.nan
        if not math.isfinite(seconds) or seconds < 0:
            raise Rejected(f"label sim-duration={duration!r} is not a number of seconds: write, say, 600")
        job.duration_us = round(seconds * 1_000_000)
    elif job.limit_us:
        job.duration_us = job.limit_us // 2
    elif spec.elastic is not None:
        job.duration_us = SERVICE_DURATION_S * 1_000_000
    outcome = labels.get("sim-exit")
    if outcome in (None, "succeeded", "0"):
        job.exit_at_end = 0
    elif outcome == "failed":
        job.exit_at_end = 1
    elif outcome.isdigit() and int(outcome) < 256:
        job.exit_at_end = int(outcome)
    else:
        raise Rejected(f"label sim-exit={outcome!r}: use succeeded, failed, or an exit code 0-255")
    job.memory_gb = placement.gpu_memory_gb or spec.gpu_memory_gb or 0.0
    job.tasks = spec.tasks_per_node
