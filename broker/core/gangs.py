"""Multi-node jobs (gangs) at the adapter boundary: what an adapter that cannot start one
whole yet does with one (issue 34: Slurm and Kubernetes gangs are still to come)."""

from __future__ import annotations

from broker.core.adapter import Placement, Rejected


def refuse_multi_node(placement: Placement) -> None:
    """Rejected for a gang (``placement.nodes``) on an adapter that cannot start one whole
    yet, before anything reaches its cluster: nothing of the job half-starts there."""
    if placement.gang:
        raise Rejected(
            f"multi-node jobs are not supported on this adapter yet (placed on {len(placement.nodes)} nodes of "
            f"{placement.cluster}): route them to a simulated cluster, or submit with nodes 1"
        )
