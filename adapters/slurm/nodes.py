"""Slurm's nodes as gpush fences them: drained with a reason that says it is gpush's
(``gpush: ...``, for a MIG layout change), resumed only when gpush drained them, and
whether a node still holds jobs."""

from __future__ import annotations

from collections.abc import Iterable

from adapters.slurm.context import SlurmContext
from adapters.slurm.records import SlurmNode
from broker.core.adapter import Rejected

# The drain reason of a node gpush fenced (a MIG layout change): only those it resumes.
FENCE_PREFIX = "gpush: "


class NodeFencing:
    """Draining and resuming one Slurm cluster's nodes for gpush (NodeFencer)."""

    def __init__(self, ctx: SlurmContext):
        self.ctx = ctx

    def fence(self, node: str, reason: str) -> None:
        """Drain ``node`` (no new job starts there; running ones go on), with a reason that
        says it is gpush's (``gpush: ...``), so that :meth:`unfence` resumes only what gpush drained."""
        self.ctx.client.drain(node, f"{FENCE_PREFIX}{reason}")
        self.ctx.forget_nodes()

    def unfence(self, node: str) -> None:
        """Resume ``node`` if gpush drained it; a node drained by someone else (its reason is
        not gpush's) stays drained: it is theirs to resume."""
        listed = {n.name: n for n in self.ctx.client.nodes()}
        if node not in listed:
            raise Rejected(f"Slurm has no node {node}")
        if node in self._fenced_in(listed.values()):
            self.ctx.client.resume(node)
            self.ctx.forget_nodes()

    def fenced(self) -> dict[str, str]:
        """The nodes gpush drained, with its reasons."""
        return self._fenced_in(self.ctx.client.nodes())

    @staticmethod
    def _fenced_in(nodes: Iterable[SlurmNode]) -> dict[str, str]:
        return {
            n.name: n.reason.removeprefix(FENCE_PREFIX)
            for n in nodes
            if n.reason.startswith(FENCE_PREFIX) and any(s in ("DRAIN", "DRAINING", "DRAINED") for s in n.states)
        }

    def busy(self, node: str) -> str:
        """Why ``node`` holds jobs now (its states or GRES in use), or '' when it holds none."""
        found = self.ctx.node(node, fresh=True)
        states = [s for s in found.states if s in ("ALLOCATED", "MIXED", "COMPLETING")]
        used = [g.spec() for g in found.gres_used if g.count]
        return ", ".join(s.lower() for s in states) or ", ".join(used)
