"""What the node agent (``gpush agent``) tells the broker about one node's GPUs.

The agent reads the GPUs through NVML (broker.nodeagent.nvml) and posts one
:class:`NodeReport` per interval. The broker keeps the newest report per node and
merges it with what Slurm and Kubernetes say (broker.inventory.reconcile). This schema is the
contract between the two: the agent fills what NVML answered and leaves None where
it could not tell; an NVML error on one GPU is that GPU's ``error``, never the end of
the report.

Memory is in MiB as NVML reports it; products are NVML's names ("NVIDIA
A100-SXM4-80GB"), which broker.core.gpus maps to gpush's models.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

REPORT_VERSION = 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MigInstance(_Strict):
    """One MIG GPU instance (and its compute instance) as NVML lists it."""

    profile: str  # "1g.10gb", from the GPU instance profile's slice count and memory
    gi_id: int  # GPU instance id
    ci_id: int | None = None  # compute instance id (None: no compute instance created)
    uuid: str | None = None  # "MIG-…", what CUDA_VISIBLE_DEVICES and the device plugin use
    placement_start: int  # first memory slot
    placement_size: int  # memory slots taken
    memory_mb: int | None = None


class GpuProcess(_Strict):
    pid: int
    used_memory_mb: int | None = None
    name: str | None = None  # the process's command name, when the agent can read it
    mig_uuid: str | None = None  # the MIG instance it runs on, if any


class GpuReport(_Strict):
    index: int  # NVML's device index on the node (what Slurm's gres.conf File= orders by)
    uuid: str | None = None  # "GPU-…"
    product: str | None = None  # NVML's name: "NVIDIA A100-SXM4-80GB"
    memory_mb: int | None = None
    pci_bus_id: str | None = None
    mig_mode_current: bool | None = None  # None: the GPU is not MIG-capable or NVML did not say
    mig_mode_pending: bool | None = None  # differs from current until the GPU is reset
    mig_instances: list[MigInstance] = Field(default_factory=list)
    mps: bool = False  # an MPS control daemon serves this GPU
    processes: list[GpuProcess] = Field(default_factory=list)
    error: str | None = None  # what NVML said when reading this GPU failed (the rest still counts)


class NodeReport(_Strict):
    node: str  # the node's name as the clusters know it (hostname -s by default)
    report_version: int = REPORT_VERSION
    agent_version: str
    collected_at: datetime
    driver_version: str | None = None
    cuda_version: str | None = None
    gpus: list[GpuReport] = Field(default_factory=list)
    error: str | None = None  # NVML could not be read at all (no driver, no library)
