"""Slurm's answers, read into plain records that do not depend on Slurm's version.

Slurm 22.05 (OpenAPI v0.0.38, ``squeue --json``) and 24.11 (data parser v0.0.40 to
v0.0.42) spell the same facts differently: a job state is ``"RUNNING"`` or
``["RUNNING"]``, a time is ``1733212800`` or ``{"set": true, "number": 1733212800}``,
an exit code an integer or ``{"status": [...], "return_code": {...}}``. Every reader
here accepts both, so the client backends (command line and REST) share one parser
and the adapter never sees Slurm's JSON.

GRES strings are read the same way everywhere: ``gpu:1g.5gb:7,gpu:3g.20gb:2,mps:100``
(what a node has), ``gpu:3g.20gb:1(IDX:7),mps:0`` (what it uses), ``gres:gpu:1g.5gb:1``
or ``gres/gpu:1g.5gb=1`` (what a job asked for per node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

# name:type:count or name:count, an optional "(S:0-1)" or "(IDX:0,2)" after it.
_GRES_ITEM = re.compile(r"^(?P<name>[A-Za-z0-9_]+)(?::(?P<type>[^:(=]+))?[:=](?P<count>\d+)(?P<extra>\(.*\))?\Z")
# A GRES type named like a MIG profile (gpu:1g.5gb).
MIG_TYPE = re.compile(r"^\d+g\.\d+gb\Z")


@dataclass(frozen=True)
class Gres:
    """One generic resource entry: ``gpu`` of type ``1g.5gb``, ``count`` of them."""

    name: str
    type: str | None
    count: int

    def spec(self) -> str:
        return f"{self.name}:{self.type}:{self.count}" if self.type else f"{self.name}:{self.count}"


def parse_gres(text: Any) -> list[Gres]:
    """``gpu:1g.5gb:7,gpu:3g.20gb:2(S:0),mps:100`` -> Gres entries; '' or '(null)' -> []."""
    if not text:
        return []
    if isinstance(text, list):
        text = ",".join(str(t) for t in text)
    out: list[Gres] = []
    for item in _split_outside_parens(str(text)):
        item = item.strip()
        for prefix in ("gres:", "gres/"):
            if item.startswith(prefix):
                item = item[len(prefix) :]
        if not item or item == "(null)":
            continue
        match = _GRES_ITEM.match(item)
        if match is None:
            # "gpu" alone (one, untyped) or "gpu:a100" (one of a type): count 1.
            name, _, gtype = item.partition(":")
            out.append(Gres(name, gtype or None, 1))
            continue
        out.append(Gres(match["name"], match["type"], int(match["count"])))
    return out


def held_indexes(text: Any, name: str, gres_type: str | None) -> set[int] | None:
    """The device indexes GresUsed says are in use for ``name:gres_type``
    (``gpu:h100:3(IDX:0,2-3)`` -> {0, 2, 3}; ``(IDX:N/A)`` -> none); None when it names
    that GRES without indexes, or not at all."""
    if isinstance(text, list):
        text = ",".join(str(t) for t in text)
    for item in _split_outside_parens(str(text or "")):
        match = _GRES_ITEM.match(item.strip())
        if match is None or match["name"] != name or (match["type"] or None) != gres_type:
            continue
        found = re.search(r"IDX:([^)]*)", match["extra"] or "")
        if found is None:
            return None
        held: set[int] = set()
        for part in found[1].split(","):
            low, _, high = part.partition("-")
            if low.isdigit() and (not high or high.isdigit()):
                held.update(range(int(low), int(high or low) + 1))
        return held
    return None


def _split_outside_parens(text: str) -> list[str]:
    """Split on commas that are not inside parentheses (``IDX:0,2`` stays whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def number(value: Any) -> int | None:
    """An integer from ``5`` or ``{"set": true, "infinite": false, "number": 5}``."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# Slurm's 32-bit "no value" and "infinite" (NO_VAL, INFINITE), which some plain-integer
# times carry: sacct of 24.11 and 26.05 gives a job that never started "start": 4294967294.
_NO_TIME = frozenset({0xFFFFFFFE, 0xFFFFFFFF})


def timestamp(value: Any) -> datetime | None:
    seconds = number(value)
    return datetime.fromtimestamp(seconds, UTC) if seconds and seconds not in _NO_TIME else None


def states(value: Any) -> list[str]:
    """``"RUNNING"``, ``["RUNNING", "COMPLETING"]`` or ``"idle+drain"`` -> upper-case words."""
    if value is None:
        return []
    if isinstance(value, list):
        words = [str(v) for v in value]
    else:
        words = re.split(r"[+,\s]+", str(value))
    return [w.upper() for w in words if w]


def exit_code(value: Any) -> int | None:
    """The program's exit code: 22.05 gives an integer, 24.11 ``{"return_code": ...}``;
    a job killed by a signal N reads as 128 + N, as a shell reports it."""
    if isinstance(value, dict):
        signal = number((value.get("signal") or {}).get("id")) if isinstance(value.get("signal"), dict) else None
        if signal:
            return 128 + signal
        return number(value.get("return_code"))
    # 22.05 gives the raw wait status, as ``scontrol``'s ExitCode=3:0 reads it: 768 is
    # "exited 3", 9 is "killed by signal 9".
    status = number(value)
    if status is None:
        return None
    return 128 + (status & 0x7F) if status & 0x7F else status >> 8


# Job states after which nothing more happens to a job.
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
    | {"PREEMPTED", "SPECIAL_EXIT", "REVOKED"}
)
# Job states of a job that waits to start.
PENDING_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
# Slurm's times have a resolution of 1 s: after a restart, changes this close to the
# cursor are reported again rather than missed (a repeat changes nothing).
SLACK = timedelta(seconds=2)


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    name: str
    comment: str
    states: tuple[str, ...]  # JOB_STATE words, the base state first
    reason: str  # state_reason: "Resources", "Priority", "None", ...
    nodes: str
    partition: str
    tres_per_node: tuple[Gres, ...]  # what it asked for per node
    gres_detail: tuple[str, ...]  # what it was given, with device indexes
    exit_code: int | None
    submit_time: datetime | None
    start_time: datetime | None
    end_time: datetime | None
    description: str = ""  # state_description: Slurm's detail of the reason, if any
    restarts: int = 0  # restart_cnt: how often Slurm requeued it (node failure, preemption, scontrol requeue)
    eligible_time: datetime | None = None  # when it may start (a requeued job waits until then)
    # Where its output goes, as Slurm keeps it: 22.05 gives the pattern it was submitted
    # with ("%x-%j.out"), 24.11 the expanded path; relative to ``work_dir`` when relative.
    # An empty ``standard_error``: stderr goes into the stdout file (sbatch's default).
    standard_output: str = ""
    standard_error: str = ""
    work_dir: str = ""
    user: str = ""
    batch_host: str = ""  # the node that runs the batch script (its output file is there)
    account: str = ""  # the Slurm account it is charged to
    qos: str = ""

    @property
    def state(self) -> str:
        return self.states[0] if self.states else "UNKNOWN"

    @property
    def last_change(self) -> datetime | None:
        """When its state last changed, as far as Slurm's times tell. A running job's
        ``end_time`` is when its time limit would end it, not a change: not counted."""
        if self.state in FINAL_STATES:
            times = (self.end_time, self.start_time, self.submit_time)
        elif self.start_time is not None and self.state != "PENDING":
            times = (self.start_time, self.submit_time)
        else:
            times = (self.submit_time,)
        times = tuple(t for t in times if t is not None)
        return max(times) if times else None

    @classmethod
    def of(cls, raw: dict[str, Any]) -> SlurmJob:
        exit_raw = raw.get("exit_code")
        return cls(
            job_id=str(number(raw.get("job_id")) or raw.get("job_id")),
            name=str(raw.get("name") or ""),
            comment=_comment(raw.get("comment")),
            states=tuple(states(raw.get("job_state"))),
            reason=str(raw.get("state_reason") or "None"),
            nodes=str(raw.get("nodes") or ""),
            partition=str(raw.get("partition") or ""),
            # A job that asked --gpus (gpush: one node, adapters.slurm.render) has it per job.
            tres_per_node=tuple(parse_gres(raw.get("tres_per_node") or raw.get("tres_per_job"))),
            gres_detail=tuple(str(g) for g in raw.get("gres_detail") or ()),
            exit_code=exit_code(exit_raw),
            submit_time=timestamp(raw.get("submit_time")),
            start_time=timestamp(raw.get("start_time")),
            end_time=timestamp(raw.get("end_time")),
            description=str(raw.get("state_description") or ""),
            restarts=number(raw.get("restart_cnt")) or 0,
            eligible_time=timestamp(raw.get("eligible_time")),
            standard_output=str(raw.get("standard_output") or ""),
            standard_error=str(raw.get("standard_error") or ""),
            work_dir=str(raw.get("current_working_directory") or ""),
            user=str(raw.get("user_name") or ""),
            batch_host=str(raw.get("batch_host") or ""),
            account=str(raw.get("account") or ""),
            qos=str(raw.get("qos") or ""),
        )


def _comment(value: Any) -> str:
    # 24.11 gives {"job": "...", "administrator": "...", "system": "..."}.
    if isinstance(value, dict):
        return str(value.get("job") or "")
    return str(value or "")


@dataclass(frozen=True)
class SlurmNode:
    name: str
    states: tuple[str, ...]  # IDLE, MIXED, ALLOCATED, DOWN, DRAIN, ...
    gres: tuple[Gres, ...]
    gres_used: tuple[Gres, ...]
    partitions: tuple[str, ...]
    cpus: int
    memory_mb: int
    reason: str = ""
    # NodeAddr: where Slurm reaches the node (a multi-node job's rank 0 is reached there too)
    address: str = ""
    sockets: int = 0
    cores_per_socket: int = 0
    gres_used_text: str = ""  # GresUsed as Slurm spells it, device indexes (IDX) included

    @property
    def unavailable(self) -> str | None:
        """Why nothing new can start on the node now (down, drained, ...), or None."""
        bad = [s for s in self.states if s in _UNAVAILABLE]
        if not bad:
            return None
        why = f": {self.reason}" if self.reason else ""
        return f"node {self.name} is {'+'.join(s.lower() for s in bad)}{why}"

    @classmethod
    def of(cls, raw: dict[str, Any]) -> SlurmNode:
        words = states(raw.get("state")) + states(raw.get("state_flags"))
        return cls(
            name=str(raw.get("name") or raw.get("hostname")),
            states=tuple(dict.fromkeys(words)),
            gres=tuple(parse_gres(raw.get("gres"))),
            gres_used=tuple(parse_gres(raw.get("gres_used"))),
            partitions=tuple(raw.get("partitions") or ()),
            cpus=number(raw.get("cpus")) or 0,
            memory_mb=number(raw.get("real_memory")) or 0,
            reason=str(raw.get("reason") or ""),
            address=str(raw.get("address") or ""),
            sockets=number(raw.get("sockets")) or 0,
            cores_per_socket=number(raw.get("cores")) or 0,
            gres_used_text=str(raw.get("gres_used") or ""),
        )


_UNAVAILABLE = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "FUTURE"})


@dataclass(frozen=True)
class Submission:
    """A job rendered for Slurm: what both backends send, in Slurm's own terms."""

    name: str
    comment: str
    script: str
    gres: str  # "gpu:1g.5gb:1", "mps:25", "gpu:a100:2"
    cpus_per_task: int
    memory_mb: int | None
    time_limit_minutes: int | None
    partition: str | None
    account: str | None
    qos: str | None
    workdir: str
    output: str  # --output: the job's stdout file (Slurm creates no directory for it)
    error: str  # --error: its stderr file
    environment: dict[str, str] = field(default_factory=dict)
    hold: bool = False  # submitted held: it runs only once released
    # The Unix user the job runs as (adapters.slurm.identity); None: the cluster's service
    # identity (the REST user, or the broker's own user for sbatch).
    user: str | None = None
    # A multi-node job (gang): ``nodes`` nodes, ``tasks_per_node`` tasks on each, on exactly
    # the nodes gpush chose (``nodelist``); ``gres``, ``memory_mb`` are per node.
    nodes: int = 1
    tasks_per_node: int = 1
    nodelist: tuple[str, ...] = ()
    # Keep a gang as close as gpush placed it (adapters.slurm.topology): at most this many
    # leaf switches (topology/tree), or its nodes in segments of this many (topology/block).
    switches: int | None = None
    segment: int | None = None
    # Whole GPUs asked for the job (--gpus=<type>:<n>) rather than per node (--gres): Slurm
    # 24.11 and 26.05 pick a node's GPUs by gres.conf Links= only then (measured); one node only.
    gpus_per_job: bool = False

    def sbatch_args(self) -> list[str]:
        """sbatch options as argv (no shell ever sees them); the script goes on stdin."""
        args = [
            "--parsable",
            f"--job-name={self.name}",
            f"--comment={self.comment}",
            *([f"--gres={self.gres}"] if self.gres and not self.gpus_per_job else []),
            *([f"--gpus={self.gres.removeprefix('gpu:')}"] if self.gres and self.gpus_per_job else []),
            f"--cpus-per-task={self.cpus_per_task}",
            f"--chdir={self.workdir}",
            f"--output={self.output}",
            f"--error={self.error}",
            # The job gets the environment sbatch runs with, which the command-line backend
            # reduces to PATH and SLURM_CONF (see CliBackend.submit), and what the script
            # exports; never the broker's own. Not NONE or NIL: both make slurmd load the
            # user's login environment for every job (SLURM_GET_USER_ENV), which costs a
            # login shell per job: 30 trivial jobs took 3.8 s to run instead of 0.6 s here.
            "--export=ALL",
        ]
        if self.hold:
            args.append("--hold")
        if self.nodes > 1 or self.tasks_per_node > 1:
            args += [f"--nodes={self.nodes}", f"--ntasks-per-node={self.tasks_per_node}"]
        if self.nodelist:
            args.append(f"--nodelist={','.join(self.nodelist)}")
        if self.switches:
            args.append(f"--switches={self.switches}")
        if self.segment:
            args.append(f"--segment={self.segment}")
        if self.memory_mb:
            args.append(f"--mem={self.memory_mb}M")
        if self.time_limit_minutes:
            args.append(f"--time={self.time_limit_minutes}")
        for option, value in (("partition", self.partition), ("account", self.account), ("qos", self.qos)):
            if value:
                args.append(f"--{option}={value}")
        return args


@dataclass(frozen=True)
class FinishedRecord:
    """A job that left squeue, from accounting (sacct) or the job completion log."""

    job_id: str
    name: str
    state: str
    exit_code: int | None
    end_time: datetime | None
    nodes: str = ""
    start_time: datetime | None = None  # which run of the job ended (a requeued job starts again)
    # Its output files, where the record tells (sacct from 23.02 on; not the job completion log)
    standard_output: str = ""
    standard_error: str = ""
    work_dir: str = ""
    user: str = ""
    account: str = ""  # the Slurm account it was charged to (accounting; the job completion log)
