"""Step 7 of a scheduling cycle: placed jobs committed in ``submitting``, handed to their
clusters, and the answers recorded, in batches beside the deciding (step 6)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from queue import SimpleQueue
from typing import Any

from broker.core import faults
from broker.core.adapter import AdapterError, ClusterAdapter, Owner, Placement, Rejected, Sharing, submit_batch
from broker.core.clock import Clock
from broker.core.clusters import ClusterInfo
from broker.core.states import JobState, set_states
from broker.scheduling.claim import Candidate
from broker.scheduling.steps import CycleReport, add_counts, unplaced

S = JobState
ACTOR = "scheduler"


class Submission:
    """Step 7 for one cycle's placed jobs, beside step 6 (which goes on deciding).

    Placed jobs go in batches, in the order they were placed, through three stages:
    *write* commits a batch in ``submitting``; *submit* then makes the batch's adapter
    calls, batch after batch in placement order and job after job as before, on one
    thread; *record* writes the answers. Writes and records run two batches at a time,
    each on its own connection. It is the protocol of a single job, a batch at a time:
    no adapter call before its job is committed in ``submitting``, and a crash anywhere
    leaves jobs that step 1 of the next cycle repairs. The stages overlap one another
    and the deciding, so the database's writes run beside the broker's own work.
    """

    BATCH = 500  # the most jobs of one batch
    WRITERS = 2

    def __init__(
        self,
        sessions,
        clock: Clock,
        adapter_of: Callable[[ClusterInfo], ClusterAdapter],
        clusters: dict[str, ClusterInfo],
        *,
        batch: int = BATCH,
    ):
        self.sessions = sessions
        self.clock = clock
        self._adapter = adapter_of
        self.clusters = clusters
        self.size = batch
        self.batch: list[tuple[Candidate, Placement]] = []
        self.submit_report = CycleReport()  # the submit thread's; close() adds it to the cycle's
        self.written: SimpleQueue = SimpleQueue()  # futures of the writes, in placement order
        self.recorded: list[Future] = []
        self.pool: ThreadPoolExecutor | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def add(self, job: Candidate, placement: Placement) -> None:
        self.batch.append((job, placement))
        if len(self.batch) >= self.size:
            self._send()

    def _send(self) -> None:
        if self.pool is None:
            # Writers and recorders: each a batch's transaction on a connection of its own.
            self.pool = ThreadPoolExecutor(2 * self.WRITERS, thread_name_prefix="gpush-write")
            self.thread = threading.Thread(target=self._submit, name="gpush-submit", daemon=True)
            self.thread.start()
        batch, self.batch = self.batch, []
        self.written.put(self.pool.submit(self._in_report, self._write_placed, batch))

    @staticmethod
    def _in_report(work, item) -> tuple[Any, CycleReport]:
        report = CycleReport()
        return work(item, report), report

    def _submit(self) -> None:
        failed = False
        while (future := self.written.get()) is not None:
            try:
                placed, report = future.result()
                self.recorded.append(future)  # its counts are added by close()
                if failed:
                    continue  # a batch failed: the later ones are not handed over (step 1 repairs them)
                answers = self._hand_over(self.clusters, placed, self.submit_report)
            except BaseException as exc:  # raised again in the cycle's thread, by close()
                self.error = self.error or exc
                failed = True
                continue
            self.recorded.append(self.pool.submit(self._in_report, self._record, answers))

    def close(self, report: CycleReport, *, abandon: bool = False) -> None:
        """Send the last batch (unless ``abandon``), wait for every batch sent to pass the
        three stages, add their counts to ``report``, and raise what failed in a stage."""
        if self.batch and not abandon:
            self._send()
        if self.pool is not None:
            self.written.put(None)
            self.thread.join()
            for future in self.recorded:
                try:
                    add_counts(report, future.result()[1])
                except BaseException as exc:
                    self.error = self.error or exc
            self.pool.shutdown()
        add_counts(report, self.submit_report)
        if self.error is not None and not abandon:
            raise self.error

    def _write_placed(self, placed, report: CycleReport) -> list[tuple[Candidate, Placement]]:
        """Commit placed jobs in ``submitting`` (through ``routed``), before any adapter call;
        returns those that moved (a job cancelled meanwhile did not)."""
        with report.timing("write"), self.sessions() as session, session.begin():
            # queued -> routed -> submitting in one write of each row, both events kept.
            moved = set(
                set_states(
                    session,
                    [job.job_id for job, _ in placed],
                    S.QUEUED,
                    S.SUBMITTING,
                    via=[(S.ROUTED, [f"placed on {p.cluster} ({describe(p)})" for _, p in placed])],
                    reasons=[f"submitting to {p.cluster}" for _, p in placed],
                    now=self.clock(),
                    actor=ACTOR,
                    values={
                        "cluster": [p.cluster for _, p in placed],
                        "placement": [p.to_dict() for _, p in placed],
                        "gpu_equivalents": [p.gpu_equivalents for _, p in placed],
                    },
                )
            )
        placed = [(job, p) for job, p in placed if job.job_id in moved]
        report.placed += len(placed)
        return placed

    def _hand_over(self, clusters, placed: Iterable[tuple[Candidate, Placement]], report: CycleReport) -> Answers:
        """The adapter calls of step 7, for jobs already committed in ``submitting``: one
        batch per cluster (broker.core.adapter.submit_batch: ``submit_many`` where the adapter
        declares BatchSubmitter, else one ``submit`` per job)."""
        answers = Answers()
        by_cluster: dict[str, list[tuple[Candidate, Placement]]] = defaultdict(list)
        for job, placement in placed:
            by_cluster[placement.cluster].append((job, placement))
        with report.timing("submit"):
            for cluster, items in by_cluster.items():
                adapter = self._adapter(clusters[cluster])
                results = submit_batch(
                    adapter,
                    [(job.job_id, job.spec, placement, Owner(job.user, job.tenant)) for job, placement in items],
                )
                for (job, placement), result in zip(items, results):
                    if isinstance(result, Rejected):
                        answers.refused.append((job.job_id, placement, str(result)))
                    elif isinstance(result, AdapterError):
                        answers.unanswered.append((job.job_id, placement, str(result)))
                    else:
                        answers.submitted.append((job.job_id, placement, result))
        return answers

    def _record(self, answers: Answers, report: CycleReport) -> None:
        """What the clusters answered: ``submitted`` with the backend id, ``failed`` when
        refused, back to ``queued`` when a cluster did not answer."""
        faults.reach("submitted-before-record")  # a crash test's kill point (broker/core/faults.py)
        submitted, refused, unanswered = answers.submitted, answers.refused, answers.unanswered
        now = self.clock()
        with report.timing("record"), self.sessions() as session, session.begin():

            def move(rows: list[tuple[int, Placement, str]], target: S, reason, values=None) -> int:
                """Move ``rows`` (job id, placement, answer) out of submitting; how many moved."""
                return len(
                    set_states(
                        session,
                        [job_id for job_id, _, _ in rows],
                        S.SUBMITTING,
                        target,
                        reasons=[reason(p, answer) for _, p, answer in rows],
                        now=now,
                        actor=ACTOR,
                        values=values,
                    )
                )

            report.submitted += move(
                submitted,
                S.SUBMITTED,
                lambda p, backend_id: f"submitted to {p.cluster} as {backend_id}",
                {"backend_id": [backend_id for _, _, backend_id in submitted]},
            )
            report.failed += move(refused, S.FAILED, lambda p, error: f"{p.cluster} refused the job: {error}")
            move(
                unanswered,
                S.QUEUED,
                lambda p, error: f"{p.cluster} did not answer ({error}): queued again",
                unplaced(len(unanswered)),
            )


@dataclass
class Answers:
    """What clusters said to the jobs handed to them: (job id, placement, backend id or error)."""

    submitted: list[tuple[int, Placement, str]] = field(default_factory=list)
    refused: list[tuple[int, Placement, str]] = field(default_factory=list)
    unanswered: list[tuple[int, Placement, str]] = field(default_factory=list)


def describe(placement: Placement) -> str:
    """A placement in a user's words: "slurm/mig: 1× MIG 1g.5gb on mig-01";
    a multi-node job names every node: "slurm/exclusive: 8 whole GPUs on each of gpu-01, gpu-02"."""
    sharing = placement.sharing
    if sharing in (Sharing.SLURM_MIG, Sharing.K8S_MIG):
        what = f"{placement.units}× MIG {placement.mig_profile}"
    elif sharing == Sharing.SLURM_MPS:
        what = f"MPS {placement.units}%"
    elif sharing == Sharing.K8S_TIMESLICE:
        limit = f", {placement.gpu_memory_gb:g} GB limit" if placement.gpu_memory_gb else ""
        what = f"{placement.units} time-slice replica(s){limit}"
    else:
        what = f"{placement.units} whole GPU{'s' * (placement.units != 1)}"
    if len(placement.nodes) > 1:
        where = f" on each of {', '.join(placement.nodes)}"
    else:
        where = f" on {placement.node}" if placement.node else ""
    reps = f", {placement.replicas} replicas" if placement.replicas > 1 else ""
    return f"{sharing.value}: {what}{where}{reps}"
