"""gpush's jobs handed to Slurm and taken back: submission (one, or a batch on several
threads), cancel, preemption, and finding a job by its gpush id (the guarantees:
"Finding its jobs" and "Speed" in adapters.slurm.adapter's docstring). A submission first
skips the job ids a restarted slurmctld gives out again (adapters.slurm.restarts) and
makes the jobs' log directory (adapters.slurm.logs)."""

from __future__ import annotations

from collections.abc import Sequence

from adapters.slurm.context import SlurmContext
from adapters.slurm.identity import explain_refusal, resolve
from adapters.slurm.logs import JobLogs
from adapters.slurm.records import FINAL_STATES as _FINAL
from adapters.slurm.records import MIG_TYPE
from adapters.slurm.render import render
from adapters.slurm.restarts import RestartRecovery
from adapters.slurm.states import JobStates
from adapters.slurm.topology import gpu_topology
from broker.core.adapter import (
    PREEMPT_SIGNALS,
    AdapterError,
    BackendJob,
    Owner,
    Placement,
    Rejected,
    Sharing,
    submit_each,
)
from broker.core.schemas import JobSpec


class Submissions:
    """One Slurm cluster's gpush jobs as gpush submits, cancels, preempts and finds them."""

    def __init__(self, ctx: SlurmContext, states: JobStates, restarts: RestartRecovery, logs: JobLogs):
        self.ctx = ctx
        self.states = states
        self.restarts = restarts
        self.logs = logs
        self._primed = False

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        self.restarts.skip_reused_ids()
        with self.ctx.lock:
            if not self._primed:
                self._prime()
            known = self.ctx.known.get(job_id)
        if known is not None:
            return known
        s = self.ctx.settings
        identity = resolve(
            owner,
            cluster=self.ctx.name,
            run_as=s.run_as,
            unix_users=s.unix_users,
            same_name_users=s.same_name_users,
            tenant_accounts=s.tenant_accounts,
            tenant_qos=s.tenant_qos,
            tenant_partitions=s.tenant_partitions,
            account=s.account,
            qos=s.qos,
            partition=s.partition,
        )
        submission = render(
            job_id,
            spec,
            placement,
            tag=s.tag,
            gres_type=self._gres_type(placement),
            mps_per_gpu=s.mps_per_gpu,
            gpu_memory_gb=self.ctx.model_memory(placement.gpu_model),
            partition=identity.partition,
            account=identity.account,
            qos=identity.qos,
            workdir=s.workdir,
            log_dir=s.log_dir,
            user=identity.user,
            node_addresses={n.name: n.address for n in self.ctx.nodes()}
            if placement.gang or spec.tasks_per_node > 1
            else None,
            closeness=self.ctx.network().sbatch_closeness(placement.nodes, self.ctx.version_info())
            if placement.gang
            else None,
            gpus_per_job=self._gpus_by_links(placement),
        )
        self.logs.make_log_dir(identity.user)
        try:
            backend_id = self.ctx.client.submit(submission)
        except Rejected as exc:
            raise Rejected(
                explain_refusal(str(exc), identity, cluster=self.ctx.name, service_user=self.ctx.slurm_user())
            ) from None
        with self.ctx.lock:
            self.ctx.known[job_id] = backend_id
            self.ctx.submitted_as[job_id] = (identity.user or self.ctx.slurm_user(), identity.account)
            self.ctx.active.add(job_id)
        return backend_id

    def submit_many(self, items: Sequence[tuple[int, JobSpec, Placement]]) -> list[str | AdapterError]:
        """Submit a batch on several threads; per item the backend id or the AdapterError."""
        if not items:
            return []
        with self.ctx.lock:
            if not self._primed:
                self._prime()
        return submit_each(self, items, threads=self.ctx.settings.submit_threads)

    def _prime(self) -> None:
        """Learn which gpush jobs Slurm already has (after a broker restart)."""
        for job_id, records in self.ctx.tagged(self.ctx.jobs(fresh=True)).items():
            real = self.ctx.real([r for r in records if not (r.state == "FAILED" and r.reason == "BadConstraints")])
            if real is not None:
                self.ctx.known[job_id] = real.job_id
        self._primed = True

    def cancel(self, job_id: int) -> None:
        records = self.ctx.tagged(self.ctx.jobs(fresh=True)).get(job_id, [])
        ids = {r.job_id for r in records if r.state not in _FINAL}
        with self.ctx.lock:
            known = self.ctx.known.get(job_id)
        if known and not records:
            ids.add(known)  # submitted a moment ago, not listed yet
        for backend_id in sorted(ids):
            self.ctx.client.cancel(backend_id)

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """Signal every live Slurm job of gpush job ``job_id`` (its batch script and all its
        processes, as ``scancel --full --signal``); the broker cancels it after the grace."""
        if signal not in PREEMPT_SIGNALS:
            raise Rejected(f"signal {signal!r} is not one a job may be told of a preemption with: {PREEMPT_SIGNALS}")
        records = self.ctx.tagged(self.ctx.jobs(fresh=True)).get(job_id, [])
        for backend_id in sorted({r.job_id for r in records if r.state not in _FINAL}):
            self.ctx.client.signal(backend_id, signal)
        with self.ctx.lock:
            # This run ends: the broker queues the job again, and its next submission must
            # reach Slurm as a new run (the newest run is the one statuses follow).
            self.ctx.known.pop(job_id, None)

    def find(self, job_id: int) -> BackendJob | None:
        records = self.ctx.tagged(self.ctx.jobs(fresh=True)).get(job_id)
        real = self.ctx.real(records) if records else None
        if real is not None and not (real.state == "FAILED" and real.reason == "BadConstraints"):
            return self.states.backend(job_id, real)
        for record in self.ctx.client.finished(None):
            if self.ctx.gpush_id(record) == job_id:
                return self.states.finished(job_id, record)
        return None

    def _gpus_by_links(self, placement: Placement) -> bool:
        """Whether to ask for the job's GPUs with --gpus, so that Slurm 24.11 on picks
        them by the node's Links= (adapters.slurm.render)."""
        if placement.sharing != Sharing.SLURM_EXCLUSIVE or placement.gang or placement.units < 2:
            return False
        layout = self.ctx.gres_layout().get(placement.node or "", [])
        topology = gpu_topology(layout)
        return bool(topology and topology.islands()) and self.ctx.version_info() >= (24, 11)

    def _gres_type(self, placement: Placement) -> str | None:
        """The GRES type to ask for whole GPUs of the placement's model (on its node first)."""
        if placement.sharing != Sharing.SLURM_EXCLUSIVE:
            return None
        nodes = self.ctx.nodes()
        nodes = sorted(nodes, key=lambda n: n.name != placement.node)
        for node in nodes:
            for gres in node.gres:
                if gres.name != "gpu" or not gres.type or MIG_TYPE.match(gres.type):
                    continue
                model = self.ctx.model_of(gres.type)
                if placement.gpu_model is None or (model is not None and model.name == placement.gpu_model):
                    return gres.type
        return None
