"""What the parts of the Slurm adapter share: the cluster's name, settings and client; its
squeue and sinfo answers, read at most once within ``cache_seconds``; gpush's jobs found
among Slurm's by their tag; what this process knows of the jobs it submitted; the Slurm
user jobs run as; and the GPU model behind a GRES type.

One lock guards all of it, and each part's own state with it (an ``RLock``: a part holding
it may call another part that takes it too)."""

from __future__ import annotations

import os
import pwd
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from adapters.slurm.client import SlurmClient
from adapters.slurm.records import MIG_TYPE, SlurmJob, SlurmNode
from adapters.slurm.render import job_id_of
from adapters.slurm.settings import SlurmSettings
from broker.core.adapter import Rejected
from broker.core.gpus import MODELS, GpuModel, gpu_model


class SlurmContext:
    """One Slurm cluster as the adapter's parts see it (see the module docstring)."""

    def __init__(self, name: str, settings: SlurmSettings, client: SlurmClient):
        self.name = name
        self.settings = settings
        self.client = client
        self.lock = threading.RLock()
        self.known: dict[int, str] = {}  # gpush id -> Slurm job id, of jobs this process saw
        self.active: set[int] = set()  # gpush ids not yet final at the last status read
        self._listing: tuple[float, list[SlurmJob]] | None = None
        self._node_listing: tuple[float, list[SlurmNode]] | None = None

    # -- reads, shared within cache_seconds ---------------------------------------------

    def jobs(self, fresh: bool = False) -> list[SlurmJob]:
        with self.lock:
            now = time.monotonic()
            if fresh or self._listing is None or now - self._listing[0] > self.settings.cache_seconds:
                self._listing = (now, self.client.jobs())
            return self._listing[1]

    def nodes(self, fresh: bool = False) -> list[SlurmNode]:
        with self.lock:
            now = time.monotonic()
            if fresh or self._node_listing is None or now - self._node_listing[0] > self.settings.cache_seconds:
                self._node_listing = (now, self.client.nodes())
            return self._node_listing[1]

    def forget_nodes(self) -> None:
        """The nodes changed (drained, resumed, reconfigured): the next read asks Slurm."""
        with self.lock:
            self._node_listing = None

    def node(self, node: str, fresh: bool = False) -> SlurmNode:
        found = next((n for n in self.nodes(fresh) if n.name == node), None)
        if found is None:
            raise Rejected(f"Slurm has no node {node}")
        return found

    # -- gpush's jobs among Slurm's -------------------------------------------------------

    def tagged(self, jobs: Sequence[SlurmJob]) -> dict[int, list[SlurmJob]]:
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
    def real(records: list[SlurmJob]) -> SlurmJob | None:
        """The job that stands for the gpush job: not a submission refused at once."""
        real = [r for r in records if not (r.state == "FAILED" and r.reason == "BadConstraints")]
        return (real or records or [None])[-1]

    def slurm_user(self) -> str:
        """The Slurm user jobs run as: the REST user, or the broker's own for sbatch."""
        if self.settings.rest_url or self.settings.rest_socket:
            return self.settings.user or os.environ.get("USER") or "root"  # as make_client has it
        return pwd.getpwuid(os.geteuid()).pw_name

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
