"""The output of a simulated job: the story of its run in virtual time.

This module owns :class:`JobLogs`: a simulated cluster runs no program, so a job's stdout
is where and on what it started and how it ended, and its stderr why it failed.
"""

from __future__ import annotations

from broker.core.adapter import MAX_LOG_CHUNK, BackendState, JobOutput, Rejected
from broker.core.clock import speed_of, wall_time
from broker.core.spec_values import format_duration
from broker.simulation.cluster.engine import EventEngine
from broker.simulation.cluster.persistence import StateFile
from broker.simulation.cluster.state import FINISHED, ClusterState, to_dt
from broker.simulation.pools import SimJob


class JobLogs:
    """The output of one simulated cluster's jobs."""

    def __init__(self, state: ClusterState, engine: EventEngine, store: StateFile) -> None:
        self.state = state
        self.engine = engine
        self.store = store

    def logs(self, job_id: int, stream: str, replica: int | None, offset: int, tail: int | None) -> JobOutput:
        """The simulated job's output: the simulator runs no program, so its output is the
        story of the run in virtual time (where it started, on what, how it ended), what
        a program's own log lines would sit between."""
        name = self.state.name
        with self.store.hold():
            self.engine.answer()
            self.store.save()
            job = self.state.jobs.get(job_id)
            if job is None:
                raise Rejected(f"simulated cluster {name} has no job {job_id}")
            if job.started_us is None:
                raise Rejected(f"job {job_id} has not started on {name} yet: no output")
            ranks = len(job.pools) * job.tasks if job.gang else 0
            if job.gang and replica and replica >= ranks:
                raise Rejected(f"job {job_id} has {ranks} ranks on {name} (0 to {ranks - 1}): no rank {replica}")
            if not job.gang and replica and replica >= job.replicas:
                raise Rejected(f"job {job_id} has {job.replicas} replica(s) on {name}: no replica {replica}")
            text = self._output(job, replica or 0, stream)
        node = job.pools[(replica or 0) // job.tasks].node if job.gang else job.node
        location = f"simulated cluster {name}, node {node} (in memory: the simulator writes no files)"
        if tail is not None:
            lines = text.splitlines(keepends=True)
            return JobOutput(location, "".join(lines[-tail:]) if tail else "", len(text))
        return JobOutput(location, text[offset : offset + MAX_LOG_CHUNK], min(len(text), offset + MAX_LOG_CHUNK))

    def _output(self, job: SimJob, replica: int, stream: str) -> str:
        clock = self.state.clock

        def at(us: int) -> str:
            # On the wall clock, as every other time the CLI shows: a cluster at speed 60
            # would otherwise print times an hour ahead after a minute.
            return wall_time(clock, to_dt(us)).strftime("%Y-%m-%dT%H:%M:%SZ")

        speed = speed_of(clock)
        pace = f"virtual time at {speed:g}x the wall clock" if speed != 1 else "virtual time"

        if stream == "stderr":
            if job.state is BackendState.FAILED and job.reason:
                return f"{at(job.at_us)} {job.reason}\n"
            return ""
        what = job.placement.mig_profile or job.sharing.value.split("/", 1)[-1]
        if job.gang:
            pools = job.pools
            node_rank = replica // job.tasks
            who = f"rank {replica} of {len(pools) * job.tasks} (node rank {node_rank} of {len(pools)})"
            where = f"{pools[node_rank].node}, rendezvous at {pools[0].node}"
        else:
            who, where = f"replica {replica}", job.node
        lines = [
            f"{at(job.started_us)} [simulated] job {job.job_id} {who} started on {where} "
            f"({job.units} x {what}), {self.state.name}: {pace}; the simulator runs no program",
        ]
        # Only lines that stay once written: ``gpush logs -f`` reads on from an offset.
        if job.state in FINISHED:
            ran = (job.at_us - job.started_us) // 1_000_000
            how = job.state.value + (f" (exit {job.exit_code})" if job.exit_code is not None else "")
            why = f": {job.reason}" if job.reason else ""
            took = f" ({format_duration(max(1, round(ran / speed)))} of wall-clock time)" if speed != 1 else ""
            lines.append(f"{at(job.at_us)} [simulated] {how} after {format_duration(ran)}{took}{why}")
        return "".join(line + "\n" for line in lines)
