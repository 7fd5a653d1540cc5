"""The environment a job sees: one owner, so a job gets the same variables on every cluster.

Both renderers (adapters.slurm.render, adapters.k8s.render) call :func:`job_environment`;
the job reads the variables back with broker.jobenv.budget. The rules, the same on Slurm
and on Kubernetes:

- **The job's own variables** (``spec.env``) reach it as typed, ``PATH`` included
  (else the cluster's default ``PATH``, which the renderer passes).
- **``GPUSH_*`` are gpush's.** A job's variable of that prefix is dropped, whether or
  not gpush sets that name itself, so what a program reads there always comes from gpush:
  :data:`JOB_ID`, :data:`TENANT` (when the job has one), :data:`GPU_MEMORY_FRACTION`
  and :data:`GPU_MEMORY_GB` (see :func:`memory_budget`).
- **Device ids are the cluster's.** A job that sets :data:`DEVICE_VARIABLES`
  (``CUDA_VISIBLE_DEVICES``, ``NVIDIA_VISIBLE_DEVICES``) is refused: Slurm sets them
  for the GRES it grants and the Kubernetes device plugin for the resources it
  allocates, and a job that named its own would use GPUs it was not given (a Slurm
  batch script exports the job's variables after Slurm set its own, so there the
  job's would win).

This module is imported inside jobs (broker.jobenv.budget reads the names below), so it
loads none of the broker's types until a renderer asks for an environment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from broker.core.adapter import Placement
    from broker.core.schemas import JobSpec

RESERVED_PREFIX = "GPUSH_"
JOB_ID = "GPUSH_JOB_ID"
TENANT = "GPUSH_TENANT"
# The share of each visible device's memory the job may use: 1 on a MIG slice or a whole
# GPU; under time-slicing and MPS, which do not isolate memory, the job's part of the GPU.
GPU_MEMORY_FRACTION = "GPUSH_GPU_MEMORY_FRACTION"
# The job's GPU memory in GB, when it asked for an amount (never a GPU's nominal size).
GPU_MEMORY_GB = "GPUSH_GPU_MEMORY_GB"
DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")


def memory_budget(spec: JobSpec, placement: Placement, device_memory_gb: float | None) -> tuple[float, float | None]:
    """(fraction of each visible device's memory, GB) the job may use.

    The GB is the job's own ``gpu_memory_gb`` (the placement's, else the spec's; None when
    it asked for none): a device's usable memory is a little under its nominal size (an
    "80 GB" H100 has 79.6 GiB), so a nominal figure would invite the job to take more
    than is there. The fraction is 1 on a MIG slice or a whole GPU, which are the job's
    alone. On a GPU it shares (time-slicing, MPS) it is the GB over the device's memory
    (``device_memory_gb``, when known); an MPS share without a GB is its percent of the GPU.
    """
    from broker.core.adapter import Sharing

    budget = placement.gpu_memory_gb or spec.gpu_memory_gb
    if placement.sharing in (Sharing.K8S_TIMESLICE, Sharing.SLURM_MPS):
        if budget and device_memory_gb:
            return min(budget / device_memory_gb, 1.0), budget
        if placement.sharing == Sharing.SLURM_MPS:
            return min(placement.units / 100, 1.0), budget  # MPS units are percent of one GPU
    return 1.0, budget


def job_environment(
    job_id: int, spec: JobSpec, placement: Placement, *, device_memory_gb: float | None, path: str
) -> dict[str, str]:
    """The variables job ``job_id`` runs with (see the module docstring for the rules).

    ``device_memory_gb``: the memory of one GPU of the placement's model, when the
    cluster knows it; ``path``: the cluster's ``PATH`` for a job that sets none.
    Raises :class:`~broker.core.adapter.Rejected` for a job that names its own devices.
    """
    from broker.core.adapter import Rejected

    named = [name for name in DEVICE_VARIABLES if name in spec.env]
    if named:
        raise Rejected(
            f"the job sets {', '.join(named)}: the cluster chooses the GPUs (Slurm for the GRES it grants, "
            "the Kubernetes device plugin for the resources it allocates); remove it (the job sees exactly "
            "the GPUs it was given)"
        )
    env = {"PATH": path, **{k: v for k, v in spec.env.items() if not k.startswith(RESERVED_PREFIX)}}
    fraction, budget = memory_budget(spec, placement, device_memory_gb)
    env[JOB_ID] = str(job_id)
    env[GPU_MEMORY_FRACTION] = f"{fraction:.4g}"
    if budget:
        env[GPU_MEMORY_GB] = f"{budget:g}"
    if spec.tenant:
        env[TENANT] = spec.tenant
    return env
