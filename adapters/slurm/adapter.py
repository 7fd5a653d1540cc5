"""The Slurm adapter: gpush's adapter protocol (broker.core.adapter) over a real Slurm.

It turns placements into typed GRES requests (adapters.slurm.render), follows gpush's
jobs through squeue and, once they have left it, accounting or the job completion log
(adapters.slurm.client), and reads the cluster's GPUs as inventory records. What a
caller may assume beyond the protocol's own guarantees:

- **Finding its jobs.** Every job it submits is tagged ``<tag>-<gpush id>``; after a
  restart, the first submission reads squeue once and so never submits a job that
  Slurm already has. A submission Slurm refused at once leaves a ``FAILED`` record
  with reason ``BadConstraints`` (Slurm keeps one): it is not taken for the job.
- **Inventory** (:meth:`SlurmAdapter.inventory`), per node: MIG instances from GRES
  types named like MIG profiles (``gpu:1g.5gb:7``), each worth its share of the
  parent GPU (1/7 for 1g.5gb on an A100); MPS as percent of a GPU, in use as the
  running jobs' ``mps`` requests add up (Slurm's ``GresUsed`` does not show it);
  whole GPUs by type, less the GPUs that back MPS. A node that is down or drained
  offers nothing free (its units show as all allocated), so jobs wait rather than
  being held for good. The GPU model of a GRES type comes from the cluster's
  ``gpu_types`` (``a100=A100-SXM4-80GB``), else from the type's name when gpush knows
  it (``a100``, ``h100``), else, for MIG types, from the first model offering the
  profile.
- **Statuses** (:meth:`SlurmAdapter.statuses`): the cursor is Slurm's own time of the
  last change seen, so clocks of broker and controller need not agree. A page holds
  every pending job (with its reason in the user's terms) and every job whose state
  changed at or after the cursor; jobs that left squeue meanwhile come from
  accounting or the job completion log, and one that no record explains is reported
  failed with that reason.
- **After slurmctld restarted from an older state** (a crash between two of its saves):
  jobs it lost are reported LOST and run again (:meth:`SlurmAdapter._vanished`); the job
  ids it gives out again are skipped with held placeholders, cancelled once the nodes
  have registered (:meth:`SlurmAdapter._skip_reused_ids`); runs it lists as running
  though they had ended are cancelled when they are gpush's and reported by ``health``
  when they are not (:meth:`SlurmAdapter._phantoms`).
- **Output** (:meth:`SlurmAdapter.logs`): every job writes stdout and stderr to
  ``<log_dir>/<tag>-<gpush id>.out`` and ``.err`` (adapters.slurm.render.log_paths); the
  broker creates ``log_dir`` before it submits, where it can, since Slurm does not and a
  job whose output directory is missing on its node fails at launch. ``logs`` reads the
  file Slurm reports for the job (squeue, else accounting, else the path gpush renders)
  when the broker can see it, and otherwise says on which node it is.
- **Speed.** ``submit_many`` submits a batch on several threads (``submit_threads``,
  8 by default): slurmctld serves RPCs in parallel, and one sbatch at a time leaves it
  idle. Reads made within ``cache_seconds`` (1 s) of each other share one squeue or
  sinfo call.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import posixpath
import pwd
import re
import shlex
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from adapters.settings import key_value_pairs, load_settings
from adapters.slurm.client import SlurmClient, make_client
from adapters.slurm.identity import explain_refusal, resolve
from adapters.slurm.limits import limit_reason
from adapters.slurm.mig import GresConf, mig_devices, replace_file, with_node_gres
from adapters.slurm.mig import counts as gres_counts
from adapters.slurm.output import Positions, read_from, read_tail
from adapters.slurm.records import FINAL_STATES, FinishedRecord, Gres, SlurmJob, SlurmNode, Submission
from adapters.slurm.render import expand_filename, job_id_of, log_directory, log_paths, render
from broker.core.adapter import (
    MAX_LOG_CHUNK,
    PREEMPT_SIGNALS,
    AdapterError,
    BackendJob,
    BackendState,
    BatchSubmitter,
    CapacityUnit,
    Health,
    JobOutput,
    LogReader,
    MigPublisher,
    Misconfigured,
    NodeFencer,
    Owner,
    Placement,
    Preemptor,
    Rejected,
    Sharing,
    StatusPage,
    Unreachable,
    submit_each,
)
from broker.core.clock import Clock, utcnow
from broker.core.gpus import MODELS, GpuModel, gpu_model
from broker.core.schemas import JobSpec

MIG_TYPE = re.compile(r"^\d+g\.\d+gb\Z")
_FINAL = FINAL_STATES
_PENDING = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
# Slurm's times have a resolution of 1 s: after a restart, changes this close to the
# cursor are reported again rather than missed (a repeat changes nothing).
_SLACK = timedelta(seconds=2)
_log = logging.getLogger(__name__)
# The most job ids skipped after slurmctld lost jobs (about as many as it lost).
_MAX_SKIPPED = 1000
# How long a held placeholder (see _skip_reused_ids) waits for nodes that have not
# registered with the restarted slurmctld before it is cancelled anyway.
_PLACEHOLDER_HOLD = 300.0
# Runs of gpush jobs this process saw end, remembered to know them again (see _phantoms).
_MAX_ENDED_RUNS = 10_000
# What a restarted slurmctld lists such a run as. Not COMPLETING: the end of a run that is
# completing is in the records already, and that run is no phantom.
_UNFINISHED_RUN = frozenset({"RUNNING", "SUSPENDED"})


# The drain reason of a node gpush fenced (a MIG layout change): only those it resumes.
FENCE_PREFIX = "gpush: "


class SlurmSettings(BaseModel):
    """A Slurm cluster's config (``gpush cluster add NAME --kind slurm --config KEY=VALUE``)."""

    model_config = ConfigDict(extra="forbid")

    rest_url: str | None = Field(None, description="slurmrestd, e.g. http://slurm-head:6820 (REST backend)")
    rest_socket: str | None = Field(None, description="slurmrestd's unix socket instead of a URL")
    user: str | None = Field(None, description="the Slurm user jobs are submitted as (REST; default $USER)")
    token_env: str | None = Field(None, description="environment variable holding the JWT (REST)")
    token_file: str | None = Field(None, description="file holding the JWT (REST)")
    token: str | None = Field(None, description="the JWT itself (prefer token_env or token_file)")
    api_version: str | None = Field(None, description="force an OpenAPI version, e.g. v0.0.38")
    slurm_conf: str | None = Field(None, description="SLURM_CONF for the command-line backend")
    bin_dir: str | None = Field(None, description="where sbatch/squeue/... are (command-line backend)")
    jobcomp_file: str | None = Field(None, description="the jobcomp/filetxt log, for jobs that left squeue")
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    # Whose jobs they are (adapters.slurm.identity; README: "Jobs as their users").
    run_as: Literal["service", "owner"] = Field(
        "service",
        description="service: every job as the cluster's user (REST) or the broker's own (CLI); "
        "owner: each job as its gpush user's Unix user",
    )
    unix_users: dict[str, str] = Field(default_factory=dict, description="gpush user -> Unix user (run_as=owner)")
    same_name_users: bool = Field(
        True, description="a gpush user not in unix_users runs as the Unix user of the same name (else refused)"
    )
    tenant_accounts: dict[str, str] = Field(default_factory=dict, description="tenant -> Slurm account (--account)")
    tenant_qos: dict[str, str] = Field(default_factory=dict, description="tenant -> Slurm QOS (--qos)")
    tenant_partitions: dict[str, str] = Field(default_factory=dict, description="tenant -> partition")
    jwt_key_file: str | None = Field(
        None,
        description="the site's jwt_hs256.key: the broker mints each user's token (REST, run_as=owner); "
        "without it the service token of root or SlurmUser names the user (proxy mode)",
    )
    token_lifetime: int = Field(600, ge=60, le=86400, description="seconds a minted token lives")
    switch_user: Literal["runuser", "sudo"] | None = Field(
        None, description="how the CLI backend runs sbatch as a user: runuser (broker as root) or sudo -n"
    )
    command_prefix: str | None = Field(
        None, description="a command the CLI commands run under, e.g. 'chroot /srv/slurm-24.11' (shell words)"
    )
    workdir: str = "/tmp"
    log_dir: str = Field(
        ".",
        description="where jobs write stdout and stderr (<log_dir>/<tag>-<gpush id>.out and .err): "
        "relative to workdir unless absolute, %u (the job's Slurm user) allowed; it must exist on the "
        "nodes, and the broker creates it where it can see it (a shared filesystem). Default: workdir "
        "itself, which exists wherever jobs run",
    )
    tag: str = Field("gpush", pattern=r"^[A-Za-z][A-Za-z0-9_.]{0,31}$")
    gpu_types: dict[str, str] = Field(default_factory=dict, description="GRES type -> GPU model")
    mps_per_gpu: int = Field(100, ge=1, description="gres/mps Count of one GPU in gres.conf")
    submit_threads: int = Field(8, ge=1, le=64)
    backlog_jobs: int = Field(
        0,
        ge=0,
        description="jobs the broker may leave pending in Slurm's queue beyond what fits now "
        "(Slurm starts jobs faster with a queue to choose from; they are committed to this cluster)",
    )
    min_job_age: int = Field(
        300,
        ge=0,
        description="slurm.conf's MinJobAge: a job that leaves squeue sooner after it was seen "
        "unfinished cannot have ended normally, so slurmctld lost it (a crash) and it runs again",
    )
    cache_seconds: float = Field(1.0, ge=0)
    # MIG layouts gpush changes (adapters.slurm.mig): where Slurm reads them, how it re-reads.
    mig_gres_conf: str | None = Field(
        None,
        description="the gres.conf whose lines for a node gpush rewrites when it re-cuts one of the node's "
        "GPUs (from the node agent's report); unset: this cluster takes no MIG layout from gpush",
    )
    mig_slurm_conf: str | None = Field(
        None, description="the slurm.conf whose NodeName line's Gres= gpush sets to match (default: slurm_conf)"
    )
    mig_caps_dir: str = Field(
        "/dev/nvidia-caps", description="where a node's MIG capability devices are ({node}: the node's name)"
    )
    mig_reload: str = Field(
        "scontrol reconfigure",
        description="the command that makes slurmctld and the node's slurmd read the rewritten files "
        "(a program and its arguments, {node}: the node; run without a shell): scontrol reconfigure from "
        "Slurm 23.11; before, a script of the site's that restarts slurmctld and the node's slurmd",
    )

    @field_validator("mig_gres_conf", "mig_slurm_conf")
    @classmethod
    def _a_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} is a file's path; leave it out rather than empty")
        return value

    @field_validator("mig_reload")
    @classmethod
    def _a_command(cls, value: str) -> str:
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"mig_reload {value!r} is not a command line: {exc}") from None
        if not words:
            raise ValueError(
                "mig_reload is a command, e.g. 'scontrol reconfigure' or '/usr/local/sbin/slurm-reload {node}'"
            )
        shell = [w for w in words if w in ("&&", "||", ";", "|", ">", ">>", "<", "&")]
        if shell:
            raise ValueError(
                f"mig_reload runs one program without a shell, so {shell[0]!r} would be an argument: "
                "put the commands in a script and name it, e.g. '/usr/local/sbin/slurm-reload {node}'"
            )
        return value

    @model_validator(mode="after")
    def _mig_files(self) -> SlurmSettings:
        if self.mig_gres_conf and not (self.mig_slurm_conf or self.slurm_conf):
            raise ValueError(
                "mig_gres_conf needs the slurm.conf whose Gres= gpush sets too: give mig_slurm_conf "
                "(or slurm_conf, the command-line backend's)"
            )
        return self

    timeout: float = Field(30.0, gt=0)

    @field_validator("log_dir")
    @classmethod
    def _log_dir(cls, value: str) -> str:
        # Only %u: the broker expands the directory itself to create it, and another
        # pattern (%j, %N) would make one directory per job or per node that nobody creates.
        if not value.strip() or "\\" in value or not value.isprintable() or "%" in value.replace("%u", ""):
            raise ValueError(
                "log_dir is a directory, absolute or relative to workdir, with no pattern but %u "
                "(the job's user), e.g. gpush-logs or /shared/gpush-logs/%u"
            )
        return value

    @field_validator("gpu_types", mode="before")
    @classmethod
    def _pairs(cls, value: Any) -> Any:
        return key_value_pairs(value, "gpu_types", "a100=A100-SXM4-80GB", form="TYPE=MODEL")

    @field_validator("unix_users", "tenant_accounts", "tenant_qos", "tenant_partitions", mode="before")
    @classmethod
    def _maps(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "unix_users":
            return key_value_pairs(value, info.field_name, "alice=asmith", form="USER=UNIXNAME")
        return key_value_pairs(value, info.field_name, "vision=vision", form="TENANT=NAME")

    @field_validator("gpu_types")
    @classmethod
    def _known_models(cls, value: dict[str, str]) -> dict[str, str]:
        return {gres_type: gpu_model(model).name for gres_type, model in value.items()}


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
        self._lock = threading.RLock()
        self._skipping = threading.Lock()  # one pass of _skip_reused_ids at a time
        self._known: dict[int, str] = {}  # gpush id -> Slurm job id, of jobs this process saw
        self._primed = False
        self._active: set[int] = set()  # gpush ids not yet final at the last status read
        self._listing: tuple[float, list[SlurmJob]] | None = None
        self._node_listing: tuple[float, list[SlurmNode]] | None = None
        self._read_finished = False  # the first status read after a start also reads finished jobs
        self._reported: dict[int, tuple[BackendState, str | None]] = {}  # what the last page said
        # gpush id -> (when squeue last listed it unfinished (monotonic), its Slurm job id)
        self._seen: dict[int, tuple[float, str]] = {}
        # After slurmctld lost jobs: the highest job id it may give out again (see _skip_reused_ids)
        self._reused_up_to: int | None = None
        self._log_dirs_refused: set[str] = set()  # log directories the broker could not create (said once)
        self._held_since: dict[str, float] = {}  # placeholder Slurm id -> when first seen held (monotonic)
        # Runs slurmctld lists as unfinished though they ended before it restarted (_phantoms):
        self._check_phantoms = True  # look in the finished records at the next status read
        self._ended_runs: dict[str, datetime] = {}  # Slurm id -> start time, of gpush runs seen ended
        self._cancelled_phantoms: set[str] = set()  # gpush's own, cancelled here: their record is not news
        self._foreign_phantoms: dict[str, SlurmJob] = {}  # other users' or brokers', reported by health
        self._positions = Positions()  # where the offsets ``logs`` handed out lie in their files
        if not self.settings.mig_gres_conf:  # takes no MIG layout from gpush: say so to the broker
            self.capabilities = SlurmAdapter.capabilities - {MigPublisher}

    # -- reads, shared within cache_seconds ---------------------------------------------

    def _jobs(self, fresh: bool = False) -> list[SlurmJob]:
        with self._lock:
            now = time.monotonic()
            if fresh or self._listing is None or now - self._listing[0] > self.settings.cache_seconds:
                self._listing = (now, self.client.jobs())
            return self._listing[1]

    def _nodes(self, fresh: bool = False) -> list[SlurmNode]:
        with self._lock:
            now = time.monotonic()
            if fresh or self._node_listing is None or now - self._node_listing[0] > self.settings.cache_seconds:
                self._node_listing = (now, self.client.nodes())
            return self._node_listing[1]

    def _tagged(self, jobs: Sequence[SlurmJob]) -> dict[int, list[SlurmJob]]:
        """gpush id -> its Slurm jobs, newest last (a refused submission may have left one)."""
        out: dict[int, list[SlurmJob]] = defaultdict(list)
        for job in jobs:
            job_id = job_id_of(self.settings.tag, job.name, job.comment)
            if job_id is not None:
                out[job_id].append(job)
        for records in out.values():
            records.sort(key=lambda j: int(j.job_id) if j.job_id.isdigit() else 0)
        return out

    @staticmethod
    def _real(records: list[SlurmJob]) -> SlurmJob | None:
        """The job that stands for the gpush job: not a submission refused at once."""
        real = [r for r in records if not (r.state == "FAILED" and r.reason == "BadConstraints")]
        return (real or records or [None])[-1]

    # -- the protocol ------------------------------------------------------------------

    def health(self) -> Health:
        try:
            self.client.ping()
            version = self.client.version()
            nodes = self._nodes()
        except AdapterError as exc:
            return Health(False, f"Slurm cluster {self.name} does not answer: {exc}")
        down = [n.unavailable for n in nodes if n.unavailable]
        gpus = sum(g.count for n in nodes for g in n.gres if g.name == "gpu")
        detail = f"Slurm {version}: {len(nodes)} nodes, {gpus} GPU GRES"
        if down:
            detail += f"; {len(down)} unavailable ({'; '.join(down[:3])})"
        if stale := self._stale_foreign_runs():
            detail += "; " + _phantom_words(stale)
        return Health(True, detail, version)

    def _stale_foreign_runs(self) -> list[SlurmJob]:
        """Other owners' runs found ended (_phantoms) that slurmctld still lists unfinished."""
        with self._lock:
            found = dict(self._foreign_phantoms)
        if not found:
            return []
        try:
            listed = {j.job_id: j for j in self._jobs()}
        except AdapterError:
            return []
        still = [
            j
            for i, j in found.items()
            if i in listed and listed[i].state in _UNFINISHED_RUN and _same_run(listed[i], j.start_time)
        ]
        with self._lock:
            self._foreign_phantoms = {j.job_id: j for j in still}
        return still

    def submit(self, job_id: int, spec: JobSpec, placement: Placement, owner: Owner | None = None) -> str:
        self._skip_reused_ids()
        with self._lock:
            if not self._primed:
                self._prime()
            known = self._known.get(job_id)
        if known is not None:
            return known
        s = self.settings
        identity = resolve(
            owner,
            cluster=self.name,
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
            gpu_memory_gb=self._model_memory(placement.gpu_model),
            partition=identity.partition,
            account=identity.account,
            qos=identity.qos,
            workdir=s.workdir,
            log_dir=s.log_dir,
            user=identity.user,
        )
        self._make_log_dir(identity.user)
        try:
            backend_id = self.client.submit(submission)
        except Rejected as exc:
            raise Rejected(
                explain_refusal(str(exc), identity, cluster=self.name, service_user=self._slurm_user())
            ) from None
        with self._lock:
            self._known[job_id] = backend_id
            self._active.add(job_id)
        return backend_id

    def submit_many(self, items: Sequence[tuple[int, JobSpec, Placement]]) -> list[str | AdapterError]:
        """Submit a batch on several threads; per item the backend id or the AdapterError."""
        if not items:
            return []
        with self._lock:
            if not self._primed:
                self._prime()
        return submit_each(self, items, threads=self.settings.submit_threads)

    def _prime(self) -> None:
        """Learn which gpush jobs Slurm already has (after a broker restart)."""
        for job_id, records in self._tagged(self._jobs(fresh=True)).items():
            real = self._real([r for r in records if not (r.state == "FAILED" and r.reason == "BadConstraints")])
            if real is not None:
                self._known[job_id] = real.job_id
        self._primed = True

    def cancel(self, job_id: int) -> None:
        records = self._tagged(self._jobs(fresh=True)).get(job_id, [])
        ids = {r.job_id for r in records if r.state not in _FINAL}
        with self._lock:
            known = self._known.get(job_id)
        if known and not records:
            ids.add(known)  # submitted a moment ago, not listed yet
        for backend_id in sorted(ids):
            self.client.cancel(backend_id)

    def fence(self, node: str, reason: str) -> None:
        """Drain ``node`` (no new job starts there; running ones go on), with a reason that
        says it is gpush's (``gpush: ...``), so that :meth:`unfence` resumes only what gpush drained."""
        self.client.drain(node, f"{FENCE_PREFIX}{reason}")
        with self._lock:
            self._node_listing = None

    def unfence(self, node: str) -> None:
        """Resume ``node`` if gpush drained it; a node drained by someone else (its reason is
        not gpush's) stays drained: it is theirs to resume."""
        listed = {n.name: n for n in self.client.nodes()}
        if node not in listed:
            raise Rejected(f"Slurm has no node {node}")
        if node in self._fenced_in(listed.values()):
            self.client.resume(node)
            with self._lock:
                self._node_listing = None

    def fenced(self) -> dict[str, str]:
        """The nodes gpush drained, with its reasons."""
        return self._fenced_in(self.client.nodes())

    @staticmethod
    def _fenced_in(nodes: Iterable[SlurmNode]) -> dict[str, str]:
        return {
            n.name: n.reason.removeprefix(FENCE_PREFIX)
            for n in nodes
            if n.reason.startswith(FENCE_PREFIX) and any(s in ("DRAIN", "DRAINING", "DRAINED") for s in n.states)
        }

    # -- MIG layouts (MigPublisher; adapters.slurm.mig) -----------------------------------

    def publish_mig(self, node: str, gpu: int, instances: Sequence[str], reported: Any = None) -> None:
        """Offer GPU ``gpu`` of ``node`` as ``instances`` once its agent ``reported`` them:
        the node's ``Name=gpu`` lines in ``mig_gres_conf`` name each instance's device
        (from the GPU instance ids the agent reports), the node's ``Gres=`` in slurm.conf
        adds them up, and ``mig_reload`` makes the daemons read both. Rewriting what is
        written already changes nothing; the reload runs again while slurmctld still
        offers other counts than the files (a reload that failed is retried)."""
        gres_path, slurm_path = self._mig_files()
        busy = self._node_busy(node)
        if busy:
            raise Unreachable(f"node {node} still runs jobs ({busy}): Slurm aborts them when its GRES change")
        if reported is None:
            raise Rejected(
                f"Slurm takes a MIG layout from the node agent's report of the instances, and node {node} "
                f"has not reported GPU {gpu} re-cut (gpush agent --allow-mig-changes re-cuts it first)"
            )
        made = {f"{m.profile}@{m.placement_start}": (m.gi_id, m.ci_id) for m in reported.mig_instances}
        caps = self.settings.mig_caps_dir.replace("{node}", node)
        gres = GresConf(_read(gres_path), str(gres_path))
        before = gres.devices(node)
        # The GPU's own device, as its lines name it (MultipleFiles=), else beside the capabilities.
        gpu_device = next(
            (f for d in before if d.gpu == gpu for f in d.files if re.search(rf"/nvidia{gpu}\Z", f)),
            f"{posixpath.dirname(caps.rstrip('/'))}/nvidia{gpu}",
        )
        devices = mig_devices(gpu, caps, instances, made, style=gres.style(node), gpu_device=gpu_device)
        new_gres = gres.with_gpu(node, gpu, devices)
        wanted = gres_counts(GresConf(new_gres, str(gres_path)).devices(node))
        old_slurm = _read(slurm_path)
        new_slurm = with_node_gres(old_slurm, node, wanted, str(slurm_path))
        try:
            if new_gres != gres.text:
                replace_file(gres_path, new_gres)
            if new_slurm != old_slurm:
                replace_file(slurm_path, new_slurm)
        except OSError as exc:
            raise Misconfigured(
                f"cannot write {exc.filename or gres_path}: {exc.strerror or exc}; the broker rewrites gres.conf "
                "and slurm.conf for MIG changes (run it where it may, or set mig_gres_conf to a file it may write)"
            ) from None
        if self._offered_counts(node) != wanted:
            self._reload(node)

    def mig_published(self, node: str, gpu: int) -> tuple[str, ...] | None:
        """The instances GPU ``gpu`` of ``node`` offers: those gpush's lines in gres.conf
        name, once slurmctld offers the counts the files add up to; None before (the
        daemons have not read them) or where the GPU's lines are not gpush's (no comment
        says where its instances lie)."""
        gres_path, _ = self._mig_files()
        devices = GresConf(_read(gres_path), str(gres_path)).devices(node)
        mine = [d for d in devices if d.gpu == gpu and d.gi is not None]
        if any(d.slot is None for d in mine) or self._offered_counts(node) != gres_counts(devices):
            return None
        found = self._node(node)
        if any(s in ("DOWN", "NOT_RESPONDING", "UNKNOWN", "FUTURE") for s in found.states):
            return None  # slurmd has not registered the files it read yet
        return tuple(d.slot for d in mine if d.slot)

    def _node(self, node: str, fresh: bool = False) -> SlurmNode:
        found = next((n for n in self._nodes(fresh) if n.name == node), None)
        if found is None:
            raise Rejected(f"Slurm has no node {node}")
        return found

    def _node_busy(self, node: str) -> str:
        """Why ``node`` holds jobs now (its states or GRES in use), or '' when it holds none."""
        found = self._node(node, fresh=True)
        states = [s for s in found.states if s in ("ALLOCATED", "MIXED", "COMPLETING")]
        used = [g.spec() for g in found.gres_used if g.count]
        return ", ".join(s.lower() for s in states) or ", ".join(used)

    def _mig_files(self) -> tuple[Path, Path]:
        gres = self.settings.mig_gres_conf
        slurm = self.settings.mig_slurm_conf or self.settings.slurm_conf
        if not gres:
            raise Rejected(f"Slurm cluster {self.name} takes no MIG layout from gpush: set its mig_gres_conf")
        if not slurm:
            raise Rejected(f"Slurm cluster {self.name}: set mig_slurm_conf (or slurm_conf), the slurm.conf to rewrite")
        return Path(gres), Path(slurm)

    def _offered_counts(self, node: str) -> Counter[str | None]:
        return Counter({g.type: g.count for g in self._node(node, fresh=True).gres if g.name == "gpu"})

    def _reload(self, node: str) -> None:
        argv = shlex.split(self.settings.mig_reload.replace("{node}", node))  # checked by the settings
        if argv[0] == "scontrol":  # Slurm's own command: where the cluster's commands run
            prefix = shlex.split(self.settings.command_prefix or "")
            command = posixpath.join(self.settings.bin_dir, "scontrol") if self.settings.bin_dir else "scontrol"
            argv = [*prefix, command, *argv[1:]]
        env = dict(os.environ)
        if self.settings.slurm_conf:
            env["SLURM_CONF"] = self.settings.slurm_conf
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=self.settings.timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unreachable(f"mig_reload {self.settings.mig_reload!r} for {node}: {exc}") from None
        with self._lock:
            self._node_listing = None
        if done.returncode != 0:
            said = (done.stderr or done.stdout).strip().splitlines()
            raise Unreachable(
                f"mig_reload {self.settings.mig_reload!r} for {node} exited {done.returncode}: "
                f"{said[-1] if said else 'nothing said'}"
            )

    def preempt(self, job_id: int, signal: str, grace_seconds: int) -> None:
        """Signal every live Slurm job of gpush job ``job_id`` (its batch script and all its
        processes, as ``scancel --full --signal``); the broker cancels it after the grace."""
        if signal not in PREEMPT_SIGNALS:
            raise Rejected(f"signal {signal!r} is not one a job may be told of a preemption with: {PREEMPT_SIGNALS}")
        records = self._tagged(self._jobs(fresh=True)).get(job_id, [])
        for backend_id in sorted({r.job_id for r in records if r.state not in _FINAL}):
            self.client.signal(backend_id, signal)
        with self._lock:
            # This run ends: the broker queues the job again, and its next submission must
            # reach Slurm as a new run (the newest run is the one statuses follow).
            self._known.pop(job_id, None)

    def find(self, job_id: int) -> BackendJob | None:
        records = self._tagged(self._jobs(fresh=True)).get(job_id)
        real = self._real(records) if records else None
        if real is not None and not (real.state == "FAILED" and real.reason == "BadConstraints"):
            return self._backend(job_id, real)
        for record in self.client.finished(None):
            if job_id_of(self.settings.tag, record.name) == job_id:
                return self._finished(job_id, record)
        return None

    def statuses(self, cursor: str | None = None) -> StatusPage:
        since = _cursor_time(cursor)
        jobs = self._jobs(fresh=True)
        self._release_placeholders(jobs)
        phantoms = self._phantoms(jobs)
        tagged = self._tagged(jobs)
        usage = functools.cache(lambda: self._usage(jobs))  # read once, if a job is pending
        with self._lock:
            reported = dict(self._reported)
            cancelled = set(self._cancelled_phantoms)
        now_reported: dict[int, tuple[BackendState, str | None]] = {}
        read_at = time.monotonic()
        out: list[BackendJob] = []
        latest = since
        current: dict[int, str] = {}  # unfinished gpush jobs -> their Slurm job ids
        ended_runs: dict[str, datetime] = {}
        own_phantoms: list[tuple[int, SlurmJob]] = []
        for job_id, records in tagged.items():
            job = self._real(records)
            if job is None:
                continue
            if job.job_id in phantoms or job.job_id in cancelled:
                # It ended before slurmctld restarted: say how it ended if the broker may not
                # know yet (from the record of its end), never that it runs (see _phantoms).
                record = phantoms.get(job.job_id)
                if job.job_id in phantoms and job.job_id not in cancelled:
                    own_phantoms.append((job_id, job))
                seen = reported.get(job_id)
                if record is not None:
                    backend = self._finished(job_id, record)
                    if seen != (backend.state, backend.reason):
                        out.append(backend)
                    now_reported[job_id] = (backend.state, backend.reason)
                elif seen is not None:
                    now_reported[job_id] = seen
                continue
            if job.state in _FINAL and job.start_time is not None:
                ended_runs[job.job_id] = job.start_time
            changed = job.last_change
            if changed is not None and (latest is None or changed > latest):
                latest = changed
            if job.state not in _FINAL:
                current[job_id] = job.job_id
            backend = self._backend(job_id, job, usage)
            seen = reported.get(job_id)
            if seen is not None:
                # Seen by this process: report it when its state or reason moved.
                if seen != (backend.state, backend.reason):
                    out.append(backend)
            elif since is None or changed is None or changed >= since - _SLACK:
                out.append(backend)
            now_reported[job_id] = (backend.state, backend.reason)
        with self._lock:
            vanished = self._active - set(tagged)
            # After a start, jobs that ended since the cursor may have left squeue already.
            catch_up = not self._read_finished and since is not None
            self._read_finished = True
        if vanished or catch_up:
            lost = 0
            records = {}
            for record in self.client.finished(None if vanished else since - _SLACK):
                job_id = job_id_of(self.settings.tag, record.name)
                if job_id is None or job_id in tagged:
                    continue
                ended_since = catch_up and (record.end_time is None or record.end_time >= since - _SLACK)
                if job_id in vanished or ended_since:
                    records[job_id] = record
            for job_id, record in records.items():
                out.append(self._finished(job_id, record))
            for job_id in vanished - set(records):
                seen_at, backend_id = self._seen.get(job_id) or (None, self._known.get(job_id, "?"))
                state, why = self._vanished(reported.get(job_id, (None, None))[0], seen_at, read_at)
                if state == BackendState.LOST:
                    with self._lock:
                        self._known.pop(job_id, None)  # a resubmission must reach Slurm
                    if backend_id.isdigit():
                        lost = max(lost, int(backend_id))
                out.append(BackendJob(job_id, backend_id, state, reason=why))
            if lost:
                with self._lock:
                    self._reused_up_to = max(lost, self._reused_up_to or 0)
                    # A controller that lost jobs restarted from an older state, in which
                    # runs that had ended since may still run: look for them next time.
                    self._check_phantoms = True
        for job_id, job in own_phantoms:
            self._cancel_phantom(job_id, job)
        with self._lock:
            self._ended_runs.update(ended_runs)
            while len(self._ended_runs) > _MAX_ENDED_RUNS:
                del self._ended_runs[next(iter(self._ended_runs))]
            self._active = set(current)
            self._reported = now_reported
            self._seen = {job_id: (read_at, backend_id) for job_id, backend_id in current.items()}
        cursor_out = f"t={int(latest.timestamp())}" if latest is not None else cursor
        return StatusPage(out, cursor_out)

    def _skip_reused_ids(self) -> None:
        """After slurmctld lost jobs, move its job ids past theirs before submitting again.

        A restarted slurmctld that lost its latest state gives the lost jobs' ids out
        again. The nodes still remember the ids they launched (slurmd keeps them until
        slurmctld tells it the job ended, which the new one never does), so a new job with
        such an id is refused as "already running, do not launch second copy": Slurm
        requeues it held and drains the node ("Duplicate jobid"). Seen on the test
        cluster, Slurm 22.05. So the first submission after a loss asks for those ids as
        held placeholder jobs that run nothing, until Slurm's ids have reached the highest
        lost one (at most ``_MAX_SKIPPED`` of them).

        The placeholders stay held until every node has registered with the restarted
        slurmctld (:meth:`_release_placeholders`). A node that reports a lost job's id
        while a pending job holds it has the lost run aborted ("Registered PENDING JobId=N
        on node"); one that reports it within MessageTimeout after the job holding the id
        ended is taken for a job that has just ended ("Registered newly completed", a debug
        line) and the lost run goes on. Cancelled at once, before the nodes registered,
        the placeholders let every lost run finish beside its rerun (seen on 22.05: all
        seven of seven).
        """
        with self._skipping:
            with self._lock:
                target, self._reused_up_to = self._reused_up_to, None
            if target is None:
                return
            placeholder = Submission(
                name=f"{self.settings.tag}-skip",
                comment=f"{self.settings.tag}: a job id {self.name} gave out again after losing its state; never runs",
                script="#!/bin/sh\ntrue\n",
                gres="",
                cpus_per_task=1,
                memory_mb=None,
                time_limit_minutes=1,
                partition=self.settings.partition,
                account=self.settings.account,
                qos=self.settings.qos,
                workdir=self.settings.workdir,
                output="/dev/null",
                error="/dev/null",
                environment={"PATH": "/usr/bin:/bin"},  # slurmrestd refuses a job without one
                hold=True,
            )
            for _ in range(_MAX_SKIPPED):
                try:
                    skipped = self.client.submit(placeholder)
                except Rejected as exc:
                    # The site refuses even a held job of ours: submit as before, and say why.
                    _log.warning("%s: could not skip the job ids slurmctld gives out again: %s", self.name, exc)
                    break
                except AdapterError:
                    with self._lock:  # try again with the next submission
                        self._reused_up_to = max(target, self._reused_up_to or 0)
                    raise
                with self._lock:
                    self._held_since.setdefault(skipped, time.monotonic())
                if not skipped.isdigit() or int(skipped) >= target:
                    break
        try:
            self._release_placeholders(self._jobs(fresh=True))
        except AdapterError:
            pass  # the next status read releases them

    def _release_placeholders(self, jobs: Sequence[SlurmJob]) -> None:
        """Cancel the held placeholders of :meth:`_skip_reused_ids` (this process's or an
        earlier one's, known by their name) once no node waits to register with slurmctld
        (state UNKNOWN after its restart), or once they have waited ``_PLACEHOLDER_HOLD``."""
        held = [j for j in jobs if j.name == f"{self.settings.tag}-skip" and j.state not in _FINAL]
        if not held:
            return
        now = time.monotonic()
        with self._lock:
            since = {j.job_id: self._held_since.setdefault(j.job_id, now) for j in held}
        try:
            unregistered = [n.name for n in self._nodes() if "UNKNOWN" in n.states]
        except AdapterError:
            return
        for job in held:
            if unregistered and now - since[job.job_id] < _PLACEHOLDER_HOLD:
                continue
            try:
                self.client.cancel(job.job_id)
            except AdapterError:
                return  # the next status read tries again
            with self._lock:
                self._held_since.pop(job.job_id, None)

    def _phantoms(self, jobs: Sequence[SlurmJob]) -> dict[str, FinishedRecord | None]:
        """Runs slurmctld lists as unfinished that had ended before it restarted, by Slurm
        id, with the record of their end (None: this process saw them end).

        A slurmctld restarted from a state saved before a job ended (it saves every few
        seconds; its crash, or a state restored from a copy) lists the job as running on
        its node again and holds its GRES. The node, asked to register, does not report
        it, but Slurm 22.05 lets such a job go only when the node registers more than
        BatchStartTimeout + MessageTimeout after the job was last heard of, and the nodes
        register once, at once: the GRES stay held for good (seen on the test cluster: 7
        of 7 slices for minutes, until ``scontrol reconfigure``, after which Slurm requeues
        the jobs and runs them again). Such a run is known by its end: a record of it
        (the job completion log or accounting) with the same job id, name and start, or
        a run of gpush's own that this process saw end. Looked for after a start, after
        slurmctld lost jobs, and whenever one of gpush's ended runs is listed unfinished.
        """
        unfinished = [j for j in jobs if j.state in _UNFINISHED_RUN and j.start_time is not None]
        if not unfinished:
            return {}
        with self._lock:
            ended = dict(self._ended_runs)
            check = self._check_phantoms
        found: dict[str, FinishedRecord | None] = {
            j.job_id: None for j in unfinished if j.job_id in ended and _same_run(j, ended[j.job_id])
        }
        if not (found or check):
            return found
        earliest = min(j.start_time for j in unfinished if j.start_time is not None)
        try:
            records = self.client.finished(earliest - _SLACK)
        except AdapterError:
            return found  # looked for again at the next read
        by_run = {(r.job_id, r.name): r for r in records if r.start_time is not None}
        for job in unfinished:
            record = by_run.get((job.job_id, job.name))
            if record is not None and _same_run(job, record.start_time):
                found[job.job_id] = record
        with self._lock:
            self._check_phantoms = False
            foreign = {
                i: j
                for j in unfinished
                if (i := j.job_id) in found and job_id_of(self.settings.tag, j.name, j.comment) is None
            }
            new = sorted(set(foreign) - set(self._foreign_phantoms), key=_numeric)
            self._foreign_phantoms.update(foreign)
        if new:
            _log.warning("%s: %s", self.name, _phantom_words([foreign[i] for i in new]))
        return found

    def _cancel_phantom(self, job_id: int, job: SlurmJob) -> None:
        """Cancel a run of gpush's own that ended before slurmctld restarted (_phantoms): it
        runs nowhere, and the cancel gives its GRES back (its node answers that it has no
        such job and Slurm lets it go)."""
        try:
            self.client.cancel(job.job_id)
        except AdapterError:
            return  # found again at the next read
        with self._lock:
            self._cancelled_phantoms.add(job.job_id)
        _log.warning(
            "%s: Slurm job %s (gpush job %d) had ended before slurmctld restarted from an older state, "
            "which listed it as running on %s and held its GRES; cancelled it there",
            self.name,
            job.job_id,
            job_id,
            job.nodes or "its node",
        )

    def _vanished(self, last: BackendState | None, seen: float | None, now: float) -> tuple[BackendState, str]:
        """A job squeue no longer lists and no record explains: lost by slurmctld, or ended
        with nothing left to say how.

        slurmctld keeps a finished job in squeue for MinJobAge seconds. One that is gone
        sooner after it was last seen unfinished did not end: slurmctld lost it, crashing
        before it saved its state (every few seconds), and on restart it forgot the job and
        ended its processes as orphans. It can run again, as Slurm's own requeue after a
        node failure would run it (JobRequeue=1, Slurm's default). ``last``: the state the
        last page reported; ``seen``: when squeue last listed it unfinished (monotonic).
        """
        if last in (None, BackendState.PENDING):
            return BackendState.LOST, (
                f"{self.name} lost the job before it was seen running (slurmctld restarted without it)"
            )
        if seen is not None and now - seen < self.settings.min_job_age:
            return BackendState.LOST, (
                f"{self.name} lost the job while it ran (slurmctld restarted without it "
                "and ended its processes); it runs again from the start"
            )
        return BackendState.FAILED, (
            f"left {self.name}'s queue with no record of how it ended "
            "(no accounting, no readable job completion log: set jobcomp_file)"
        )

    # -- output ------------------------------------------------------------------------

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
        """Job ``job_id``'s stdout or stderr (see the module docstring), read here when the
        broker can see the file, else where it is."""
        if stream not in ("stdout", "stderr"):
            raise Rejected(f"a Slurm job has two streams, stdout and stderr; not {stream!r}")
        if replica not in (None, 0):
            raise Rejected(f"job {job_id} is one Slurm job on {self.name}: it has no replica {replica}")
        if offset < 0 or (tail is not None and tail < 0):
            raise Rejected("offset and tail count from 0")
        path, node, note = self._output_file(job_id, backend_id, stream)
        location = f"node {node}: {path}" if node else path
        try:
            if tail is not None:
                chunk = read_tail(path, tail, limit=MAX_LOG_CHUNK, positions=self._positions)
            else:
                chunk = read_from(path, offset, limit=MAX_LOG_CHUNK, positions=self._positions)
        except OSError as exc:
            why = "is not there" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror})"
            if node:
                where = f"it is on {node}'s own disk: read it there (ssh {node} tail -f {path})"
            else:
                where = f"Slurm no longer says which node ran job {job_id}: read it on that node"
            return JobOutput(
                location,
                next_offset=offset,
                readable=False,
                note=f"{path} {why} on the broker's machine; {where}, or set the cluster's log_dir "
                "to a directory on a filesystem the broker shares with the nodes",
            )
        if chunk.shorter:
            note = (
                f"{note}; " if note else ""
            ) + f"the output is shorter than offset {offset}: Slurm ran the job again, and its files began anew"
        return JobOutput(location, chunk.text, chunk.next_offset, note=note)

    def _output_file(self, job_id: int, backend_id: str, stream: str) -> tuple[str, str | None, str | None]:
        """(path, node, note) of the job's ``stream``: the file Slurm names for it (squeue, else
        accounting), else the one gpush rendered. :class:`Rejected` when it never started."""
        records = self._tagged(self._jobs(fresh=True)).get(job_id, [])
        job = next((r for r in records if r.job_id == backend_id), None) or self._real(records)
        if job is not None:
            node = job.batch_host or job.nodes or None
            if job.state in _PENDING and not job.restarts:
                raise Rejected(f"job {job_id} has not started on {self.name} yet: no output")
            if node is None and not job.restarts:
                raise Rejected(f"job {job_id} never started on {self.name}: no output")
            pattern, note = job.standard_error if stream == "stderr" else job.standard_output, None
            if stream == "stderr" and not pattern and job.standard_output:
                pattern, note = job.standard_output, "Slurm writes this job's stderr into its stdout file"
            if pattern:
                path = expand_filename(pattern, job_id=job.job_id, name=job.name, user=job.user, node=node or "")
                return posixpath.join(job.work_dir or self.settings.workdir, path), node, note
            return self._rendered_output(job_id, stream, job.user, job.work_dir), node, None
        finished = [r for r in self.client.finished(None) if job_id_of(self.settings.tag, r.name) == job_id]
        record = next((r for r in finished if r.job_id == backend_id), None) or (finished or [None])[-1]
        if record is not None:
            node = record.nodes if record.nodes not in ("", "None assigned", "(null)") else None
            if node is None:
                raise Rejected(f"job {job_id} never started on {self.name}: no output")
            pattern = record.standard_error if stream == "stderr" else record.standard_output
            if pattern:
                path = expand_filename(pattern, job_id=record.job_id, name=record.name, user=record.user, node=node)
                return posixpath.join(record.work_dir or self.settings.workdir, path), node, None
            return self._rendered_output(job_id, stream, record.user, record.work_dir), node, None
        # Slurm has forgotten it: where gpush told it to write.
        return self._rendered_output(job_id, stream, None), None, None

    def _rendered_output(self, job_id: int, stream: str, user: str | None, workdir: str = "") -> str:
        """The file gpush asked Slurm for (``workdir``: the one the job ran in, when known)."""
        out, err = log_paths(workdir or self.settings.workdir, self.settings.log_dir, self.settings.tag, job_id)
        return (err if stream == "stderr" else out).replace("%u", user or self._slurm_user())

    def _slurm_user(self) -> str:
        """The Slurm user jobs run as: the REST user, or the broker's own for sbatch."""
        if self.settings.rest_url or self.settings.rest_socket:
            return self.settings.user or os.environ.get("USER") or "root"  # as make_client has it
        return pwd.getpwuid(os.geteuid()).pw_name

    def _make_log_dir(self, user: str | None = None) -> None:
        """Create the log directory before a submission: Slurm creates none, and a job whose
        ``--output`` directory is missing fails at launch (JobLaunchFailure, Slurm 22.05).
        Made here, it is the nodes' directory when the broker shares their filesystem or is
        their machine; a broker elsewhere needs a ``log_dir`` the site made on the nodes."""
        per_user = "%u" in self.settings.log_dir
        directory = log_directory(self.settings.workdir, self.settings.log_dir).replace(
            "%u", user or self._slurm_user()
        )
        if os.path.isdir(directory):
            return
        try:
            os.makedirs(directory, exist_ok=True)
            if user is not None:
                # Jobs that run as their users write here: a user's own directory is
                # theirs, one shared by users is like /tmp (anyone writes, only the owner
                # of a file removes it).
                if per_user and os.geteuid() == 0:
                    os.chown(directory, pwd.getpwnam(user).pw_uid, -1)
                elif not per_user:
                    os.chmod(directory, 0o1777)
        except (OSError, KeyError) as exc:
            if directory not in self._log_dirs_refused:
                self._log_dirs_refused.add(directory)
                _log.warning(
                    "%s: cannot create the jobs' log directory %s here (%s): jobs fail at launch unless it "
                    "exists on the nodes (set log_dir to a directory of a filesystem the nodes share)",
                    self.name,
                    directory,
                    getattr(exc, "strerror", None) or exc,
                )

    def inventory(self) -> list[CapacityUnit]:
        nodes = self._nodes()
        mps_used = self._mps_in_use(self._jobs())
        units: list[CapacityUnit] = []
        for node in nodes:
            units.extend(self._node_units(node, mps_used.get(node.name, 0)))
        return units

    # -- inventory -----------------------------------------------------------------------

    def _mps_in_use(self, jobs: Sequence[SlurmJob]) -> dict[str, int]:
        """MPS units held per node: the running jobs' requests (GresUsed does not tell)."""
        used: dict[str, int] = defaultdict(int)
        for job in jobs:
            if job.state not in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED") or not job.nodes:
                continue
            for gres in job.tres_per_node:
                if gres.name == "mps":
                    used[job.nodes] += gres.count
        return used

    def model_of(self, gres_type: str | None) -> GpuModel | None:
        """The GPU model behind a GRES type (see the module docstring), or None."""
        if not gres_type:
            return None
        configured = self.settings.gpu_types.get(gres_type)
        if configured:
            return gpu_model(configured)
        if MIG_TYPE.match(gres_type):
            return next((m for m in MODELS if gres_type in m.mig_profiles), None)
        try:
            return gpu_model(gres_type)
        except ValueError:
            return None

    def _node_units(self, node: SlurmNode, mps_used: int) -> list[CapacityUnit]:
        used = {(g.name, g.type): g.count for g in node.gres_used}
        unavailable = node.unavailable
        labels = {"state": "+".join(s.lower() for s in node.states), "partitions": ",".join(node.partitions)}
        gpus = [g for g in node.gres if g.name == "gpu"]
        mps = [g for g in node.gres if g.name == "mps"]
        whole_types = [g.type for g in gpus if g.type and not MIG_TYPE.match(g.type)]
        units: list[CapacityUnit] = []

        def unit(sharing: Sharing, gres: Gres, model: GpuModel | None, **fields: Any) -> CapacityUnit:
            capacity = fields.pop("capacity")
            allocated = capacity if unavailable else min(fields.pop("allocated"), capacity)
            fields.pop("allocated", None)
            return CapacityUnit(
                cluster=self.name,
                node=node.name,
                sharing=sharing,
                gpu_model=model.name if model else (gres.type or "unknown"),
                capacity=capacity,
                allocated=allocated,
                gpu_memory_gb=float(model.memory_gb) if model else None,
                labels={**labels, "gres": gres.spec()} | ({"unavailable": unavailable} if unavailable else {}),
                **fields,
            )

        mps_gpus = 0
        for share in mps:
            mps_gpus = max(1, math.ceil(share.count / self.settings.mps_per_gpu))
            model = self.model_of(share.type or (whole_types[0] if whole_types else None))
            per_gpu = self.settings.mps_per_gpu
            units.append(
                unit(
                    Sharing.SLURM_MPS,
                    share,
                    model,
                    # Capacity in percent of one GPU, as the broker counts MPS shares.
                    capacity=100 * mps_gpus,
                    allocated=math.ceil(mps_used * 100 / per_gpu),
                    unit_memory_gb=(model.memory_gb / 100) if model else 0.0,
                    gpu_equivalent=0.01,
                )
            )
        for gres in gpus:
            model = self.model_of(gres.type)
            taken = used.get(("gpu", gres.type), 0)
            if gres.type and MIG_TYPE.match(gres.type):
                units.append(
                    unit(
                        Sharing.SLURM_MIG,
                        gres,
                        model,
                        capacity=gres.count,
                        allocated=taken,
                        unit_memory_gb=float(model.profile(gres.type).memory_gb) if model else 0.0,
                        gpu_equivalent=model.gpu_equivalent(gres.type) if model else 1 / 7,
                        mig_profile=gres.type,
                        in_mig_mode=True,
                    )
                )
                continue
            # GPUs that back MPS are not also offered whole (one job would take the GPU
            # from under every MPS client).
            count = gres.count - (mps_gpus if mps else 0)
            if count <= 0:
                continue
            units.append(
                unit(
                    Sharing.SLURM_EXCLUSIVE,
                    gres,
                    model,
                    capacity=count,
                    allocated=taken,
                    unit_memory_gb=float(model.memory_gb) if model else 0.0,
                    gpu_equivalent=1.0,
                )
            )
        return units

    def _gres_type(self, placement: Placement) -> str | None:
        """The GRES type to ask for whole GPUs of the placement's model (on its node first)."""
        if placement.sharing != Sharing.SLURM_EXCLUSIVE:
            return None
        nodes = self._nodes()
        nodes = sorted(nodes, key=lambda n: n.name != placement.node)
        for node in nodes:
            for gres in node.gres:
                if gres.name != "gpu" or not gres.type or MIG_TYPE.match(gres.type):
                    continue
                model = self.model_of(gres.type)
                if placement.gpu_model is None or (model is not None and model.name == placement.gpu_model):
                    return gres.type
        return None

    def _model_memory(self, name: str | None) -> float | None:
        try:
            return float(gpu_model(name).memory_gb) if name else None
        except ValueError:
            return None

    # -- states and reasons --------------------------------------------------------------

    def _backend(self, job_id: int, job: SlurmJob, usage: Callable[[], _Usage | None] | None = None) -> BackendJob:
        state, reason = self._state(job, usage)
        at = job.end_time if state in (BackendState.SUCCEEDED, BackendState.FAILED, BackendState.CANCELLED) else None
        at = at or (job.start_time if state == BackendState.RUNNING else None)
        exit_code = job.exit_code if state in (BackendState.SUCCEEDED, BackendState.FAILED) else None
        return BackendJob(job_id, job.job_id, state, reason=reason, node=job.nodes or None, exit_code=exit_code, at=at)

    def _finished(self, job_id: int, record: FinishedRecord) -> BackendJob:
        state, reason = _final_state(record.state, record.exit_code)
        return BackendJob(
            job_id,
            record.job_id,
            state,
            reason=reason,
            node=record.nodes or None,
            exit_code=record.exit_code,
            at=record.end_time,
        )

    def _state(
        self, job: SlurmJob, usage: Callable[[], _Usage | None] | None = None
    ) -> tuple[BackendState, str | None]:
        state = job.state
        if state in _PENDING:
            return BackendState.PENDING, self.pending_reason(job, usage)
        if state in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STAGE_OUT", "SIGNALING", "RESIZING"):
            if state == "SUSPENDED":
                return BackendState.RUNNING, f"suspended by Slurm on {job.nodes}"
            return BackendState.RUNNING, None
        return _final_state(state, job.exit_code, job.reason)

    def pending_reason(self, job: SlurmJob, usage: Callable[[], _Usage | None] | None = None) -> str:
        """Why a job waits in Slurm, in the user's terms. ``usage``: the cluster's GRES use,
        read once for a whole status page (by default read now)."""
        waiting = self._pending_reason(job, usage)
        if job.restarts:
            # Requeued by Slurm itself (its node failed, it was preempted, scontrol requeue).
            times = "once" if job.restarts == 1 else f"{job.restarts} times"
            return f"requeued by {self.name} (it started there {times} before); {waiting}"
        return waiting

    def _pending_reason(self, job: SlurmJob, usage: Callable[[], _Usage | None] | None) -> str:
        reason = job.reason
        if reason == "Resources" and "DOWN, DRAINED" in job.description:
            # 22.05 keeps the reason Resources when the job's only nodes are drained
            # or down, and says so in state_description.
            reason = "ReqNodeNotAvail"
        wanted = next((g for g in job.tres_per_node if g.name in ("gpu", "mps")), None)
        what = _describe(wanted) if wanted else "its resources"
        if reason in ("Resources", "Priority", "None") and wanted is not None:
            total, busy = _gres_use(wanted, (usage or self._usage)())
            if reason == "Priority" and total and busy < total:
                return f"waiting in {self.name}'s queue for {what} ({busy} of {total} busy)"
            if reason == "Priority":
                return f"waiting in {self.name} for {what}, behind higher-priority jobs: all {total} busy"
            if total and busy >= total:
                return f"waiting in {self.name} for {what}: all {total} busy"
            if total:
                return f"waiting in {self.name} for {what} ({busy} of {total} busy)"
            return f"waiting in {self.name} for {what}"
        explained = {
            "BadConstraints": f"no node of {self.name} offers {what}",
            "ReqNodeNotAvail": f"the nodes of {self.name} that have {what} are down, drained or reserved",
            "Reservation": f"waiting for a reservation on {self.name}",
            "PartitionDown": f"partition {job.partition} of {self.name} is down",
            "PartitionInactive": f"partition {job.partition} of {self.name} is inactive",
            "PartitionNodeLimit": f"partition {job.partition} of {self.name} has too few nodes for the job",
            "PartitionTimeLimit": f"the time limit is over partition {job.partition}'s maximum",
            "JobHeldAdmin": f"held by a {self.name} administrator (scontrol release)",
            "JobHeldUser": "held by its user (scontrol release)",
            "Dependency": "waiting for the jobs it depends on",
            "BeginTime": "waiting for its begin time"
            + (f" ({job.eligible_time:%Y-%m-%d %H:%M:%S} UTC)" if job.eligible_time else ""),
            "NodeDown": f"a node it needs on {self.name} is down",
        }
        if reason in explained:
            return explained[reason]
        if (limit := limit_reason(reason, cluster=self.name, account=job.account, qos=job.qos)) is not None:
            return limit
        return f"waiting in {self.name}: {reason}"

    def _usage(self, jobs: Sequence[SlurmJob] | None = None) -> _Usage | None:
        """The nodes and MPS in use now, for reasons; None when Slurm does not answer."""
        try:
            nodes = self._nodes()
            return _Usage(nodes, self._mps_in_use(self._jobs() if jobs is None else jobs))
        except AdapterError:
            return None


