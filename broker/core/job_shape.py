"""A job's shape as users read it: what it asked, in words, and a multi-node job's
nodes with the ranks on each. Computed here once, from the stored spec and placement,
and sent by the API in every job (``JobOut.gpu_request`` and ``JobOut.gang``), which
`gpush list`, `gpush status` and the dashboard show as they are.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class GangNodeOut(BaseModel):
    index: int = Field(description="the node's place in the gang, 0 first (its NODE_RANK)")
    node: str | None = Field(description="the node's name; null until the gang is placed")
    first_rank: int
    last_rank: int
    rendezvous: bool = Field(description="rank 0's node, where the ranks meet (MASTER_ADDR); false until placed")


class GangOut(BaseModel):
    tasks_per_node: int
    ranks: int = Field(description="ranks in all: nodes x tasks per node")
    nodes: list[GangNodeOut] = Field(description="every node of the gang with its ranks, rank 0's first")


def gpu_request(spec: dict[str, Any], placement: dict[str, Any] | None = None) -> str:
    """What a job asked, per replica: "2", "1 × 10GB", "1 × 8GB (1-4 replicas)"; a
    multi-node job's shape, nodes x GPUs per node, with the model once placed: "2x8 A100"."""
    nodes = spec.get("nodes") or 1
    if nodes > 1:
        text = f"{nodes}x{spec.get('gpus', 1)}"
        model = (placement or {}).get("gpu_model")
        if model:
            text += " " + model.split("-", 1)[0]  # A100-SXM4-80GB -> A100
        if spec.get("gpu_memory_gb"):
            text += f" × {spec['gpu_memory_gb']:g}GB"
        return text
    text = str(spec.get("gpus", 1))
    if spec.get("gpu_memory_gb"):
        text += f" × {spec['gpu_memory_gb']:g}GB"
    elastic = spec.get("elastic")
    if elastic:
        text += f" ({elastic['min_replicas']}-{elastic['max_replicas']} replicas)"
    return text


def gang(spec: dict[str, Any], placement: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """(As :class:`GangOut`.) A multi-node job's nodes in order, each with its ranks (numbered node by node,
    ``tasks_per_node`` on each: node k holds ranks k*T to k*T+T-1) and, once placed, its
    name (rank 0's node, the rendezvous, first); None for a one-node job."""
    nodes = spec.get("nodes") or 1
    if nodes == 1:
        return None
    tasks = spec.get("tasks_per_node") or 1
    placed = (placement or {}).get("nodes") or []
    return {
        "tasks_per_node": tasks,
        "ranks": nodes * tasks,
        "nodes": [
            {
                "index": index,
                "node": placed[index] if index < len(placed) else None,
                "first_rank": index * tasks,
                "last_rank": index * tasks + tasks - 1,
                "rendezvous": index == 0 and bool(placed),
            }
            for index in range(nodes)
        ],
    }
