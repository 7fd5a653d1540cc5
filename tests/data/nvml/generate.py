"""Writes the documented-hardware recordings in this folder (run from the repository root).

    .venv/bin/python tests/data/nvml/generate.py

Each machine below is a short description of real hardware in a real state; a small
stand-in NVML (:class:`SpecLibrary`) answers the agent's calls from it as the real
driver does (the same structures, the same errors), and broker.nodeagent.nvml.record writes
the answers down. Tests read only the JSON files; this script is how they were made
and how to make another. A recording from a real GPU (integration/gpu/run_agent.py
--record) replaces the stand-in altogether.

Sources for the numbers are in README.md.
"""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace as S
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import pynvml  # noqa: E402

from broker.nodeagent.agent import record  # noqa: E402
from broker.nodeagent.nvml import VALUE_NOT_AVAILABLE_UINT, dump_recording  # noqa: E402

HERE = Path(__file__).resolve().parent
MIB = 1024 * 1024

# GPU instance profiles per product as `nvidia-smi mig -lgip` lists them:
# profile index (NVML_GPU_INSTANCE_PROFILE_*) -> (profile id, name, compute slices,
# instances, SMs, memory MiB, memory slots).
A100_40 = {
    0: (19, "MIG 1g.5gb", 1, 7, 14, 4864, 1),
    1: (14, "MIG 2g.10gb", 2, 3, 28, 9856, 2),
    2: (9, "MIG 3g.20gb", 3, 2, 42, 19968, 4),
    3: (5, "MIG 4g.20gb", 4, 1, 56, 19968, 4),
    4: (0, "MIG 7g.40gb", 7, 1, 98, 40192, 8),
    7: (20, "MIG 1g.5gb+me", 1, 1, 14, 4864, 1),
    9: (15, "MIG 1g.10gb", 1, 4, 14, 9856, 2),
}
A100_80 = {
    0: (19, "MIG 1g.10gb", 1, 7, 14, 9728, 1),
    1: (14, "MIG 2g.20gb", 2, 3, 28, 19968, 2),
    2: (9, "MIG 3g.40gb", 3, 2, 42, 40192, 4),
    3: (5, "MIG 4g.40gb", 4, 1, 56, 40192, 4),
    4: (0, "MIG 7g.80gb", 7, 1, 98, 80640, 8),
    7: (20, "MIG 1g.10gb+me", 1, 1, 14, 9728, 1),
    9: (15, "MIG 1g.20gb", 1, 4, 14, 19968, 2),
}
H100_80 = {
    0: (19, "MIG 1g.10gb", 1, 7, 16, 9984, 1),
    1: (14, "MIG 2g.20gb", 2, 3, 32, 20096, 2),
    2: (9, "MIG 3g.40gb", 3, 2, 60, 40448, 4),
    3: (5, "MIG 4g.40gb", 4, 1, 64, 40448, 4),
    4: (0, "MIG 7g.80gb", 7, 1, 132, 81152, 8),
    7: (20, "MIG 1g.10gb+me", 1, 1, 16, 9984, 1),
    9: (15, "MIG 1g.20gb", 1, 4, 26, 20096, 2),
}
H200 = {  # memory scaled from H100's profiles to 143771 MiB (see README.md)
    0: (19, "MIG 1g.18gb", 1, 7, 16, 17728, 1),
    1: (14, "MIG 2g.35gb", 2, 3, 32, 35584, 2),
    2: (9, "MIG 3g.71gb", 3, 2, 60, 71424, 4),
    3: (5, "MIG 4g.71gb", 4, 1, 64, 71424, 4),
    4: (0, "MIG 7g.141gb", 7, 1, 132, 143104, 8),
    7: (20, "MIG 1g.18gb+me", 1, 1, 16, 17728, 1),
    9: (15, "MIG 1g.35gb", 1, 4, 26, 35584, 2),
}

