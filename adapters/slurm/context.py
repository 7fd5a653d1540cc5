"""What the parts of the Slurm adapter share: the cluster's name, settings and client; its
squeue and sinfo answers, read at most once within ``cache_seconds`` (sinfo's never older
than squeue's: :meth:`SlurmContext.nodes`); gpush's jobs found
among Slurm's by their tag; what this process knows of the jobs it submitted; the Slurm
user jobs run as; the GPU model behind a GRES type; and the topology, read rarely (the
network every ``topology_seconds``, gres.conf when it changes, Slurm's version once).

**Whose job a tagged record is** (:meth:`SlurmContext.gpush_id`). Any Slurm user may name a
job ``gpush-<id>`` or comment it ``gpush:job-<id>``, with any output path. A record is taken
for gpush job ``id`` only if it runs as the Slurm user gpush submitted that job as (and under
its account), as far as this process knows it, else as a user gpush submits jobs as at all
(adapters.slurm.identity.runs_jobs_as); and never if it is newer than the Slurm job gpush
recorded for that id, since gpush submits no second Slurm job while it holds one. Every part
finds gpush's jobs through it: status pages, find, cancel, preemption, phantom runs, output.
Any other record is ignored, and a log line names its Slurm job and user once. With
``run_as=owner``, a process that did not submit the job (after a restart) knows only that its
user is one gpush may run jobs as; output is read only from the Slurm job the broker recorded
(adapters.slurm.logs).

One lock guards all of it, and each part's own state with it (an ``RLock``: a part holding
it may call another part that takes it too)."""

from __future__ import annotations

import logging
import os
import pwd
import re
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from adapters.slurm.client import SlurmClient
from adapters.slurm.identity import runs_jobs_as
from adapters.slurm.records import MIG_TYPE, FinishedRecord, SlurmJob, SlurmNode
from adapters.slurm.render import job_id_of
from adapters.slurm.settings import SlurmSettings
from adapters.slurm.topology import GresGpu, Network, parse_topology, read_gres_conf
from broker.core.adapter import AdapterError, Rejected
from broker.core.gpus import MODELS, GpuModel, gpu_model

_log = logging.getLogger(__name__)
# Impostors said in the log, remembered by Slurm job id so each is said once.
_MAX_IMPOSTORS_SAID = 10_000


