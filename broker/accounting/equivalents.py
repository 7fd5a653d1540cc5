"""What a job holds, in physical GPU-equivalents: the one definition every figure reads.

A replica holds ``units`` capacity units of its cluster, and one unit is the share of a
physical GPU that the cluster's unit stands for (``CapacityUnit.gpu_equivalent``):

- a whole GPU: 1;
- a MIG slice: its compute slices over the GPU's (3g.20gb of an A100: 3/7);
- an MPS share: its percent (``mps:25``: 0.25);
- a time-slice replica: 1/replicas of its GPU (a T4 split 4 ways: 1/4), whatever memory
  the job asks for: the replica is taken whole, nobody else is placed on it.

A job holds the sum over its replicas (:func:`held`), and a job on several nodes (a
gang, ``Placement.nodes``) the sum over its nodes: N x what one node holds, stored as the
gang's figure (the inventory's occupancy shows 1/N of it on each node). The figure is computed once, when
the job is placed or scaled, and stored on its placement and its row; the ledger (fair
share, quotas), tenants, the queue, a job's status, GPU-hours and the metrics read that
stored figure (:func:`held_by`, :func:`per_replica`), and the inventory counts a
cluster's allocated units with the same unit shares. So, while every job a cluster runs
is gpush's and the broker has seen each start and end, the tenants' sum and the clusters'
allocated sum are the same number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Rows placed before the figure was stored: one unit's share by sharing mode.
_LEGACY_UNIT = {"mig": 1 / 7, "mps": 1 / 100}


def held(replicas: Iterable[tuple[float, float]]) -> float:
    """The GPU-equivalents a job holds: for each replica, ``(units, one unit's share of a GPU)``."""
    return sum(units * share for units, share in replicas)


def held_by(placement: Mapping[str, Any] | None) -> float:
    """What a job placed so holds now (all its replicas); 0 for a job not placed."""
    if not placement:
        return 0.0
    stored = placement.get("gpu_equivalents")
    if stored is not None:
        return float(stored)
    mode = str(placement.get("sharing") or "").rpartition("/")[2]
    units = float(placement.get("units") or 1)
    return units * _LEGACY_UNIT.get(mode, 1.0) * _replicas(placement)


def per_replica(placement: Mapping[str, Any]) -> float:
    """What one replica of a job placed so holds (every replica of a job holds alike)."""
    return held_by(placement) / _replicas(placement)


def _replicas(placement: Mapping[str, Any]) -> int:
    return max(int(placement.get("replicas") or 1), 1)
