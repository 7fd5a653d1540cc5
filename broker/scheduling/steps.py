"""What the steps of a scheduling cycle share: the cycle's report, reading jobs by id
in bulk, running work side by side on threads (each with a database connection of its
own), and the values that take a job's placement away."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from broker.core.models import Job
from broker.core.states import JobState

S = JobState
ACTOR = "scheduler"
# Told of each step of a cycle as it ends: its name and wall seconds (see CycleReport.on_phase).
PhaseObserver = Callable[[str, float], None]
# Ids per IN (...) list when reading jobs by id (SQLite binds each one).
IDS_PER_QUERY = 1000


@dataclass
class CycleReport:
    recovered: int = 0
    synced: int = 0
    placed: int = 0
    submitted: int = 0
    held: int = 0
    waiting: int = 0
    failed: int = 0
    preempted: int = 0  # victims told to stop (broker.scheduling.preemption)
    errors: list[str] = field(default_factory=list)
    # Wall seconds each step took (recover, sync, cancel, inventory, claim, decide,
    # write, submit, record), for operators and benchmarks; not the injected clock's
    # time. Steps that run side by side (the claim beside steps 2 to 4, the writing of
    # status changes beside steps 3 to 7, write, submit and record beside decide)
    # overlap, so they add up to more than the cycle.
    seconds: dict[str, float] = field(default_factory=dict)
    # Called as each step timed on the cycle's own thread ends, on that thread, with the
    # step's name and seconds (so the observer's clock read in the call is the step's
    # end): the public timing hook for benchmarks and tracing (Scheduler(on_phase=...)).
    # A step timed twice in a cycle is told twice. Unset, it costs one test per step.
    on_phase: PhaseObserver | None = field(default=None, repr=False, compare=False)

    @contextmanager
    def timing(self, step: str):
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(step, time.perf_counter() - begin)

    def add_time(self, step: str, seconds: float) -> None:
        self.seconds[step] = self.seconds.get(step, 0.0) + seconds
        if self.on_phase is not None:
            self.on_phase(step, seconds)


def add_counts(report: CycleReport, other: CycleReport) -> None:
    report.placed += other.placed
    report.submitted += other.submitted
    report.failed += other.failed
    for step, seconds in other.seconds.items():
        report.seconds[step] = report.seconds.get(step, 0.0) + seconds


def rows_by_id(session, query, ids: list[int]):
    """Rows of ``query`` for the jobs ``ids``, a thousand ids at a time."""
    rows = []
    for start in range(0, len(ids), IDS_PER_QUERY):
        rows += session.execute(query.where(Job.id.in_(ids[start : start + IDS_PER_QUERY]))).all()
    return rows


def side_by_side(work: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``work`` on each item, each on a thread of its own (so on a connection of its own);
    results in order; the first error is raised after all are done."""
    results: list[Any] = [None] * len(items)
    errors: list[BaseException] = []

    def run(n: int) -> None:
        try:
            results[n] = work(items[n])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def unplaced(n: int) -> dict[str, list[None]]:
    """set_states values that take a job's placement away (it goes back to the queue)."""
    return {"cluster": [None] * n, "placement": [None] * n, "gpu_equivalents": [None] * n}
