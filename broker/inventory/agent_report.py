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
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from broker.core.clock import within_supported_years
from broker.core.spec_values import not_a_bool
from broker.core.topology import GPU_LEVELS, GpuTopology

REPORT_VERSION = 1

# Any agent token may post a report, so every number and list is bounded to what a real
# node can have (an unbounded integer once crashed the report's storage with a 500), and
# a bool is no number (pydantic took true for 1).
Int = Annotated[int, BeforeValidator(not_a_bool)]
Count = Annotated[Int, Field(ge=0, le=2**31 - 1)]
MiB = Annotated[Int, Field(ge=0, le=2**40)]  # a mebibyte count up to an exbibyte
Text = Annotated[str, Field(max_length=256)]
MAX_GPUS = 64  # per node; the largest servers have 16
MAX_MIG_INSTANCES = 64  # per GPU; NVML allows 7 (A100/H100)
MAX_PROCESSES = 4096  # per GPU
MAX_NVLINKS = 36  # per GPU: pynvml's NVML_NVLINK_MAX_LINKS (H100 and B200 have 18)
GpuIndex = Annotated[Int, Field(ge=0, lt=MAX_GPUS)]
# A Linux cpulist ("0-31,64-95"), as /sys and Slurm's Cores= write CPU sets.
CpuList = Annotated[str, Field(max_length=1024, pattern=r"^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=4096)


class MigInstance(_Strict):
    """One MIG GPU instance (and its compute instance) as NVML lists it."""

    profile: Text  # "1g.10gb", from the GPU instance profile's slice count and memory
    gi_id: Count  # GPU instance id
    ci_id: Count | None = None  # compute instance id (None: no compute instance created)
    uuid: Text | None = None  # "MIG-…", what CUDA_VISIBLE_DEVICES and the device plugin use
    placement_start: Count  # first memory slot
    placement_size: Count  # memory slots taken
    memory_mb: MiB | None = None


class GpuProcess(_Strict):
    pid: Count
    used_memory_mb: MiB | None = None
    name: Text | None = None  # the process's command name, when the agent can read it
    mig_uuid: str | None = None  # the MIG instance it runs on, if any


class NvLinkPeer(_Strict):
    """What one GPU's active NVLink links reach, one record per peer (broker.nodeagent.topology)."""

    kind: Literal["gpu", "switch", "other"]  # NVML_NVLINK_DEVICE_TYPE_GPU, _SWITCH, anything else
    gpu: GpuIndex | None = None  # the peer GPU's index on this node (kind "gpu" only)
    pci_bus_id: Text | None = None  # the peer's, as NVML gives it
    links: Annotated[Int, Field(ge=1, le=MAX_NVLINKS)]  # active links to it


class GpuReport(_Strict):
    index: Annotated[Int, Field(ge=0, lt=MAX_GPUS)]  # NVML's device index (what gres.conf File= orders by)
    uuid: Text | None = None  # "GPU-…"
    product: Text | None = None  # NVML's name: "NVIDIA A100-SXM4-80GB"
    memory_mb: MiB | None = None
    pci_bus_id: Text | None = None
    mig_mode_current: bool | None = None  # None: the GPU is not MIG-capable or NVML did not say
    mig_mode_pending: bool | None = None  # differs from current until the GPU is reset
    mig_instances: list[MigInstance] = Field(default_factory=list, max_length=MAX_MIG_INSTANCES)
    mps: bool = False  # an MPS control daemon serves this GPU
    processes: list[GpuProcess] = Field(default_factory=list, max_length=MAX_PROCESSES)
    error: str | None = None  # what NVML said when reading this GPU failed (the rest still counts)
    # Topology (None/empty: NVML did not say): the NUMA node, the CPUs close to it, its NVLink peers.
    numa_node: Annotated[Int, Field(ge=0, le=4095)] | None = None
    cpu_affinity: CpuList | None = None
    nvlinks: list[NvLinkPeer] = Field(default_factory=list, max_length=MAX_NVLINKS)


Group = Annotated[list[GpuIndex], Field(min_length=1, max_length=MAX_GPUS)]
Groups = Annotated[list[Group], Field(max_length=MAX_GPUS)]


class GpuGroups(_Strict):
    """The node's GPUs grouped by closeness, as :class:`broker.core.topology.GpuTopology`
    writes it (``to_dict``): each level's groups are disjoint lists of device indexes."""

    nvlink: Groups = Field(default_factory=list)
    pcie: Groups = Field(default_factory=list)
    socket: Groups = Field(default_factory=list)
    source: Literal["nvml"] = "nvml"

    @model_validator(mode="after")
    def _disjoint(self) -> GpuGroups:
        for level in GPU_LEVELS:
            seen: set[int] = set()
            for group in getattr(self, level):
                twice = seen.intersection(group)
                if twice or len(set(group)) < len(group):
                    raise ValueError(
                        f"{level}: GPU {min(twice or group)} is in more than one group; each GPU belongs "
                        "to one group per level"
                    )
                seen.update(group)
        return self

    def gpu_topology(self) -> GpuTopology:
        return GpuTopology.from_dict(self.model_dump())


class MigRefusal(_Strict):
    """A MIG layout the broker asked for (``gpush mig apply``) that the agent did not make, and why."""

    change: Annotated[Int, Field(ge=1, le=2**63 - 1)]  # the MIG change's id (a BIGINT)
    gpu: Annotated[Int, Field(ge=0, lt=MAX_GPUS)]
    why: Text


class NodeReport(_Strict):
    # The node's name as the clusters know it (hostname -s by default): a DNS name.
    node: str = Field(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?$")
    report_version: Annotated[Int, Field(ge=1, le=1000)] = REPORT_VERSION
    agent_version: Text
    collected_at: Annotated[datetime, AfterValidator(within_supported_years)]
    driver_version: Text | None = None
    cuda_version: Text | None = None
    gpus: list[GpuReport] = Field(default_factory=list, max_length=MAX_GPUS)
    error: str | None = None  # NVML could not be read at all (no driver, no library)
    # Layouts asked for in the answer to the last report that the agent refused or failed to make.
    mig_refused: list[MigRefusal] = Field(default_factory=list, max_length=MAX_GPUS)
    # How close the GPUs are, as NVML says (None: an agent before topology, or NVML said nothing).
    topology: GpuGroups | None = None
