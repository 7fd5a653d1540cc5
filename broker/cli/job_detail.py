"""One job in full (``gpush status``): where it runs, what it asked for (its GPUs, a
multi-node job's nodes and ranks, its topology), who and when."""

from __future__ import annotations

from typing import Any

from rich.markup import escape
from rich.table import Table

from broker.cli.console import eq_text, local_time, styled_state, where


def job_detail(job: Any, *, output: str | None = None) -> Table:
    spec = job.spec
    table = Table(box=None, show_header=False, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    rows = [
        ("Job", str(job.id) + (f" ({job.name})" if job.name else "")),
        ("State", styled_state(job.state.value)),
        ("Reason", job.state_reason or "-"),
        ("Cancel requested", local_time(job.cancel_requested_at) if job.cancel_requested_at else "no"),
        ("Where", where(job.placement)),
        ("GPU-equivalents", _held_text(job)),
        ("Output", output or "-"),
        ("Kind", job.kind.value),
        ("Isolation", job.isolation.value),
        ("GPUs", escape(job.gpu_request or "-")),
        *nodes_rows(job.gang),
        *_tasks_rows(job.gang, spec),
        *topology_rows(spec),
        (
            "CPUs / memory",
            f"{spec.get('cpus', 1)} / {spec.get('memory') or 'cluster default'}"
            + (" per node" if job.gang is not None else ""),
        ),
        ("Time limit", spec.get("time_limit") or "cluster default"),
        ("Command", " ".join(_quote(a) for a in spec["command"]) if spec.get("command") else "-"),
        ("Image", spec.get("image") or "-"),
        ("Tenant / user", f"{job.tenant} / {job.user}"),
        ("Priority", str(job.priority)),
        ("Preemptible", _preemptible_text(spec)),
        ("Labels", ", ".join(f"{k}={v}" for k, v in spec.get("labels", {}).items()) or "-"),
        ("Idempotency key", spec.get("idempotency_key") or "-"),
        ("Created", local_time(job.created_at)),
        ("Updated", local_time(job.updated_at)),
    ]
    for key, value in rows:
        table.add_row(key, value)
    return table


def topology_rows(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """How close the job asked its GPUs or nodes to be (``--topology``), when it asked."""
    ask = spec.get("topology")
    if not ask:
        return []
    from broker.core.topology import GPU_LEVEL_WORDS

    level, mode = ask["level"], ask.get("mode", "preferred")
    one = GPU_LEVEL_WORDS.get(level, f"{level} domain")
    many = one + ("es" if one.endswith("h") else "s")
    how = f"waits until one {one} has room" if mode == "required" else f"as few {many} as possible"
    return [("Topology", escape(f"{level}, {mode} ({how})"))]


def nodes_rows(gang: Any) -> list[tuple[str, str]]:
    """A multi-node job's nodes, each with its ranks (rank 0's node is the rendezvous), as
    the API sends them (broker.core.job_shape)."""
    if gang is None:
        return []
    tasks = gang.tasks_per_node
    plural = "s" * (tasks != 1)
    rows = [
        (
            "Nodes",
            f"{len(gang.nodes)}, {tasks} task{plural} (rank{plural}) per node, {gang.ranks} ranks in all",
        )
    ]
    for node in gang.nodes:
        ranks = f"rank {node.first_rank}" if tasks == 1 else f"ranks {node.first_rank}-{node.last_rank}"
        rendezvous = " (rendezvous)" if node.rendezvous else ""
        rows.append((f"  node {node.index}", f"{escape(node.node or '(not placed yet)')}: {ranks}{rendezvous}"))
    return rows


def _tasks_rows(gang: Any, spec: dict) -> list[tuple[str, str]]:
    """A one-node job's tasks when it asked for several (a multi-node job's are in its Nodes row)."""
    tasks = spec.get("tasks_per_node") or 1
    return [("Tasks", f"{tasks} (ranks) on 1 node")] if gang is None and tasks > 1 else []


def _preemptible_text(spec: dict) -> str:
    """What the job said of preemption: yes/no and how it is told, or the policy's default."""
    said = spec.get("preemptible")
    text = "as the policy's defaults say" if said is None else "yes" if said else "no"
    checkpoint = spec.get("checkpoint")
    if checkpoint and said is not False:
        text += f" (told with {checkpoint.get('signal', 'SIGTERM')}, {checkpoint.get('grace', 60)} s to save)"
    return text


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


# A note column narrower than this reads as a few letters a line: the note goes under its row.


def _held_text(job: Any) -> str:
    """What the job holds, the figure tenants, inventory and usage count (one replica's
    share too, for an elastic job)."""
    if job.gpu_equivalents is None or not job.placement:
        return "-"
    replicas = int(job.placement.get("replicas") or 1)
    each = f" ({replicas} replicas × {eq_text(job.gpu_equivalents / replicas)})" if replicas > 1 else ""
    return f"{eq_text(job.gpu_equivalents)} held{each}"
