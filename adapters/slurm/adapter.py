"""The Slurm adapter: gpush's adapter protocol (broker.core.adapter) over a real Slurm.

It turns placements into typed GRES requests (adapters.slurm.render), follows gpush's
jobs through squeue and, once they have left it, accounting or the job completion log
(adapters.slurm.client), and reads the cluster's GPUs as inventory records. What a
caller may assume beyond the protocol's own guarantees:

- **Finding its jobs** (adapters.slurm.jobs). Every job it submits is tagged ``<tag>-<gpush id>``; after a
  restart, the first submission reads squeue once and so never submits a job that
  Slurm already has. A submission Slurm refused at once leaves a ``FAILED`` record
  with reason ``BadConstraints`` (Slurm keeps one): it is not taken for the job.
- **Only its own jobs** (adapters.slurm.context). A tag is a name anyone may give: a Slurm
  job carrying one is taken for gpush's only if it runs as the Slurm user (and account)
  gpush submitted that job as, and is not newer than the Slurm job gpush recorded for it.
  Another user's job named ``gpush-<id>`` is ignored everywhere (status, find, cancel,
  preemption, output) and said once in the log.
- **Inventory** (:meth:`SlurmAdapter.inventory`, adapters.slurm.capacity), per node:
  MIG instances from GRES types named like MIG profiles (``gpu:1g.5gb:7``), each worth
  its share of the parent GPU (1/7 for 1g.5gb on an A100); MPS as percent of a GPU, in
  use as the running jobs' ``mps`` requests add up (Slurm's ``GresUsed`` does not show
  it); whole GPUs by type, less the GPUs that back MPS. A node that is down or drained
  offers nothing free (its units show as all allocated), so jobs wait rather than
  being held for good. The GPU model of a GRES type comes from the cluster's
  ``gpu_types`` (``a100=A100-SXM4-80GB``), else from the type's name when gpush knows
  it (``a100``, ``h100``), else, for MIG types, from the first model offering the
  profile. Topology (adapters.slurm.topology): each unit's network position (topology/tree
  switches or topology/block blocks, from ``scontrol show topology``), and for whole GPUs
  the node's NVLink islands and sockets (gres.conf ``Links=``/``Cores=``, the ``gres_conf``
  setting) and which are free (``GresUsed``'s ``IDX``); None or empty where not known.
- **Statuses** (:meth:`SlurmAdapter.statuses`, adapters.slurm.status): the cursor is
  Slurm's own time of the last change seen, so clocks of broker and controller need
  not agree. A page holds every pending job (with its reason in the user's terms,
  adapters.slurm.states) and every job whose state changed at or after the cursor;
  jobs that left squeue meanwhile come from accounting or the job completion log, and
  one that no record explains is reported failed with that reason.
- **After slurmctld restarted from an older state** (a crash between two of its saves):
  jobs it lost are reported LOST and run again (adapters.slurm.status); the job ids it
  gives out again are skipped with held placeholders, cancelled once the nodes have
  registered; runs it lists as running though they had ended are cancelled when they are
  gpush's and reported by ``health`` when they are not (both adapters.slurm.restarts).
- **Output** (:meth:`SlurmAdapter.logs`, adapters.slurm.logs): every job writes stdout
  and stderr to ``<log_dir>/<tag>-<gpush id>.out`` and ``.err``
  (adapters.slurm.render.log_paths); the broker creates ``log_dir`` before it submits,
  where it can, since Slurm does not and a job whose output directory is missing on
  its node fails at launch. ``logs`` reads the file Slurm reports for the Slurm job the
  broker recorded (squeue, else accounting, else the path gpush renders) when the broker
  can see it, and otherwise says on which node it is. It reads only a regular file of the
  job's user in the log directory, reached through no symbolic link; anything else is
  refused (``Rejected``), never shown.
- **Speed.** ``submit_many`` submits a batch on several threads (``submit_threads``,
  8 by default): slurmctld serves RPCs in parallel, and one sbatch at a time leaves it
  idle. Reads made within ``cache_seconds`` (1 s) of each other share one squeue or
  sinfo call.

:class:`SlurmAdapter` itself is thin: it declares its capabilities and hands each call to
the part that owns it, each given the cluster's shared state (adapters.slurm.context):
submission (jobs), status pages (status), Slurm states and reasons (states), what a
restarted slurmctld leaves behind (restarts), fencing (nodes), MIG layouts (mig_publish),
output (logs), inventory and health (capacity). Its settings: adapters.slurm.settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from adapters.settings import load_settings
from adapters.slurm.capacity import Capacity
from adapters.slurm.client import SlurmClient, make_client
from adapters.slurm.context import SlurmContext
from adapters.slurm.jobs import Submissions
from adapters.slurm.logs import JobLogs
from adapters.slurm.mig_publish import MigGresPublisher
from adapters.slurm.nodes import NodeFencing
from adapters.slurm.records import SlurmJob
from adapters.slurm.restarts import RestartRecovery
from adapters.slurm.settings import SlurmSettings
from adapters.slurm.states import GresUsage, JobStates
from adapters.slurm.status import StatusTracker
from broker.core.adapter import (
    AdapterError,
    BackendJob,
    BatchSubmitter,
    CapacityUnit,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    StatusPage,
)
from broker.core.clock import Clock, utcnow
from broker.core.gpus import GpuModel
from broker.core.schemas import JobSpec


class SlurmAdapter:
    """gpush's adapter for one Slurm cluster (see the module docstring)."""

    # slurmctld serves submissions on several threads: a cycle's jobs go in one batch.
    capabilities: ClassVar[frozenset[type]] = frozenset(
        {BatchSubmitter, LogReader, MigPublisher, NodeFencer, Preemptor}
    )
    # The node's agent re-cuts the GPU; publishing rewrites Slurm's files (adapters.slurm.mig).
    changes_gpus: ClassVar[bool] = False
    # slurmctld aborts every job on a node that registers another GRES count ("gres/gpu count
    # mismatch", measured on 22.05 and 24.11), so a change waits until the node is empty.
    needs_empty_node: ClassVar[bool] = True

    def __init__(
        self,
        name: str,
        config: dict[str, Any],
        *,
        clock: Clock | None = None,
        client: SlurmClient | None = None,
    ):
        self.settings = load_settings(SlurmSettings, config, cluster=f"Slurm cluster {name}")
        self.name = name
        self.clock = clock or utcnow
        self.client = client or make_client(self.settings.model_dump())
        self.context = SlurmContext(name, self.settings, self.client)
        self.restarts = RestartRecovery(self.context)
        self.states = JobStates(self.context)
        self.job_logs = JobLogs(self.context)
        self.submissions = Submissions(self.context, self.states, self.restarts, self.job_logs)
        self.tracker = StatusTracker(self.context, self.states, self.restarts)
        self.fencing = NodeFencing(self.context)
        self.mig_gres = MigGresPublisher(self.context, self.fencing)
        self.capacity = Capacity(self.context, self.restarts)
        if not self.settings.mig_gres_conf:  # takes no MIG layout from gpush: say so to the broker
            self.capabilities = SlurmAdapter.capabilities - {MigPublisher}

    # -- jobs (adapters.slurm.jobs, adapters.slurm.status) ---------------------------------

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        return self.submissions.submit(job_id, spec, placement, owner)

    def submit_many(self, items: Sequence[tuple[int, JobSpec, Placement]]) -> list[str | AdapterError]:
        return self.submissions.submit_many(items)

    def cancel(self, job_id: int) -> None:
        self.submissions.cancel(job_id)

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        self.submissions.preempt(job_id, signal, grace_seconds)

    def find(self, job_id: int) -> BackendJob | None:
        return self.submissions.find(job_id)

    def statuses(self, cursor: str | None = None) -> StatusPage:
        return self.tracker.statuses(cursor)

    def pending_reason(self, job: SlurmJob, usage: Callable[[], GresUsage | None] | None = None) -> str:
        return self.states.pending_reason(job, usage)

    def logs(
        self,
        job_id: int,
        backend_id: str,
        *,
        stream: str = "stdout",
        replica: int | None = None,
        offset: int = 0,
        tail: int | None = None,
    ) -> JobOutput:
        return self.job_logs.logs(job_id, backend_id, stream=stream, replica=replica, offset=offset, tail=tail)

    # -- the cluster (adapters.slurm.capacity, adapters.slurm.nodes, adapters.slurm.mig_publish)

    def health(self) -> Health:
        return self.capacity.health()

    def inventory(self) -> list[CapacityUnit]:
        return self.capacity.inventory()

    def model_of(self, gres_type: str | None) -> GpuModel | None:
        return self.context.model_of(gres_type)

    def fence(self, node: str, reason: str) -> None:
        self.fencing.fence(node, reason)

    def unfence(self, node: str) -> None:
        self.fencing.unfence(node)

    def fenced(self) -> dict[str, str]:
        return self.fencing.fenced()

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        self.mig_gres.publish_mig(node, gpu, instances, reported)

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        return self.mig_gres.mig_published(node, gpu)