class SlurmContext:
    """One Slurm cluster as the adapter's parts see it (see the module docstring)."""

    def __init__(self, name: str, settings: SlurmSettings, client: SlurmClient):
        self.name = name
        self.settings = settings
        self.client = client
        self.lock = threading.RLock()
        self.known: dict[int, str] = {}  # gpush id -> Slurm job id, of jobs this process saw
        # gpush id -> the Slurm user and account (None: the user's default) this process submitted it as
        self.submitted_as: dict[int, tuple[str, str | None]] = {}
        self._impostors: dict[str, None] = {}  # Slurm ids of tagged jobs found not gpush's, said once
        self._service_user: str | None = None
        self.active: set[int] = set()  # gpush ids not yet final at the last status read
        self._listing: tuple[float, list[SlurmJob]] | None = None
        self._node_listing: tuple[float, list[SlurmNode]] | None = None
        self._network: tuple[float, Network] | None = None
        self._gres_conf: tuple[tuple[str, float, int], dict[str, list[GresGpu]]] | None = None
        self._version: tuple[int, int] | None = None
        self._topology_said: set[str] = set()  # why topology could not be read, each said once

    # -- reads, shared within cache_seconds ---------------------------------------------

    def jobs(self, fresh: bool = False) -> list[SlurmJob]:
        with self.lock:
            now = time.monotonic()
            if fresh or self._listing is None or now - self._listing[0] > self.settings.cache_seconds:
                self._listing = (now, self.client.jobs())
            return self._listing[1]

    def nodes(self, fresh: bool = False) -> list[SlurmNode]:
        """sinfo's nodes, never read before the last squeue listing: the broker reads the
        jobs' states (a placement Slurm has started stops counting as pending) before the
        inventory, so nodes read earlier would show that job's GPUs free, counted nowhere,
        and the next job gpush pinned there would wait in Slurm's queue until it ended."""
        with self.lock:
            now = time.monotonic()
            listing = self._node_listing
            if (
                fresh
                or listing is None
                or now - listing[0] > self.settings.cache_seconds
                or (self._listing is not None and listing[0] < self._listing[0])
            ):
                self._node_listing = (now, self.client.nodes())
            return self._node_listing[1]

    def forget_nodes(self) -> None:
        """The nodes changed (drained, resumed, reconfigured): the next read asks Slurm."""
        with self.lock:
            self._node_listing = None

    # -- topology (adapters.slurm.topology): read rarely, it changes rarely ------------------

    def network(self) -> Network:
        """The network (``scontrol show topology``), kept ``topology_seconds``; an empty one
        when it cannot be read (said once in the log): placement then knows no domains."""
        with self.lock:
            now = time.monotonic()
            if self._network is None or now - self._network[0] > self.settings.topology_seconds:
                read = getattr(self.client, "network_topology", None)  # a client of before topology: none
                try:
                    network = parse_topology(read() if read else "")
                except AdapterError as exc:
                    self._say_once(f"cannot read the network topology (scontrol show topology): {exc}")
                    network = self._network[1] if self._network else Network()
                self._network = (now, network)
            return self._network[1]

    def gres_layout(self) -> dict[str, list[GresGpu]]:
        """Each node's GPUs as the cluster's gres.conf lists them (``gres_conf``, else
        ``mig_gres_conf``), re-read when the file changes; {} without one."""
        path = self.settings.gres_conf or self.settings.mig_gres_conf
        if not path:
            return {}
        try:
            stat = os.stat(path)
            key = (path, stat.st_mtime, stat.st_size)
            with self.lock:
                if self._gres_conf is None or self._gres_conf[0] != key:
                    with open(path, encoding="utf-8", errors="replace") as f:
                        self._gres_conf = (key, read_gres_conf(f.read()))
                return self._gres_conf[1]
        except OSError as exc:
            self._say_once(f"cannot read gres.conf {path} for the GPUs' Links= and Cores=: {exc}")
            return {}

    def version_info(self) -> tuple[int, int]:
        """Slurm's (major, minor), (0, 0) when it does not say."""
        if self._version is None:
            numbers = re.findall(r"\d+", self.client.version())
            self._version = (int(numbers[0]), int(numbers[1])) if len(numbers) >= 2 else (0, 0)
        return self._version

    def _say_once(self, why: str) -> None:
        with self.lock:
            if why in self._topology_said:
                return
            self._topology_said.add(why)
        _log.warning("%s: %s", self.name, why)

    def node(self, node: str, fresh: bool = False) -> SlurmNode:
        found = next((n for n in self.nodes(fresh) if n.name == node), None)
        if found is None:
            raise Rejected(f"Slurm has no node {node}")
        return found

    # -- gpush's jobs among Slurm's -------------------------------------------------------

    def tagged(self, jobs: Sequence[SlurmJob]) -> dict[int, list[SlurmJob]]:
        """gpush id -> its Slurm jobs, newest last (a refused submission may have left one);
        impostors left out (:meth:`gpush_id`)."""
        out: dict[int, list[SlurmJob]] = defaultdict(list)
        for job in jobs:
            job_id = self.gpush_id(job)
            if job_id is not None:
                out[job_id].append(job)
        for records in out.values():
            records.sort(key=lambda j: int(j.job_id) if j.job_id.isdigit() else 0)
        return out

    @staticmethod
    def real(records: list[SlurmJob]) -> SlurmJob | None:
        """The job that stands for the gpush job: not a submission refused at once."""
        real = [r for r in records if not (r.state == "FAILED" and r.reason == "BadConstraints")]
        return (real or records or [None])[-1]

    def gpush_id(self, record: SlurmJob | FinishedRecord) -> int | None:
        """The gpush job a Slurm job (listed, or a record of one that ended) stands for: the
        one its tag names, if gpush could have submitted it (see the module docstring)."""
        comment = record.comment if isinstance(record, SlurmJob) else ""  # the records keep none
        job_id = job_id_of(self.settings.tag, record.name, comment)
        if job_id is None:
            return None
        why = self._not_gpushs(job_id, record)
        if why is None:
            return job_id
        with self.lock:
            said = record.job_id in self._impostors
            if not said:
                self._impostors[record.job_id] = None
                while len(self._impostors) > _MAX_IMPOSTORS_SAID:
                    del self._impostors[next(iter(self._impostors))]
        if not said:
            _log.warning(
                "%s: Slurm job %s of user %s carries the tag of gpush job %d but is not gpush's (%s): ignored",
                self.name,
                record.job_id,
                record.user or "(unknown)",
                job_id,
                why,
            )
        return None

    def _not_gpushs(self, job_id: int, record: SlurmJob | FinishedRecord) -> str | None:
        """Why ``record`` cannot be gpush job ``job_id``'s, or None when it can be."""
        with self.lock:
            submitted = self.submitted_as.get(job_id)
            known = self.known.get(job_id)
        if known and known.isdigit() and record.job_id.isdigit() and int(record.job_id) > int(known):
            return f"gpush submitted job {job_id} as Slurm job {known}"
        if submitted is not None:
            user, account = submitted
            if record.user != user:
                return f"gpush submitted job {job_id} as user {user}"
            if account and record.account and record.account != account:
                return f"gpush submitted job {job_id} under account {account}"
            return None
        s = self.settings
        service_user = self.slurm_user()
        if runs_jobs_as(
            record.user,
            run_as=s.run_as,
            unix_users=s.unix_users,
            same_name_users=s.same_name_users,
            service_user=service_user,
        ):
            return None
        if s.run_as == "owner":
            return "gpush runs no job as that user"
        return f"gpush runs its jobs on {self.name} as user {service_user}"

    def slurm_user(self) -> str:
        """The Slurm user jobs run as: the REST user, or the broker's own for sbatch."""
        if self._service_user is None:  # asked for every tagged record: looked up once
            if self.settings.rest_url or self.settings.rest_socket:
                self._service_user = self.settings.user or os.environ.get("USER") or "root"  # as make_client has it
            else:
                self._service_user = pwd.getpwuid(os.geteuid()).pw_name
        return self._service_user

    # -- GPU models ------------------------------------------------------------------------

    def model_of(self, gres_type: str | None) -> GpuModel | None:
        """The GPU model behind a GRES type (see adapters.slurm.adapter's docstring), or None."""
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

    def model_memory(self, name: str | None) -> float | None:
        try:
            return float(gpu_model(name).memory_gb) if name else None
        except ValueError:
            return None
