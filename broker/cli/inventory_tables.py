"""How the CLI shows the reconciled inventory: its clusters, nodes and GPUs at a
terminal's width, and a drift finding with its severity (`gpush inventory`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from rich.console import RenderableType
from rich.markup import escape
from rich.table import Table

from broker.cli.console import Col, eq_text, fitted_table, fitted_widths, gpu_ranges, table_of


def inventory_clusters_table(inventory: dict[str, Any], *, width: int = 80) -> Table:
    """One row per cluster and sharing mode: GPU-equivalents free/allocated/total, broken;
    VERIFIED counts the physical GPUs a node agent reported."""
    rows = []
    for c in inventory["clusters"]:
        if c.get("error"):
            rows.append([escape(c["name"]), c["kind"], f"[red]does not answer[/]: {escape(c['error'])}"] + [""] * 5)
            continue
        shares = [("all", c["totals"])] + sorted(c.get("by_sharing", {}).items())
        for i, (mode, t) in enumerate(shares):
            rows.append(
                [
                    escape(c["name"]) if i == 0 else "",
                    c["kind"] if i == 0 else "",
                    mode,
                    str(c.get("physical_gpus", "")) if i == 0 else "",
                    eq_text(t["free"]),
                    eq_text(t["allocated"]),
                    eq_text(t["capacity"]),
                    f"[red]{eq_text(t['broken'])}[/]" if t.get("broken") else "-",
                ]
            )
    columns = [
        Col("CLUSTER", min=8, give=2),
        Col("KIND"),
        Col("SHARING", min=10, give=1),
        Col("VERIFIED"),
        Col("FREE"),
        Col("ALLOC"),
        Col("TOTAL"),
        Col("BROKEN"),
    ]
    return fitted_table(columns, rows, width)


def inventory_nodes_table(inventory: dict[str, Any], *, gpus: bool = False, width: int = 80) -> Table:
    """One row per node (and per GPU with ``gpus``): agent, GPUs, how shared, use, findings."""
    rows: list[list[str]] = []
    nodes = [n for c in inventory["clusters"] for n in c["nodes"]] + list(inventory.get("unscheduled", []))
    for n in nodes:
        agent = {"ok": "[green]ok[/]", "stale": "[yellow]stale[/]", "error": "[red]error[/]"}.get(
            n["agent"], f"[dim]{n['agent']}[/]"
        )
        findings = ", ".join(f"{count} {sev}" for sev, count in n.get("findings", {}).items() if count) or "-"
        if n.get("reserved_for"):  # for whom and until when: reservation_notes, below the table
            findings = "[cyan]reserved[/]" + (f"; {findings}" if findings != "-" else "")
        models = sorted({g["model"] or g["product"] for g in n["gpus"] if g["model"] or g["product"]}) or sorted(
            {u["gpu_model"] for u in n["units"]}
        )
        modes = sorted({g["mode"] for g in n["gpus"] if g["mode"] != "-"}) or sorted({u["sharing"] for u in n["units"]})
        rows.append(
            [
                n["cluster"] or "[yellow](none)[/]",
                n["name"],
                agent,
                str(len(n["gpus"])) if n["gpus"] else "?",
                ", ".join(models),
                ", ".join(modes),
                f"{eq_text(n['free_gpu_equivalents'])}/{eq_text(n['capacity_gpu_equivalents'])}",
                findings if n.get("unavailable") is None else f"{findings}; unavailable: {escape(n['unavailable'])}",
            ]
        )
        if not gpus:
            continue
        for g in n["gpus"]:
            slices = ", ".join(
                f"{s['mig_profile'] or s['sharing']} {s['allocated']}/{s['capacity']}"
                + (" BROKEN" if s["broken"] else "")
                for s in g["slices"]
            )
            rows.append(
                [
                    "",
                    "",
                    "",
                    f"{g['index']}" + (f" {g['uuid'][:12]}…" if g.get("uuid") else ""),
                    (g["model"] or g["product"] or "?") + (f" {g['memory_gb']:g} GB" if g.get("memory_gb") else ""),
                    g["mode"],
                    # A broken slice has nothing free, as the node's total says.
                    f"{eq_text(sum(s['free'] * s['gpu_equivalent'] for s in g['slices']))}/"
                    f"{eq_text(g['capacity_gpu_equivalents'])}",
                    (f"[red]{escape(g['error'])}[/] " if g.get("error") else "") + (slices or "-"),
                ]
            )
    # A node's name is never cut (a reader types it in the next command): at 80 columns the
    # others give way down to their least, which leaves room for names of 18 characters.
    columns = [
        Col("CLUSTER", min=7, give=2),
        Col("NODE"),
        Col("AGENT"),
        Col("GPU", min=3, give=3, soft=4),
        Col("MODEL", min=8, give=5, least=6),
        Col("MODE", min=12, give=4, least=8),
        Col("FREE/ALL"),
        Col("FINDINGS", min=12, give=1, soft=16, least=8),  # "reserved" whole
    ]
    return fitted_table(columns, rows, width)


def reservation_notes(inventory: dict[str, Any]) -> list[str]:
    """A line per waiting multi-node job that holds nodes (the node table marks them
    ``reserved``): ``reserved for job 42 until ~11:00: gpu-01, gpu-02 on slurm-a``, the time
    in the terminal's time zone as every time the CLI shows."""
    held: dict[tuple[int, str, str], list[str]] = {}
    for c in inventory["clusters"]:
        for n in c["nodes"]:
            if reserved := n.get("reserved_for"):
                held.setdefault((reserved["job_id"], reserved["start_by"], c["name"]), []).append(n["name"])
    notes = []
    for (job_id, start_by, cluster), nodes in sorted(held.items()):
        until = datetime.fromisoformat(start_by).astimezone()
        notes.append(
            f"[cyan]reserved[/] for job {job_id} until ~{until:%H:%M}: {escape(', '.join(nodes))} on {escape(cluster)}"
            " (only work that ends by then lands there)"
        )
    return notes


_SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}


def finding_text(f: dict[str, Any]) -> str:
    """A drift finding as a short block: severity and where, what, why, the fix."""
    where = "/".join(x for x in (f.get("cluster") or "(no cluster)", f.get("node") or "") if x)
    if f.get("gpu") is not None:
        where += f" GPU {f['gpu']}"
    style = _SEVERITY_STYLE.get(f["severity"], "")
    fix = "\n".join("       " + line if i else line for i, line in enumerate(f["fix"].splitlines()))
    return (
        f"[{style}]{f['severity'].upper()}[/] {escape(where)} [dim]({f['kind']})[/]\n"
        f"  {escape(f['what'])}\n  why: {escape(f['why'])}\n  fix: {escape(fix)}"
    )


# -- topology (gpush inventory --topology) ------------------------------------------------


def _groups_text(groups: list[list[int]]) -> str:
    return " ".join(gpu_ranges(g) for g in groups)


def _islands_text(topology: dict[str, Any] | None) -> str:
    """A node's NVLink islands (``0-1 2-3``), ``none`` when no GPU has a link, ``?`` unknown."""
    if not topology or not any(topology.get(level) for level in ("nvlink", "pcie", "socket")):
        return "[dim]?[/]"
    islands = [g for g in topology.get("nvlink") or [] if len(g) > 1]
    if not topology.get("nvlink"):
        return "[dim]?[/]"
    return _groups_text(islands) if islands else "none"


def _domain_path(node: dict[str, Any]) -> str:
    return "/".join(
        escape(d["domain"]) if d["domain"] is not None else "[yellow](none)[/]" for d in node.get("topology") or []
    )