@dataclass(frozen=True)
class _Usage:
    """What the cluster's GRES are doing, as pending reasons count it."""

    nodes: Sequence[SlurmNode]
    mps_used: dict[str, int]  # MPS units held per node by running jobs


def _gres_use(wanted: Gres, usage: _Usage | None) -> tuple[int, int]:
    """(total, busy) of a GRES kind across the cluster, for reasons."""
    if usage is None:
        return 0, 0
    total = busy = 0
    if wanted.name == "mps":
        for node in usage.nodes:
            have = sum(g.count for g in node.gres if g.name == "mps")
            total += have
            busy += min(usage.mps_used.get(node.name, 0), have)
        return total, busy
    for node in usage.nodes:
        total += sum(g.count for g in node.gres if g.name == "gpu" and g.type == wanted.type)
        busy += sum(g.count for g in node.gres_used if g.name == "gpu" and g.type == wanted.type)
    return total, busy


def _describe(gres: Gres) -> str:
    if gres.name == "mps":
        return f"an MPS share of {gres.count}"
    if gres.type and MIG_TYPE.match(gres.type):
        return f"a {gres.type} slice" if gres.count == 1 else f"{gres.count} {gres.type} slices"
    kind = f"{gres.type} " if gres.type else ""
    return f"{gres.count} whole {kind}GPU{'s' if gres.count > 1 else ''}"


