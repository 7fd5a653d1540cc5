"""Lending nodes between two clusters in the live cycle (the policy's ``lending`` pools).

A pool's nodes are listed by both its clusters (slurmd and a kubelet on one machine). Each
is offered by one of them at a time: the other keeps it fenced (Slurm drained, Kubernetes
cordoned; :class:`broker.core.adapter.NodeFencer`), so no GPU is offered by both, and the
inventory deals the node's GPUs to the offering side only. Once a cycle,
:meth:`NodeLending.step`:

1. settles each node: offered by both (a new pool, or a fence lifted by hand), it is fenced
   on the side that is not its home (the pool's first cluster); fenced on both with no move
   under way, it is offered by its home again;
2. carries the moves under way on (a :class:`broker.core.models.NodeMove` row, written
   before the node is fenced, each step a :class:`broker.core.models.NodeMoveEvent`):
   ``draining``: fenced on the source, until gpush's jobs there have ended (a move whose
   reason went away meanwhile is ``called-off`` and the node offered where it was);
   ``configuring`` (a pool with a ``setup`` for the target, below); ``joining``: unfenced
   on the target, until the target offers the node's GPUs and the source does not: ``done``;
3. plans new moves from the jobs this cycle left waiting for capacity
   (:func:`broker.placement.lending.plan_moves`: the replay's rule, with the pool's
   hysteresis, minimums and maximums). A node a multi-node job keeps is not moved: one
   a gang reservation holds, or one a placed gang runs a rank on
   (:func:`broker.core.gangs.kept_for_gangs`); draining it would stop the whole gang.

A draining node's preemptible jobs (the policy's ``preemption`` section) are preempted for
the move, as for a waiting job; the others run to their end.

A pool's ``setup`` for the target changes the node's sharing on the way: once the node is
empty on the source, ``configuring`` asks the target to set it up (Kubernetes: the GPU
Operator's device plugin config, time-slicing replicas or MPS, and its MIG manager config;
:class:`broker.core.adapter.NodeConfigurer`) while it is still fenced there, and unfences it
when the target says it is done; a target that fails calls the move off and the source offers
the node again. A Slurm target takes the node as its own configuration has it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from broker.core.adapter import (
    AdapterError,
    CapacityUnit,
    ClusterAdapter,
    NodeConfigurer,
    NodeFencer,
    Sharing,
    capability,
)
from broker.core.clock import Clock
from broker.core.gangs import held_on, kept_for_gangs
from broker.core.gpus import gpu_model
from broker.core.models import Job, NodeMove, NodeMoveEvent
from broker.core.states import JobState
from broker.fleet.eviction import preempt_for_fleet
from broker.placement.lending import LendableNode, LendingTerms, called_off, need, plan_moves
from broker.routing.fleet_sections import LendingPool
from broker.routing.rules import Policy

log = logging.getLogger("gpush.lending")
_HOLDING = (JobState.SUBMITTED.value, JobState.RUNNING.value)
FENCE_REASON = "lent to {other} (gpush lending pool)"
# How long a node may take to be set up on the way (the MIG manager takes a minute or more).
SETUP_TIMEOUT = timedelta(minutes=15)


class NodeLending:
    """The policy's lending pools, moved on once a cycle (module docstring)."""

    def __init__(self, sessions: Callable[[], Session], clock: Clock, adapter_of: Callable[[str], ClusterAdapter]):
        self.sessions = sessions
        self.clock = clock
        self.adapter_of = adapter_of
        self.policy: Policy | None = None  # the cycle's: which jobs a draining node may preempt

    def step(self, policy: Policy | None, waiting: Sequence[tuple[object, Sequence]] = ()) -> list[str]:
        """One cycle's lending: settle, carry on, plan (module docstring). ``waiting``: the
        jobs this cycle left waiting for capacity, each ``(candidate with .spec, routes)``."""
        said: list[str] = []
        self.policy = policy
        for pool in policy.lending if policy is not None else ():
            try:
                said += self._pool(pool, waiting)
            except AdapterError as exc:
                said.append(f"lending between {' and '.join(pool.clusters)}: {exc}")
        for line in said:
            log.info("%s", line)
        return said

    def _pool(self, pool: LendingPool, waiting: Sequence[tuple[object, Sequence]]) -> list[str]:
        home, guest = pool.clusters
        adapters = {name: self.adapter_of(name) for name in pool.clusters}
        fencers = {name: capability(adapter, NodeFencer) for name, adapter in adapters.items()}
        missing = [name for name, fencer in fencers.items() if fencer is None]
        if missing:
            return [f"lending: cluster {', '.join(missing)} cannot fence a node, so its nodes are not lent"]
        units = {name: adapter.inventory() for name, adapter in adapters.items()}
        listed = {name: {u.node for u in units[name]} for name in pool.clusters}
        nodes = sorted(n for n in listed[home] & listed[guest] if pool.holds(n))
        if not nodes:
            return []
        fenced = {name: fencers[name].fenced() for name in pool.clusters}
        now = self.clock()
        said: list[str] = []
        with self.sessions() as session, session.begin():
            moves = {m.node: m for m in session.scalars(select(NodeMove).where(NodeMove.ended_at.is_(None)))}
            held = self._held(session, pool.clusters)
            kept = kept_for_gangs(session)  # nodes multi-node jobs keep: none moves
            owner: dict[str, str] = {}
            for node in nodes:
                if node in moves:
                    owner[node] = moves[node].source
                    continue
                on = [name for name in pool.clusters if node not in fenced[name]]
                if len(on) == 2:  # offered by both: its home keeps it
                    fencers[guest].fence(node, FENCE_REASON.format(other=home))
                    said.append(f"{node}: offered by {home} and {guest}: {guest} fences it, {home} keeps it")
                    on = [home]
                elif not on:  # fenced on both with no move: its home offers it again
                    fencers[home].unfence(node)
                    said.append(f"{node}: fenced on both {home} and {guest}: {home} offers it again")
                    on = [home]
                owner[node] = on[0]
            demand = self._waiting(pool, nodes, units, waiting)
            terms = LendingTerms((home, guest), pool.minimum, pool.maximum, pool.hold, pool.threshold, pool.max_moving)
            since = self._since(session, nodes)
            lendable = [
                LendableNode(
                    node,
                    owner[node],
                    _gpus(units[owner[node]], node),
                    busy=held.get((owner[node], node), 0.0),
                    since=(now - since[node]).total_seconds() if node in since else float("inf"),
                    moving_to=moves[node].target if node in moves else None,
                    kept=kept.get((owner[node], node)),
                )
                for node in nodes
            ]
            by_name = {n.name: n for n in lendable}
            for node, move in moves.items():
                if node in by_name:
                    said += self._carry_on(
                        session, move, by_name[node], terms, demand, fencers, units, now, pool, adapters
                    )
            # Times as seconds before now: a node that moved ``age`` seconds ago has since=-age.
            for planned in plan_moves(terms, [_as_age(n) for n in lendable], demand, now=0.0):
                move = NodeMove(
                    node=planned.node,
                    source=planned.source,
                    target=planned.target,
                    step="draining",
                    reason=planned.reason,
                    created_at=now,
                    step_at=now,
                )
                session.add(move)
                session.flush()
                fencers[planned.source].fence(planned.node, FENCE_REASON.format(other=planned.target))
                _event(session, move, now, "draining", f"fenced on {planned.source}: {planned.reason}")
                said.append(f"{planned.node}: lent from {planned.source} to {planned.target}: {planned.reason}")
        return said

    def _carry_on(
        self,
        session: Session,
        move: NodeMove,
        node: LendableNode,
        terms: LendingTerms,
        demand: Mapping[str, float],
        fencers: Mapping[str, NodeFencer],
        units: Mapping[str, list[CapacityUnit]],
        now: datetime,
        pool: LendingPool,
        adapters: Mapping[str, ClusterAdapter],
    ) -> list[str]:
        # What the node takes on the way: the source's setup for leaving it (its MIG manager
        # gives the target's layout back), the target's for joining it (its sharing there).
        steps = _setups(pool, move, adapters)
        if move.step == "draining":
            if called_off(terms, node, demand):
                fencers[move.source].unfence(move.node)
                _end(
                    session, move, now, "called-off", f"{move.target} no longer waits for more: {move.source} keeps it"
                )
                return [f"{move.node}: move to {move.target} called off"]
            if node.busy > 0:
                return self._preempt(session, move, now)
            if steps:
                unable = [name for name, configurer, _ in steps if configurer is None]
                if unable:
                    fencers[move.source].unfence(move.node)
                    why = f"{', '.join(unable)} cannot set a node up as the pool says"
                    _end(session, move, now, "called-off", f"{why}: {move.source} keeps it")
                    return [f"{move.node}: move to {move.target} called off: {why}"]
                for _, configurer, setup in steps:
                    configurer.configure_node(move.node, setup)
                move.step, move.step_at = "configuring", now
                _event(
                    session,
                    move,
                    now,
                    "configuring",
                    f"empty on {move.source}; {_steps_text(steps)}, fenced on both meanwhile",
                )
        if move.step == "configuring":
            states = [
                configurer.node_configured(move.node, setup) if configurer else False for _, configurer, setup in steps
            ]
            late = now - move.step_at > SETUP_TIMEOUT
            if any(state is None for state in states) and not late:
                return []
            if not all(states):
                # The source takes the node back as it set it up for itself (its MIG manager may
                # have begun giving the target's layout back).
                own = pool.setup[move.source].labels() if move.source in pool.setup else {}
                back = capability(adapters[move.source], NodeConfigurer) if own else None
                if back is not None:
                    back.configure_node(move.node, own)
                fencers[move.source].unfence(move.node)
                what = "was not set up in 15 min" if late and None in states else "failed to be set up"
                why = f"the node {what} ({_steps_text(steps)})"
                if False in states:
                    why += "; the cluster says why (for the MIG manager: its Pod's log on the node)"
                _end(session, move, now, "called-off", f"{why}: {move.source} offers it again")
                return [f"{move.node}: move to {move.target} called off: {why}"]
            fencers[move.target].unfence(move.node)
            move.step, move.step_at = "joining", now
            _event(session, move, now, "joining", f"set up as the pool says: unfenced on {move.target}")
        elif move.step == "draining":
            fencers[move.target].unfence(move.node)
            move.step, move.step_at = "joining", now
            _event(session, move, now, "joining", f"empty on {move.source}: unfenced on {move.target}")
        if move.step == "joining":
            offered = _offers(units[move.target], move.node) or not _offers(units[move.source], move.node)
            if offered:
                _end(session, move, now, "done", f"offered by {move.target} only")
                return [f"{move.node}: now offered by {move.target}"]
        return []

    def _preempt(self, session: Session, move: NodeMove, now: datetime) -> list[str]:
        """Preempt the preemptible jobs gpush runs on a draining node (the policy's
        preemption section says which may be); the others run to their end."""
        if self.policy is None:
            return []
        jobs = [
            job
            for job in session.scalars(select(Job).where(Job.cluster == move.source, Job.state.in_(_HOLDING)))
            if job.placement and move.node in held_on(job.placement)
        ]
        why = f"preempted: {move.node} is lent from {move.source} to {move.target}"
        said = []
        for job_id, signal, grace in preempt_for_fleet(session, self.policy, jobs, why=why, kind="lending", now=now):
            told = f"{signal}, {grace} s of grace"
            _event(session, move, now, "draining", f"preempting job {job_id} (preemptible): {told}")
            said.append(f"{move.node}: job {job_id} preempted for the move")
        return said

    @staticmethod
    def _held(session: Session, clusters: Iterable[str]) -> dict[tuple[str, str], float]:
        """GPU-equivalents gpush's placed jobs hold, per (cluster, node): a multi-node
        job's share on each of its nodes."""
        out: dict[tuple[str, str], float] = defaultdict(float)
        rows = session.execute(
            select(Job.cluster, Job.placement, Job.gpu_equivalents).where(
                Job.cluster.in_(list(clusters)), Job.state.in_(_HOLDING), Job.placement.is_not(None)
            )
        )
        for cluster, placement, held in rows:
            nodes = held_on(placement)
            for node in nodes:
                out[(cluster, node)] += (held or 0.0) / len(nodes)
        return out

    @staticmethod
    def _since(session: Session, nodes: Sequence[str]) -> dict[str, datetime]:
        """When each node last finished moving, or last had a move called off (a move whose
        setup failed is not tried again before the pool's ``hold`` is over)."""
        rows = session.execute(
            select(NodeMove.node, func.max(NodeMove.ended_at))
            .where(NodeMove.node.in_(list(nodes)), NodeMove.step.in_(("done", "called-off")))
            .group_by(NodeMove.node)
        )
        return {node: at for node, at in rows if at is not None}

    @staticmethod
    def _waiting(
        pool: LendingPool,
        nodes: Sequence[str],
        units: Mapping[str, list[CapacityUnit]],
        waiting: Sequence[tuple[object, Sequence]],
    ) -> dict[str, float]:
        """Per cluster of the pool, the GPU-equivalents of this cycle's waiting work a pool
        node would serve there, in the sharing it has there."""
        offered: dict[tuple[str, Sharing], tuple] = {}
        for name in pool.clusters:
            for unit in units[name]:
                if unit.node in nodes:
                    model = gpu_model(unit.gpu_model) if unit.gpu_model else None
                    replicas = unit.capacity if unit.sharing is Sharing.K8S_TIMESLICE and unit.gpus else 1
                    if model is not None:
                        offered.setdefault((name, unit.sharing), (model, max(replicas // max(len(unit.gpus), 1), 1)))
        # A cluster that sets the node up on the way (the pool's setup) may serve work in a
        # sharing the node does not have there yet: counted at one job per GPU of the node's model.
        models = {key[0]: how[0] for key, how in offered.items()}
        out: dict[str, float] = defaultdict(float)
        for job, routes in waiting:
            for route in routes:
                how = offered.get((route.cluster, route.sharing))
                if how is None and route.cluster in pool.setup and route.cluster in models:
                    how = (models[route.cluster], 1)
                if how is not None:
                    out[route.cluster] += need(job.spec, route.sharing, *how)
                    break
        return out


def _as_age(node: LendableNode) -> LendableNode:
    """``node`` with ``since`` holding its age (seconds since it last moved; never moved:
    infinite), as ``plan_moves`` reads it against a ``now`` of 0."""
    return dataclasses.replace(node, since=-node.since)


def _gpus(units: Iterable[CapacityUnit], node: str) -> int:
    gpus = {g for u in units if u.node == node for g in u.gpus}
    return len(gpus) or max((round(u.capacity * u.gpu_equivalent) for u in units if u.node == node), default=1)


def _offers(units: Iterable[CapacityUnit], node: str) -> bool:
    return any(u.node == node and u.capacity > 0 and not u.labels.get("unavailable") for u in units)


def _setups(
    pool: LendingPool, move: NodeMove, adapters: Mapping[str, ClusterAdapter]
) -> list[tuple[str, NodeConfigurer | None, dict[str, str]]]:
    """(cluster, its configurer, setup) for what ``move``'s node takes on the way."""
    out = []
    leaving = pool.setup[move.source].leaving() if move.source in pool.setup else {}
    joining = pool.setup[move.target].labels() if move.target in pool.setup else {}
    for name, setup in ((move.source, leaving), (move.target, joining)):
        if setup:
            out.append((name, capability(adapters[name], NodeConfigurer), setup))
    return out


def _steps_text(steps: Sequence[tuple[str, object, Mapping[str, str]]]) -> str:
    names = {"device_plugin": "device plugin config", "mig": "MIG config"}
    return "; ".join(
        f"{cluster} sets it up ({', '.join(f'{names[key]} {value}' for key, value in setup.items())})"
        for cluster, _, setup in steps
    )


def _event(session: Session, move: NodeMove, at: datetime, step: str, note: str) -> None:
    session.add(NodeMoveEvent(move_id=move.id, at=at, step=step, note=note))


def _end(session: Session, move: NodeMove, now: datetime, ending: str, note: str) -> None:
    move.step, move.step_at, move.ended_at = ending, now, now
    _event(session, move, now, ending, note)