PRODUCTS = {  # NVML name -> (memory MiB, PCI device id, MIG profiles or None)
    "NVIDIA A100-SXM4-40GB": (40960, 0x20B010DE, A100_40),
    "NVIDIA A100-SXM4-80GB": (81920, 0x20B210DE, A100_80),
    "NVIDIA H100 80GB HBM3": (81559, 0x233010DE, H100_80),
    "NVIDIA H200": (143771, 0x233510DE, H200),
    "Tesla T4": (15360, 0x1EB810DE, None),
    "NVIDIA A100 80GB PCIe": (81920, 0x20B510DE, A100_80),
}


def gi_id(start: int, size: int) -> int:
    """The GPU instance id the driver gives a placement on an 8-slot GPU (as NVIDIA's examples show)."""
    return {8: {0: 0}, 4: {4: 1, 0: 2}, 2: {4: 3, 6: 4, 0: 5, 2: 6}, 1: {s: 7 + s for s in range(7)}}[size][start]


@dataclass
class Instance:
    profile: str  # "3g.20gb" (the name without "MIG ")
    start: int
    compute_instance: bool = True  # False: a GPU instance nobody created a compute instance in


@dataclass
class Proc:
    pid: int
    mib: int
    name: str | None  # None: NVML cannot name it (NVML_ERROR_NOT_FOUND, another PID namespace)
    on: int | None = None  # index into the GPU's instances
    mps_client: bool = False  # listed by nvmlDeviceGetMPSComputeRunningProcesses


@dataclass
class Gpu:
    product: str
    bus: int
    mig: tuple[int, int] | None = (0, 0)  # (current, pending); None for T4 (set automatically)
    instances: list[Instance] = field(default_factory=list)
    processes: list[Proc] = field(default_factory=list)
    compute_mode: int = 0
    lost: bool = False
    socket: int = 0  # its CPU socket, one NUMA node each (nvmlDeviceGetNumaNodeId, its CPUs' affinity)
    pcie_switch: int | None = None  # GPUs of one PCIe switch; None: a root port of its own


@dataclass
class Machine:
    file: str
    node: str
    description: str
    driver: str
    cuda: int
    gpus: list[Gpu]
    init_error: str | None = None
    same_gpus_as: str | None = None  # another file of the same machine: its GPUs keep their UUIDs
    # NVLink: "none" (NOT_SUPPORTED), "inactive" (links, none up), "switch" (every link to an NVSwitch
    # chip, links spread over ``switch_chips``), "pairs" (bridges: GPU 2k with 2k+1), "mesh" (every
    # GPU to every other, links shared evenly); ``links`` per GPU.
    nvlink: str = "none"
    links: int = 0
    switch_chips: int = 0
    cpus_per_socket: int = 64
    numa_supported: bool = True  # False: nvmlDeviceGetNumaNodeId answers NOT_SUPPORTED


def _err(name: str) -> pynvml.NVMLError:
    return pynvml.NVMLError(getattr(pynvml, name))