def _domain_heading(node: dict[str, Any]) -> str:
    """``block b1, rack r3`` (``(none)`` where the node has no domain at a level)."""
    return ", ".join(
        f"{escape(d['level'])} " + (escape(d["domain"]) if d["domain"] is not None else "[yellow](none)[/]")
        for d in node.get("topology") or []
    )


def topology_tables(inventory: dict[str, Any], *, width: int = 80) -> list[RenderableType]:
    """Per cluster, a title (its network levels) and its nodes by network domain: a heading
    line per domain (``block b1, rack r3``; ``(none)`` where a node has none) over its nodes,
    with their NVLink islands, PCIe switches and sockets (device indexes), where they were
    read, and their free GPU-equivalents. One column width for the cluster's tables, so they
    line up; a domain heads its rows rather than filling a column, so long domain names leave
    the islands their width."""
    out: list[RenderableType] = []
    columns = [
        Col("NODE"),  # never cut: a reader types it in the next command
        Col("NVLINK", min=6, give=4, least=4),
        Col("PCIE", min=4, give=5, least=4),
        Col("SOCKETS", min=4, give=5, least=4),
        Col("FROM", min=4, give=6, least=4),
        Col("FREE/ALL"),
    ]
    for c in inventory["clusters"]:
        groups: dict[str, list[list[str]]] = {}
        levels: list[str] = []
        for n in sorted(c["nodes"], key=lambda n: (_domain_path(n), n["name"])):
            levels = levels or [d["level"] for d in n.get("topology") or []]
            topology = n.get("gpu_topology")
            groups.setdefault(_domain_heading(n), []).append(
                [
                    ("  " if n.get("topology") else "") + n["name"],
                    _islands_text(topology),
                    _groups_text(topology["pcie"]) if topology and topology.get("pcie") else "[dim]?[/]",
                    _groups_text(topology["socket"]) if topology and topology.get("socket") else "[dim]?[/]",
                    escape(topology["source"]) if topology and topology.get("source") else "[dim]-[/]",
                    f"{eq_text(n['free_gpu_equivalents'])}/{eq_text(n['capacity_gpu_equivalents'])}",
                ]
            )
        if len(levels) > 1:
            out.append(f"{escape(c['name'])}: network levels {escape(' > '.join(levels))} (widest first)")
        else:
            out.append(
                f"{escape(c['name'])}: " + (f"network level {escape(levels[0])}" if levels else "no network levels")
            )
        widths = fitted_widths(columns, [row for rows in groups.values() for row in rows], width)
        out.append(table_of(columns, widths, [], header=True))
        for heading, rows in groups.items():
            if heading:
                out.append(f"[bold]{heading}[/]")
            out.append(table_of(columns, widths, rows, header=False))
        out.append("")
    return out


def topology_notes(inventory: dict[str, Any]) -> list[str]:
    """Per cluster with network levels: the levels, and per domain of the widest its nodes
    and how many have every GPU free (what a multi-node job asking for one domain needs):
    ``slurm-a block b1: 4 nodes, 3 idle; b2: 4 nodes, 4 idle``."""
    notes = []
    for c in inventory["clusters"]:
        levels = [d["level"] for d in next((n["topology"] for n in c["nodes"] if n.get("topology")), [])]
        if not levels:
            continue
        counts: dict[str, list[int]] = {}
        for n in c["nodes"]:
            domain = next((d["domain"] for d in n.get("topology") or [] if d["level"] == levels[0]), None)
            entry = counts.setdefault(domain if domain is not None else "(none)", [0, 0])
            entry[0] += 1
            idle = n["capacity_gpu_equivalents"] > 0 and n["free_gpu_equivalents"] >= n["capacity_gpu_equivalents"]
            entry[1] += int(idle)
        per = "; ".join(
            f"{escape(d)}: {total} node{'s' * (total != 1)}, {idle} idle" for d, (total, idle) in sorted(counts.items())
        )
        notes.append(f"{escape(c['name'])} {escape(levels[0])} {per}")
    return notes
