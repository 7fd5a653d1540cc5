"""The fleet's own events: each step of a MIG layout change (broker.fleet.mig_changes) and of a
node lent between clusters (broker.fleet.lending), merged in time order.

``gpush events`` with no job shows them (GET /v1/events), as ``kubectl get events`` shows a
cluster's; ``gpush mig changes ID`` and ``gpush lending moves`` show one kind at a time.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from broker.core.models import MigChange, MigChangeEvent, NodeMove, NodeMoveEvent

MAX_EVENTS = 1000


@dataclass(frozen=True)
class FleetEvent:
    at: datetime
    kind: str  # "mig-change" | "node-move"
    id: int  # the change's or the move's
    node: str
    where: str  # "slurm-a GPU 0" for a change, "slurm-a -> k8s-a" for a move
    step: str
    note: str

    cluster: str = ""  # the change's cluster, the move's source
    gpu: int | None = None  # the change's GPU
    target: str | None = None  # the move's target

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["at"] = self.at.isoformat()
        return out


def fleet_events(
    session: Session, *, limit: int = 50, since: datetime | None = None, node: str | None = None
) -> list[FleetEvent]:
    """The newest ``limit`` events (at or after ``since``; of ``node``), oldest first."""
    limit = max(1, min(limit, MAX_EVENTS))
    changes = (
        select(MigChangeEvent, MigChange)
        .join(MigChange, MigChange.id == MigChangeEvent.change_id)
        .order_by(MigChangeEvent.at.desc(), MigChangeEvent.id.desc())
        .limit(limit)
    )
    moves = (
        select(NodeMoveEvent, NodeMove)
        .join(NodeMove, NodeMove.id == NodeMoveEvent.move_id)
        .order_by(NodeMoveEvent.at.desc(), NodeMoveEvent.id.desc())
        .limit(limit)
    )
    if since is not None:
        changes = changes.where(MigChangeEvent.at >= since)
        moves = moves.where(NodeMoveEvent.at >= since)
    if node is not None:
        changes = changes.where(MigChange.node == node)
        moves = moves.where(NodeMove.node == node)
    # (time, kind, event id): events of one cycle share a time, their ids keep their order
    keyed = [
        (
            (e.at, 0, e.id),
            FleetEvent(e.at, "mig-change", c.id, c.node, f"{c.cluster} GPU {c.gpu}", e.step, e.note, c.cluster, c.gpu),
        )
        for e, c in session.execute(changes)
    ] + [
        (
            (e.at, 1, e.id),
            FleetEvent(
                e.at, "node-move", m.id, m.node, f"{m.source} -> {m.target}", e.step, e.note, m.source, None, m.target
            ),
        )
        for e, m in session.execute(moves)
    ]
    keyed.sort(key=lambda pair: pair[0])
    return [event for _, event in keyed[-limit:]]