class SpecLibrary:
    """Answers the agent's NVML calls from a Machine, as the driver would."""

    def __init__(self, machine: Machine) -> None:
        self.m = machine

    def _uuid(self, *parts: Any) -> str:
        return str(uuid.uuid5(uuid.NAMESPACE_URL, "/".join(map(str, (self.m.same_gpus_as or self.m.file, *parts)))))

    def _profiles(self, gpu: Gpu) -> dict[int, tuple]:
        profiles = PRODUCTS[gpu.product][2]
        if profiles is None:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return profiles

    def _profile(self, gpu: Gpu, name: str) -> tuple[int, tuple]:
        for index, p in self._profiles(gpu).items():
            if p[1] == f"MIG {name}":
                return index, p
        raise KeyError(name)

    def _cis(self, gpu: Gpu) -> list[Instance]:
        return sorted((i for i in gpu.instances if i.compute_instance), key=lambda i: i.start)

    def nvmlInit(self):
        if self.m.init_error:
            raise _err(self.m.init_error)

    def nvmlShutdown(self):
        return None

    def nvmlSystemGetDriverVersion(self):
        return self.m.driver

    def nvmlSystemGetCudaDriverVersion(self):
        return self.m.cuda

    def nvmlSystemGetProcessName(self, pid):
        for gpu in self.m.gpus:
            for p in gpu.processes:
                if p.pid == pid:
                    if p.name is None:
                        raise _err("NVML_ERROR_NOT_FOUND")
                    return p.name
        raise _err("NVML_ERROR_NOT_FOUND")

    def nvmlDeviceGetCount(self):
        return len(self.m.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        gpu = self.m.gpus[index]
        if gpu.lost:
            raise _err("NVML_ERROR_GPU_IS_LOST")
        return ("gpu", index)

    def nvmlDeviceGetUUID(self, h):
        if h[0] == "mig":
            return "MIG-" + self._uuid(h[1], "gi", h[2].start)
        return "GPU-" + self._uuid(h[1])

    def nvmlDeviceGetName(self, h):
        return self.m.gpus[h[1]].product

    def nvmlDeviceGetMemoryInfo(self, h):
        gpu = self.m.gpus[h[1]]
        if h[0] == "mig":
            total = self._profile(gpu, h[2].profile)[1][5]
            i = gpu.instances.index(h[2])
            used = 13 + sum(p.mib for p in gpu.processes if p.on == i)
        else:
            total = PRODUCTS[gpu.product][0]
            used = (0 if gpu.mig and gpu.mig[0] else 5) + sum(p.mib for p in gpu.processes)
        return S(total=total * MIB, free=(total - used) * MIB, used=used * MIB)

    def nvmlDeviceGetPciInfo(self, h):
        gpu = self.m.gpus[h[1]]
        return S(
            busId=f"00000000:{gpu.bus:02X}:00.0",
            domain=0,
            bus=gpu.bus,
            device=0,
            pciDeviceId=PRODUCTS[gpu.product][1],
        )

    def nvmlDeviceGetComputeMode(self, h):
        return self.m.gpus[h[1]].compute_mode

    def nvmlDeviceGetMigMode(self, h):
        gpu = self.m.gpus[h[1]]
        self._profiles(gpu)
        return list(gpu.mig)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        self._profiles(self.m.gpus[h[1]])
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, index):
        cis = self._cis(self.m.gpus[h[1]])
        if index >= len(cis):
            raise _err("NVML_ERROR_NOT_FOUND")
        return ("mig", h[1], cis[index])

    def nvmlDeviceGetGpuInstanceId(self, h):
        return gi_id(h[2].start, self._profile(self.m.gpus[h[1]], h[2].profile)[1][6])

    def nvmlDeviceGetComputeInstanceId(self, h):
        return 0

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index):
        profiles = self._profiles(self.m.gpus[h[1]])
        if index not in profiles:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        pid, name, slices, count, sms, mib, _slots = profiles[index]
        return S(id=pid, sliceCount=slices, instanceCount=count, multiprocessorCount=sms, memorySizeMB=mib, name=name)

    def nvmlDeviceGetGpuInstances(self, h, profile_id):
        gpu = self.m.gpus[h[1]]
        return [("gi", h[1], i) for i in gpu.instances if self._profile(gpu, i.profile)[1][0] == profile_id]

    def nvmlGpuInstanceGetInfo(self, h):
        gpu = self.m.gpus[h[1]]
        pid, *_, slots = self._profile(gpu, h[2].profile)[1]
        return S(id=gi_id(h[2].start, slots), profileId=pid, placement=S(start=h[2].start, size=slots))

    def _procs(self, h, mps: bool):
        gpu = self.m.gpus[h[1]]
        out = []
        for p in gpu.processes:
            if p.mps_client != mps:
                continue
            gi = ci = VALUE_NOT_AVAILABLE_UINT
            if p.on is not None:
                inst = gpu.instances[p.on]
                gi, ci = gi_id(inst.start, self._profile(gpu, inst.profile)[1][6]), 0
            out.append(S(pid=p.pid, usedGpuMemory=p.mib * MIB, gpuInstanceId=gi, computeInstanceId=ci))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return self._procs(h, mps=False)

    # -- topology

    def nvmlDeviceGetNvLinkState(self, h, link):
        if self.m.nvlink == "none":
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        if link >= self.m.links:
            raise _err("NVML_ERROR_INVALID_ARGUMENT")
        return 0 if self.m.nvlink == "inactive" else 1

    def _peer(self, index: int, link: int) -> int | None:
        """The GPU a link reaches (None: an NVSwitch chip)."""
        if self.m.nvlink == "pairs":
            return index ^ 1
        if self.m.nvlink == "mesh":
            others = [i for i in range(len(self.m.gpus)) if i != index]
            return others[link // (self.m.links // len(others))]
        return None

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return 2 if self._peer(h[1], link) is None else 0  # NVML_NVLINK_DEVICE_TYPE_SWITCH / _GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        peer = self._peer(h[1], link)
        if peer is None:  # the NVSwitch chips' own bus ids
            return S(busId=f"00000000:{0xC0 + link % self.m.switch_chips:02X}:00.0")
        return S(busId=f"00000000:{self.m.gpus[peer].bus:02X}:00.0")

    def nvmlDeviceGetNumaNodeId(self, h):
        if not self.m.numa_supported:
            raise _err("NVML_ERROR_NOT_SUPPORTED")
        return self.m.gpus[h[1]].socket

    def nvmlDeviceGetCpuAffinity(self, h, words):
        first = self.m.gpus[h[1]].socket * self.m.cpus_per_socket
        mask = [0] * words
        for cpu in range(first, first + self.m.cpus_per_socket):
            mask[cpu // 64] |= 1 << (cpu % 64)
        return mask

    def nvmlDeviceGetTopologyCommonAncestor(self, h1, h2):
        a, b = self.m.gpus[h1[1]], self.m.gpus[h2[1]]
        if a.pcie_switch is not None and a.pcie_switch == b.pcie_switch:
            return 10  # NVML_TOPOLOGY_SINGLE
        return 40 if a.socket == b.socket else 50  # NVML_TOPOLOGY_NODE, NVML_TOPOLOGY_SYSTEM

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        return self._procs(h, mps=True)


def mig(*layout: tuple[str, int], pending: int = 1, no_ci: tuple[int, ...] = ()) -> dict[str, Any]:
    instances = [Instance(p, s, i not in no_ci) for i, (p, s) in enumerate(layout)]
    return {"mig": (1, pending), "instances": instances}


DGX_A100_BUS = (0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD)
DGX_H100_BUS = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
PCIE_SERVER_BUS = (0x1B, 0x1C, 0x3D, 0x3E, 0x9B, 0x9C, 0xBD, 0xBE)
A40, A80, H100, H200N, T4, A80P = (
    "NVIDIA A100-SXM4-40GB",
    "NVIDIA A100-SXM4-80GB",
    "NVIDIA H100 80GB HBM3",
    "NVIDIA H200",
    "Tesla T4",
    "NVIDIA A100 80GB PCIe",
)


def placed(gpus: list[Gpu], per_socket: int, per_switch: int | None = None) -> list[Gpu]:
    """``gpus`` with GPU i on socket i // per_socket and PCIe switch i // per_switch (None: none shared)."""
    for i, gpu in enumerate(gpus):
        gpu.socket = i // per_socket
        gpu.pcie_switch = None if per_switch is None else i // per_switch
    return gpus


# NVSwitch nodes: every NVLink of a GPU ends at a switch chip (DGX A100: 12 links over 6 chips;
# DGX/HGX H100 and H200: 18 over 4), so all eight GPUs are one island.
DGX_A100_LINKS = {"nvlink": "switch", "links": 12, "switch_chips": 6}
DGX_H100_LINKS = {"nvlink": "switch", "links": 18, "switch_chips": 4}
PAIR_LINKS = {"nvlink": "pairs", "links": 12}  # A100: 12 NVLink links, all to its partner


def seven(profile: str) -> dict[str, Any]:
    return mig(*[(profile, s) for s in range(7)])


MACHINES = [
    Machine(
        "a100-40gb-dgx.json",
        "dgxa100-01",
        "DGX A100 (8x A100-SXM4-40GB): GPU 0 mixed MIG 2g.10gb+1g.5gb+1g.5gb+3g.20gb, GPU 1 7x 1g.5gb, "
        "GPU 2 one 7g.40gb, GPU 3 MIG on with no instances yet, GPUs 4-7 whole (GPU 6 runs a process "
        "from another PID namespace that NVML cannot name). Topology (synthetic): NVSwitch, 12 links per GPU "
        "over 6 switch chips (one island of 8); GPU pairs 0-1, 2-3, 4-5, 6-7 behind one PCIe switch each; "
        "GPUs 0-3 on socket 0, 4-7 on socket 1",
        "550.54.15",
        12040,
        placed(
            [
                Gpu(
                    A40,
                    DGX_A100_BUS[0],
                    **mig(("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)),
                    processes=[Proc(41022, 12034, "/usr/bin/python3", on=3), Proc(41187, 3012, "python3", on=1)],
                ),
                Gpu(
                    A40,
                    DGX_A100_BUS[1],
                    **seven("1g.5gb"),
                    processes=[Proc(52210, 4100, "/opt/conda/bin/python", on=0)],
                ),
                Gpu(A40, DGX_A100_BUS[2], **mig(("7g.40gb", 0)), processes=[Proc(60001, 30210, "torchrun", on=0)]),
                Gpu(A40, DGX_A100_BUS[3], mig=(1, 1)),
                Gpu(A40, DGX_A100_BUS[4], processes=[Proc(38115, 38012, "/usr/bin/python3")]),
                Gpu(A40, DGX_A100_BUS[5]),
                Gpu(A40, DGX_A100_BUS[6], processes=[Proc(1733, 20480, None)]),
                Gpu(A40, DGX_A100_BUS[7]),
            ],
            4,
            2,
        ),
        **DGX_A100_LINKS,
    ),
    Machine(
        "a100-80gb.json",
        "a100-80-01",
        "HGX A100 4-GPU (A100-SXM4-80GB): GPU 0 2x 3g.40gb, GPU 1 4g.40gb (GPU instance without a "
        "compute instance) + 2g.20gb + 1g.10gb, GPUs 2-3 whole. Topology (synthetic): NVLink between every "
        "two GPUs (4 of each GPU's 12 links to each other GPU), GPUs 0-1 on socket 0, 2-3 on socket 1",
        "535.129.03",
        12020,
        placed(
            [
                Gpu(A80, 0x01, **mig(("3g.40gb", 0), ("3g.40gb", 4)), processes=[Proc(7021, 30500, "python3", on=1)]),
                Gpu(A80, 0x41, **mig(("4g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6), no_ci=(0,))),
                Gpu(A80, 0x81, processes=[Proc(9950, 61200, "python3")]),
                Gpu(A80, 0xC1),
            ],
            2,
        ),
        nvlink="mesh",
        links=12,
    ),
    Machine(
        "h100-80gb-dgx.json",
        "dgxh100-01",
        "DGX H100 (8x H100 80GB HBM3): GPU 0 7x 1g.10gb (GPU instances 7-13), GPUs 1-7 whole. Topology "
        "(synthetic): NVSwitch, 18 links per GPU over 4 switch chips (one island of 8); each GPU behind a PCIe "
        "switch of its own; GPUs 0-3 on socket 0, 4-7 on socket 1",
        "535.183.01",
        12020,
        placed(
            [
                Gpu(H100, DGX_H100_BUS[0], **seven("1g.10gb"), processes=[Proc(88120, 8200, "python3", on=2)]),
                *[Gpu(H100, b) for b in DGX_H100_BUS[1:4]],
                Gpu(H100, DGX_H100_BUS[4], processes=[Proc(90311, 79000, "python3")]),
                *[Gpu(H100, b) for b in DGX_H100_BUS[5:]],
            ],
            4,
        ),
        **DGX_H100_LINKS,
        cpus_per_socket=56,
    ),
    Machine(
        "h200.json",
        "h200-01",
        "HGX H200 (8x H200 141 GB): GPU 0 MIG 2g.35gb+1g.18gb+1g.18gb+3g.71gb, GPU 1 7x 1g.18gb, GPUs 2-7 whole. "
        "Topology (synthetic): NVSwitch, 18 links per GPU (one island of 8); GPUs 0-3 on socket 0, 4-7 on socket 1",
        "550.90.07",
        12040,
        placed(
            [
                Gpu(H200N, DGX_H100_BUS[0], **mig(("2g.35gb", 0), ("1g.18gb", 2), ("1g.18gb", 3), ("3g.71gb", 4))),
                Gpu(H200N, DGX_H100_BUS[1], **seven("1g.18gb")),
                *[Gpu(H200N, b) for b in DGX_H100_BUS[2:]],
            ],
            4,
        ),
        **DGX_H100_LINKS,
    ),
    Machine(
        "mig-pending.json",
        "a100-80-02",
        "2x A100-SXM4-80GB waiting for a GPU reset: GPU 0 MIG off, pending on; GPU 1 MIG on (one 7g.80gb), pending off",
        "535.129.03",
        12020,
        [Gpu(A80, 0x01, mig=(0, 1)), Gpu(A80, 0x41, **mig(("7g.80gb", 0), pending=0))],
        **PAIR_LINKS,
    ),
    Machine(
        "mps01.json",
        "mps01",
        "The integration Slurm cluster's mps01 (gres gpu:a100:1,mps:100): one A100-SXM4-40GB in "
        "EXCLUSIVE_PROCESS mode served by an MPS control daemon, its server and two clients",
        "550.54.15",
        12040,
        [
            Gpu(
                A40,
                0x07,
                compute_mode=3,
                processes=[
                    Proc(2201, 30, "nvidia-cuda-mps-server"),
                    Proc(2240, 6012, "python3", mps_client=True),
                    Proc(2251, 4208, "python3", mps_client=True),
                ],
            )
        ],
        nvlink="inactive",
        links=12,
    ),
    Machine(
        "gpu-lost.json",
        "dgxh100-02",
        "4x H100 80GB HBM3; GPU 2 fell off the bus: NVML cannot get its handle (NVML_ERROR_GPU_IS_LOST)",
        "535.183.01",
        12020,
        [
            Gpu(H100, DGX_H100_BUS[0]),
            Gpu(H100, DGX_H100_BUS[1], processes=[Proc(4410, 51000, "python3")]),
            Gpu(H100, DGX_H100_BUS[2], lost=True),
            Gpu(H100, DGX_H100_BUS[3]),
        ],
        **DGX_H100_LINKS,
    ),
    Machine(
        "t4.json",
        "t4-01",
        "4x Tesla T4 (not MIG-capable: nvmlDeviceGetMigMode raises NVML_ERROR_NOT_SUPPORTED); GPU 3 idle "
        "in EXCLUSIVE_PROCESS mode. Topology (synthetic): no NVLink (nvmlDeviceGetNvLinkState raises "
        "NVML_ERROR_NOT_SUPPORTED), each GPU on a root port of its own, GPUs 0-1 on socket 0 and 2-3 on socket 1; "
        "nvmlDeviceGetNumaNodeId raises NVML_ERROR_NOT_SUPPORTED",
        "535.161.08",
        12020,
        placed(
            [
                Gpu(T4, 0x3B, mig=None, processes=[Proc(1201, 7800, "python3")]),
                Gpu(T4, 0x5E, mig=None),
                Gpu(T4, 0x86, mig=None),
                Gpu(T4, 0xAF, mig=None, compute_mode=3),
            ],
            2,
        ),
        cpus_per_socket=20,
        numa_supported=False,
    ),
    Machine(
        "mig01.json",
        "mig01",
        "The integration Slurm cluster's mig01 (gres gpu:1g.5gb:7,gpu:3g.20gb:2): two A100-SXM4-40GB, "
        "GPU 0 7x 1g.5gb, GPU 1 2x 3g.20gb",
        "550.54.15",
        12040,
        [Gpu(A40, 0x07, **seven("1g.5gb")), Gpu(A40, 0x0F, **mig(("3g.20gb", 0), ("3g.20gb", 4)))],
        **PAIR_LINKS,
    ),
    Machine(
        "mig01-repartitioned.json",
        "mig01",
        "mig01 after GPU 1 was re-cut to 3x 2g.10gb while gres.conf still says gpu:3g.20gb:2 (drift: Slurm "
        "offers 3g.20gb slices that no longer exist); GPU 0 7x 1g.5gb as before",
        "550.54.15",
        12040,
        [Gpu(A40, 0x07, **seven("1g.5gb")), Gpu(A40, 0x0F, **mig(("2g.10gb", 0), ("2g.10gb", 2), ("2g.10gb", 4)))],
        same_gpus_as="mig01.json",
        **PAIR_LINKS,
    ),
    Machine(
        "mig01-mixed.json",
        "mig01",
        "mig01 with GPU 0 cut as 2g.10gb+1g.5gb+1g.5gb+3g.20gb (idle) and GPU 1 2x 3g.20gb",
        "550.54.15",
        12040,
        [
            Gpu(A40, 0x07, **mig(("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4))),
            Gpu(A40, 0x0F, **mig(("3g.20gb", 0), ("3g.20gb", 4))),
        ],
        same_gpus_as="mig01.json",
        **PAIR_LINKS,
    ),
    Machine(
        "gpu01.json",
        "gpu01",
        "The integration Slurm cluster's gpu01 (gres gpu:a100:2): two whole A100-SXM4-40GB, MIG off",
        "550.54.15",
        12040,
        [Gpu(A40, 0x07), Gpu(A40, 0x0F)],
        **PAIR_LINKS,
    ),
    Machine(
        "a100-pcie-nvlink-pairs.json",
        "a100pcie-01",
        "PCIe server, 8x A100 80GB PCIe, all whole and idle. Topology (synthetic): NVLink bridges join GPU pairs "
        "0-1, 2-3, 4-5, 6-7 (3 bridges, 12 links per pair); two PCIe switches per socket, each holding one "
        "bridged pair; GPUs 0-3 on socket 0, 4-7 on socket 1",
        "550.54.15",
        12040,
        placed([Gpu(A80P, b) for b in PCIE_SERVER_BUS], 4, 2),
        **PAIR_LINKS,
    ),
    Machine(
        "no-driver.json",
        "cpu-01",
        "A node without a loaded NVIDIA driver: nvmlInit raises NVML_ERROR_DRIVER_NOT_LOADED",
        "",
        0,
        [],
        init_error="NVML_ERROR_DRIVER_NOT_LOADED",
    ),
]


def main() -> None:
    for machine in MACHINES:
        for gpu in machine.gpus:
            if PRODUCTS[gpu.product][2] is None:
                gpu.mig = None
        recording = record(
            SpecLibrary(machine),
            machine=machine.node,
            description=machine.description,
            source="generated by tests/data/nvml/generate.py from NVIDIA's documentation (see README.md)",
        )
        (HERE / machine.file).write_text(dump_recording(recording))
        print(f"wrote {machine.file}: {len(recording['calls'])} calls")


if __name__ == "__main__":
    main()