def _final_state(state: str, exit_code: int | None, reason: str | None = None) -> tuple[BackendState, str | None]:
    if state == "COMPLETED":
        return BackendState.SUCCEEDED, None
    if state == "CANCELLED":
        return BackendState.CANCELLED, "cancelled in Slurm"
    why = {
        "TIMEOUT": "reached its time limit",
        "OUT_OF_MEMORY": "ran out of memory (Slurm OUT_OF_MEMORY)",
        "NODE_FAIL": "its node failed",
        "BOOT_FAIL": "its node failed to boot",
        "DEADLINE": "missed its deadline",
        "PREEMPTED": "preempted",
    }.get(state)
    if state == "FAILED" and reason == "BadConstraints":
        return BackendState.FAILED, "Slurm refused it at submission: no node offers what it asks for"
    if state == "FAILED" and reason == "JobLaunchFailure":
        # Seen on 22.05 when the directory of --output or --error is missing on the node.
        return BackendState.FAILED, (
            "Slurm could not start it on its node (JobLaunchFailure): is the cluster's log_dir, "
            "or the job's working directory, missing there? Slurm creates neither"
        )
    if why is None:
        why = f"exited with code {exit_code}" if exit_code else f"Slurm state {state}"
        if reason and reason not in ("None", "NonZeroExitCode"):
            why += f" ({reason})"
    return BackendState.FAILED, why


def _same_run(job: SlurmJob, start: datetime | None) -> bool:
    """Whether ``job`` is the run that started at ``start`` (Slurm's times: 1 s apart at most)."""
    return job.start_time is not None and start is not None and abs(job.start_time - start) <= timedelta(seconds=1)


def _numeric(job_id: str) -> tuple[int, str]:
    return (int(job_id), "") if job_id.isdigit() else (0, job_id)


def _phantom_words(jobs: Sequence[SlurmJob]) -> str:
    """Runs that ended before slurmctld restarted and that it lists as running, in an admin's words."""
    ids = sorted({j.job_id for j in jobs}, key=_numeric)
    nodes = sorted({j.nodes for j in jobs if j.nodes})
    gres = defaultdict(int)
    for job in jobs:
        for g in job.tres_per_node:
            gres[g.spec().rsplit(":", 1)[0]] += g.count
    held = ", ".join(f"{name}:{count}" for name, count in sorted(gres.items())) or "their resources"
    return (
        f"slurmctld lists {len(ids)} job{'s' if len(ids) > 1 else ''} as running on {', '.join(nodes) or 'its nodes'} "
        f"that ended before it restarted from an older state (Slurm job {' '.join(ids)}, per the job "
        f"completion log or accounting); they hold {held} until an administrator cancels them "
        f"(scancel {' '.join(ids)}): `scontrol reconfigure` would run them again"
    )


def _cursor_time(cursor: str | None) -> datetime | None:
    if not cursor or not cursor.startswith("t="):
        return None
    try:
        return datetime.fromtimestamp(int(cursor[2:]), UTC)
    except ValueError:
        return None


def _read(path: Path) -> str:
    """A Slurm config file gpush rewrites; :class:`Misconfigured` when it cannot be read."""
    try:
        return path.read_text()
    except OSError as exc:
        raise Misconfigured(f"cannot read {path}: {exc.strerror or exc}; gpush rewrites it for MIG changes") from None
